"""`jaxodc train --groups G --ranks W --diloco H`: one job across G sites of W ranks each.

On one machine this process starts the coordination service and one `jaxodc launch -n W` per site
(the links between sites emulated with --wan-mbps / --wan-ms); across real hosts each site runs its
own launch with --coord HOST:PORT of a `jaxodc master` and --site S (README, "Across sites"). A
site's ranks train with ODC inside the site and with DiLoCo (or hybrid sharding) across sites
(jaxodc.optim.sites). Each site's rank 0 prints a line per outer step and writes every rank's
records to --json (one file per site: PATH.siteS.json)."""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict

JSON_SUFFIX = ".site{}.json"     # at the end: every rank's records and final shards
JSONL_SUFFIX = ".site{}.jsonl"   # a line per outer step, as it happens


def add_arguments(p) -> None:
    a = p.add_argument
    a("--groups", type=int, default=0, help="sites (groups of --ranks ranks) trained as one job; 0: one site, no "
                                           "cross-site exchange")
    a("--diloco", type=int, default=0, metavar="H", help="DiLoCo across sites every H inner minibatches")
    a("--hybrid", action="store_true", help="hybrid sharding across sites: every minibatch's gradient averaged")
    a("--async", dest="async_diloco", action="store_true", help="async DiLoCo (outer all-reduce overlapped, "
                                                                 "applied one outer step late)")
    a("--quantize", default="none", choices=("none", "uint8", "uint16"), help="pseudo-gradient transfer format")
    a("--outer-lr", type=float, default=0.7, help="DiLoCo outer Nesterov SGD learning rate")
    a("--outer-momentum", type=float, default=0.9, help="DiLoCo outer momentum (0: plain SGD)")
    a("--wan-mbps", type=float, default=0.0, help="emulate links of this many Mbit/s between sites")
    a("--wan-ms", type=float, default=0.0, help="emulate this many ms of one-way latency between sites")
    a("--coord", metavar="HOST:PORT", help="the coordination service of a job across hosts (jaxodc master)")
    a("--site", type=int, default=-1, help="this site's id when started by hand across hosts")
    a("--secret-file", metavar="FILE", help="the job's shared secret (the master's --secret-file)")
    a("--stop-file", metavar="PATH", help="sites leave at the next outer step once this file exists")
    a("--trace-sites", action="store_true", help=argparse.SUPPRESS)  # a line per inner minibatch and exchange
    a("--heartbeat-timeout", type=float, default=10.0, metavar="S",
      help="give the service up after S s of silence; a cross-site transfer stalled S s fails (the master's value)")
    a("--rejoin", type=float, default=0.0, metavar="S", help="a site that lost the service (a partition) registers "
                                                           "again for up to S s and is voted back in (DiLoCo)")
    a("--join", action="store_true", help="this site joins a running job (voted in at its next outer step) "
                                          "instead of founding it with the other --groups sites")


def enabled(args) -> bool:
    return args.groups > 0 or args.coord is not None


def check(args) -> None:
    if args.diloco < 0:
        raise ValueError(f"--diloco must be >= 0, got {args.diloco}")
    if not enabled(args):
        if args.diloco or args.hybrid or args.async_diloco:
            raise ValueError("--diloco / --hybrid / --async need --groups G (or --coord across hosts)")
        return
    if bool(args.diloco) == bool(args.hybrid):
        raise ValueError("across sites give either --diloco H or --hybrid")
    if args.hybrid and args.async_diloco:
        raise ValueError("--async applies to --diloco, not --hybrid")
    if args.comm != "odc":
        raise ValueError(f"sites shard with ODC inside a site; --comm {args.comm} is not supported with --groups")
    if args.coord and args.site < 0:
        raise ValueError("--coord needs --site S (this site's id)")


def config_of(args, secret: bytes):
    from jaxodc.odc import Link
    from jaxodc.optim.sites import SiteConfig
    return SiteConfig(address=args.coord, secret=secret, mode="hybrid" if args.hybrid else "diloco",
                      inner_steps=args.diloco or 1, asynchronous=args.async_diloco,
                      quantize=None if args.quantize == "none" else args.quantize, outer_lr=args.outer_lr,
                      outer_momentum=args.outer_momentum,
                      wan=Link(args.wan_mbps, args.wan_ms) if args.wan_mbps or args.wan_ms else None,
                      timeout_s=60.0, founders=max(args.groups, 1), heartbeat_timeout_s=args.heartbeat_timeout,
                      rejoin_s=args.rejoin)


def outer_steps(args) -> int:
    """--steps counts each site's inner minibatches (the token budget); outer steps cover them."""
    return -(-args.steps // (args.diloco or 1))


def _read_secret(path: str | None) -> bytes:
    """As `jaxodc master --secret-file` reads it (an empty file is refused). Not the launcher's job
    secret: each site's launcher makes its own, and the service is shared by every site."""
    from jaxodc import auth
    return auth.read_secret_file(path) if path else b""


# --------------------------------------------------------------------------- rank side

def worker(args, model_of, load_samples) -> None:
    """One rank of one site: the site's ODC trainer, then outer steps until the job has done
    outer_steps(args) of them (a newcomer learns the job's count at its first sync)."""
    import optax

    from jaxodc.balance.cost import CostModel
    from jaxodc.launch.context import init_from_env, shutdown
    from jaxodc.optim.clipping import clip_by_global_norm
    from jaxodc.train.api import Trainer
    from jaxodc.optim.sites import SiteRank, site_minibatches

    ctx = init_from_env()
    say = (lambda *a: print(*a, flush=True)) if ctx.rank == 0 else (lambda *a: None)
    model, params = model_of(args)
    opt = optax.adam(args.lr)
    if args.clip > 0:
        opt = optax.chain(clip_by_global_norm(args.clip), opt)
    samples = load_samples(args, ctx.world)
    cfg = config_of(args, _read_secret(args.secret_file))
    H = args.diloco or 1
    total = outer_steps(args)
    stream = args.json + JSONL_SUFFIX.format(args.site) if args.json and ctx.rank == 0 else None
    try:
        trainer = Trainer(model, opt, comm="odc", balance=args.balance or "lb_mini", max_tokens=args.max_tokens,
                          params=params, cost=CostModel.for_transformer(args.d_model), ctx=ctx,
                          min_bucket=args.min_bucket or None, precision=args.precision, transport=args.transport,
                          reproducible=True if args.reproducible else None)
        site = SiteRank(trainer, cfg, site=args.site, join=args.join)
        try:
            while True:
                events = site.begin()
                k = site.outer_step_count()
                stop = args.stop_file is not None and os.path.exists(args.stop_file)
                # every rank of the site leaves at the same outer step
                if k >= total or any(ctx.allgather("jaxodc/sites/stop", b"1" if stop else b"")):
                    break
                mbs = site_minibatches(len(samples), args.minibatch, ctx.world, args.site, k, H, seed=2)
                trace = args.trace_sites and ctx.rank == 0
                rec = site.outer_step(
                    samples.tokens, mbs,
                    on_minibatch=(lambda r, k=k: say(f"site {args.site} outer step {k}: minibatch {r.step} done "
                                                     f"at {time.time():.3f}")) if trace else None,
                    on_exchange=(lambda k=k: say(f"site {args.site} outer step {k}: exchange")) if trace else None)
                rec.events = events + rec.events
                every = [json.loads(b) for b in ctx.allgather("jaxodc/sites/record", json.dumps(asdict(rec)).encode())]
                if stream:  # a line per outer step: what a killed site did survives it
                    with open(stream, "a") as f:
                        f.write(json.dumps(every) + "\n")
                for e in rec.events:
                    say(f"site {args.site}: {e}")
                say(f"site {args.site} outer step {k}: loss {rec.loss:.4f}, sites {rec.sites}, "
                    f"{rec.seconds:.2f} s ({rec.compute_s:.2f} s inner), {rec.bytes_sent / 1e6:.3g} MB sent by rank 0")
            site.finish()
            final, sent = site.global_shards(), site.bytes_sent()
        finally:
            site.close()
        trainer.close()
    except BaseException:
        ctx.rendezvous.close()  # no final barrier: the other ranks may be stuck
        if ctx.server is not None:
            ctx.server.close()
        raise
    import numpy as np
    mine = {"shards": {k: np.asarray(v, np.float32).astype(float).tolist() for k, v in final.items()},
            "bytes_sent": sent}
    every = [json.loads(b) for b in ctx.allgather("jaxodc/sites/final", json.dumps(mine).encode())]
    if stream:
        out = {"site": args.site, "records": read_records(args.json, args.site),
               "shards": [e["shards"] for e in every], "bytes_sent": [e["bytes_sent"] for e in every]}
        path = args.json + JSON_SUFFIX.format(args.site)
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)
    shutdown(ctx)


def read_records(json_path: str, site: int) -> list[dict]:
    """Every rank's outer-step records of `site` streamed so far (also of a site that died)."""
    path = json_path + JSONL_SUFFIX.format(site)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for line in f if line.strip() for r in json.loads(line)]


# --------------------------------------------------------------------------- this machine

def start_site(args, worker_argv: list[str], site: int, coord: str, secret_file: str, *, stdout=None,
               stderr=None) -> subprocess.Popen:
    """`jaxodc launch -n W` of one site's ranks, in its own session (a site ends as one)."""
    from jaxodc.launch.launcher import rank_env_defaults, rank_pythonpath
    env = {**os.environ, **rank_env_defaults(), "PYTHONPATH": rank_pythonpath()}
    argv = list(worker_argv) + ["--coord", coord, "--site", str(site), "--secret-file", secret_file]
    cmd = [sys.executable, "-m", "jaxodc", "launch", "-n", str(args.ranks), "--timeout", str(int(args.timeout)),
           "-m", "jaxodc.cli.train"] + argv
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                            start_new_session=True)


OUTER_LINE = re.compile(r"site (\d+) outer step (\d+): loss")


def rank_pids(launcher_pid: int) -> list[int]:
    """The rank processes of a site's launcher (its children), by pid."""
    try:
        with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
            return sorted(int(x) for x in f.read().split())
    except OSError:
        return []


class LocalJob:
    """The coordination service in this process, a secret file and the sites' launchers, whose
    output is echoed (with `echo`) and watched for outer-step lines."""

    def __init__(self, args, worker_argv: list[str], echo=print):
        from jaxodc.coord.service import CoordinatorService
        self.args, self.worker_argv, self.echo = args, worker_argv, echo
        secret = secrets.token_hex(32).encode()
        fd, self.secret_file = tempfile.mkstemp(prefix="jaxodc_sites_", suffix=".secret")
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        # a dead site is noticed by its closed sockets at once; the timeout covers a silent host
        self.service = CoordinatorService("127.0.0.1", 0, secret, heartbeat_timeout_s=5.0).start()
        self.sites: dict[int, subprocess.Popen] = {}
        self.outer_done = 0          # outer steps the job has completed (any site's line)
        self.lines: list[tuple[float, str]] = []
        self._cv = threading.Condition()
        self._readers: list[threading.Thread] = []

    def start(self, site: int, join: bool = False) -> subprocess.Popen:
        argv = self.worker_argv + (["--join"] if join else [])
        p = start_site(self.args, argv, site, self.service.address, self.secret_file,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.sites[site] = p
        t = threading.Thread(target=self._read, args=(p,), daemon=True)
        t.start()
        self._readers.append(t)
        return p

    def _read(self, p: subprocess.Popen) -> None:
        for raw in p.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            m = OUTER_LINE.search(line)
            with self._cv:
                self.lines.append((time.time(), line))
                if m:
                    self.outer_done = max(self.outer_done, int(m.group(2)) + 1)
                self._cv.notify_all()
            if self.echo is not None:
                self.echo(line)

    def wait_for(self, pattern: str, timeout_s: float) -> str:
        """The first line from now on that matches `pattern`."""
        rx, seen = re.compile(pattern), len(self.lines)
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                for _, line in self.lines[seen:]:
                    if rx.search(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line matching {pattern!r} within {timeout_s:g} s")
                self._cv.wait(left)

    def wait_outer(self, k: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self.outer_done < k:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the job reached outer step {self.outer_done}, not {k}, within {timeout_s:g} s")
                self._cv.wait(left)

    def kill_rank(self, site: int, index: int = -1) -> int:
        """SIGKILLs one rank of `site` (its launcher then ends the site's other ranks); returns
        the pid."""
        pids = rank_pids(self.sites[site].pid)
        if not pids:
            raise RuntimeError(f"site {site} has no running ranks to kill")
        os.kill(pids[index], signal.SIGKILL)
        return pids[index]

    def wait(self, sites=None, timeout_s: float | None = None) -> dict[int, int]:
        """Exit status of each of `sites` (default all), waiting at most timeout_s in all."""
        deadline = time.monotonic() + (self.args.timeout if timeout_s is None else timeout_s)
        out = {}
        for s in (self.sites if sites is None else sites):
            try:
                out[s] = self.sites[s].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out[s] = 124
        for t in self._readers:
            t.join(timeout=5)
        return out

    def close(self) -> None:
        for p in self.sites.values():
            if p.poll() is None:
                p.terminate()  # the launcher forwards it to its ranks
        for p in self.sites.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.service.stop()
        os.unlink(self.secret_file)


def run_local(args, worker_argv: list[str]) -> int:
    """Starts G sites on this machine and waits for them; returns the worst exit status."""
    remove_records(args.json, args.groups)
    job = LocalJob(args, worker_argv)
    try:
        for s in range(args.groups):
            job.start(s)
        status = 0
        for s, rc in job.wait().items():
            if rc:
                print(f"jaxodc train: site {s} ended with status {rc}", file=sys.stderr)
            status = status or rc
        return status
    finally:
        job.close()


def report(json_path: str, groups: int) -> None:
    """Per site: outer steps, final loss, cross-site bytes per token, mean outer step seconds."""
    print(f"\n{'site':<6}{'outer steps':>12}{'final loss':>12}{'tokens':>10}{'WAN B/token':>13}{'outer s':>10}"
          f"{'inner s':>10}")
    for s in range(groups):
        recs = read_records(json_path, s)
        r0 = [r for r in recs if r["rank"] == 0]
        if not r0:
            print(f"{s:<6}  (no records)")
            continue
        tokens = sum(r["tokens"] for r in r0)
        sent = sum(r["bytes_sent"] for r in recs)
        print(f"{s:<6}{len(r0):>12}{r0[-1]['loss']:>12.4f}{tokens:>10}{sent / max(tokens, 1):>13.3g}"
              f"{sum(r['seconds'] for r in r0) / len(r0):>10.2f}{sum(r['compute_s'] for r in r0) / len(r0):>10.2f}")


def remove_records(json_path: str, groups: int) -> None:
    """Removes the site record files of an earlier run at `json_path`."""
    for s in range(groups):
        for suffix in (JSON_SUFFIX, JSONL_SUFFIX):
            if os.path.exists(json_path + suffix.format(s)):
                os.unlink(json_path + suffix.format(s))


def ring_hashes(json_path: str, sites: list[int]) -> dict[tuple[int, int], dict[int, int]]:
    """(ring r, outer step k) -> {site: rank r's state hash after step k}: a job that agrees has
    one hash per key."""
    out: dict[tuple[int, int], dict[int, int]] = {}
    for s in sites:
        for r in read_records(json_path, s):
            out.setdefault((r["rank"], r["outer_step"]), {})[s] = r["state_hash"]
    return out


def final_hashes(json_path: str, sites: list[int]) -> dict[int, list[int]]:
    """Ring r -> the state hash of rank r on each of `sites` at their last common outer step."""
    per = ring_hashes(json_path, sites)
    common = [k for (r, k), h in per.items() if r == 0 and set(h) == set(sites)]
    last = max(common, default=-1)
    return {r: [h[s] for s in sites] for (r, k), h in sorted(per.items()) if k == last}
