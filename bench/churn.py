"""Churn stress for the fault-tolerant communicator.

Driver (embedded coordination service, peers as subprocesses)::

    python bench/churn.py --minutes 10 [--max-peers 6] [--json out.json]

Every 0.5-2 s it spawns a peer or SIGKILLs a random one (never the last peer holding the shared
state). Each peer runs the PCCL loop: admit pending peers, sync shared state (revision r), all-reduce
fake gradients (two concurrent all-reduces, distinct tags) with retry, advance the state
deterministically to revision r+1. Peers report the shared-state hash after each sync and after each
step. The run fails if 30 s pass without any completed step, if two peers ever report different
hashes for the same revision, or if a peer dies of anything but SIGKILL.

``python bench/churn.py worker MASTER SECRET NAME OUTFILE`` is one peer.

Group mode (``--groups``): the peers are whole sites of 2 ODC ranks training the small LM, joined by
DiLoCo across sites (`jaxodc train --groups ... --join`, jaxodc.optim.sites). Every 4-12 s a rank
of a random site is SIGKILLed (its launcher ends the site) or a new site is started, which joins
the running job. It fails when two sites report different shared-state hashes for one ring and
outer step, and reports the longest gap without an inner minibatch completed anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SIZE = 100_000  # elements per gradient (400 kB): long enough that kills land inside all-reduces


def worker(master: str, secret: str, name: str, outfile: str, link: str = "0") -> int:
    from jaxodc.comm import shared_state as ss
    from jaxodc.comm.communicator import Communicator

    out = open(outfile, "a", buffering=1)

    def emit(kind, rev, h, world):
        out.write(f"{kind} {rev} {h} {world} {time.time():.3f}\n")

    comm = Communicator(master, secret=secret.encode(), timeout_s=25.0, heartbeat_s=0.25, ring_timeout_s=5.0)
    comm.connect()
    comm.update_topology(timeout_s=120.0)
    # newcomers start from their own (wrong) state: the sync must replace it
    seed = zlib.crc32(name.encode())
    state = {"w": np.full(SIZE, float(seed % 97), np.float32), "m": np.zeros(SIZE, np.float32),
             "step": np.zeros(1, np.int64), "const": np.arange(1000, dtype=np.float64)}
    rev, first = 0, True
    rng = np.random.default_rng(seed)
    link_bps, capped = float(link), set()
    while True:
        if not first and comm.are_peers_pending():
            comm.update_topology()
        first = False
        if link_bps > 0:  # emulated link cap: all-reduces take long enough to be killed inside
            for peer in set(comm.ring) - capped - {comm.ep.address}:
                comm.ep.set_link(peer, link_bps, 0.0)
                capped.add(peer)
        info = comm.run_with_retry(comm.sync_shared_state, state, rev)
        rev = info.revision
        emit("SYNC", rev, info.hash, comm.world_size)
        g1 = rng.standard_normal(SIZE).astype(np.float32)
        g2 = rng.standard_normal(SIZE // 4).astype(np.float32)

        def reduce_both():
            h1 = comm.all_reduce_async(g1, op="avg", tag=1)
            h2 = comm.all_reduce_async(g2, op="sum", tag=2)
            errs, res = [], []
            for h in (h1, h2):  # wait for both before raising, so no tag stays in flight
                try:
                    res.append(h.wait())
                except Exception as e:  # noqa: BLE001 - re-raised below
                    errs.append(e)
            if errs:
                raise errs[0]
            return res

        a1, a2 = comm.run_with_retry(reduce_both)
        state["m"] = (np.float32(0.9) * state["m"] + a1).astype(np.float32)
        state["w"] = (state["w"] - np.float32(0.01) * state["m"]).astype(np.float32)
        state["w"][: a2.size] += np.float32(1e-3) * a2
        state["step"] += 1
        rev += 1
        emit("POST", rev, ss.combined_hash(ss.state_hashes(state)), comm.world_size)
        time.sleep(0.01)


class Churn:
    def __init__(self, seconds: float, max_peers: int = 6, seed: int = 0, stall_s: float = 30.0,
                 workdir: str | None = None, link_bps: float = 0.0, log=print):
        import tempfile
        from jaxodc.coord.service import CoordinatorService
        self.seconds, self.max_peers, self.stall_s, self.log = seconds, max_peers, stall_s, log
        self.link_bps = link_bps
        self.rng = random.Random(seed)
        self.secret = "churn-secret-%d" % seed
        self.svc = CoordinatorService("127.0.0.1", 0, self.secret.encode(), heartbeat_timeout_s=5.0).start()
        self.own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="jaxodc-churn-")
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()
        self.offsets: dict[str, int] = {}
        self.established: set[str] = set()
        self.hashes: dict[int, tuple[int, str]] = {}
        self.conflicts: list[str] = []
        self.spawns = self.kills = self.steps = 0
        self.max_rev = 0
        self.last_step = time.monotonic()
        self.longest_gap = 0.0
        self.unexpected: list[str] = []
        self.worlds: dict[int, int] = {}
        self.n = 0

    def spawn(self):
        self.n += 1
        name = f"peer{self.n}"
        path = os.path.join(self.dir, name + ".log")
        err = open(os.path.join(self.dir, name + ".err"), "w")
        self.procs[name] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", self.svc.address,
                                             self.secret, name, path, str(self.link_bps)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                            stderr=err)
        err.close()
        self.offsets[name] = 0
        self.spawns += 1

    def kill(self):
        alive = [n for n, p in self.procs.items() if p.poll() is None]
        # never kill the last established peer: the shared state would be lost with it
        cands = [n for n in alive if len(self.established & set(alive) - {n}) >= 1]
        if not cands:
            return False
        name = self.rng.choice(cands)
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()
        self.killed.add(name)
        self.kills += 1
        return True

    def scan(self):
        for name in list(self.procs):
            path = os.path.join(self.dir, name + ".log")
            if not os.path.exists(path):
                continue
            with open(path) as f:
                f.seek(self.offsets[name])
                data = f.read()
            complete = data[: data.rfind("\n") + 1]
            self.offsets[name] += len(complete)
            for line in complete.splitlines():
                kind, rev, h, world, _ = line.split()
                rev, h = int(rev), int(h)
                prev = self.hashes.get(rev)
                if prev is None:
                    self.hashes[rev] = (h, f"{name}:{kind}")
                elif prev[0] != h:
                    self.conflicts.append(f"revision {rev}: {prev[1]} has {prev[0]:#x}, {name}:{kind} has {h:#x}")
                if kind == "POST":
                    self.established.add(name)
                    self.steps += 1
                    self.worlds[int(world)] = self.worlds.get(int(world), 0) + 1
                    self.max_rev = max(self.max_rev, rev)
                    now = time.monotonic()
                    self.longest_gap = max(self.longest_gap, now - self.last_step)
                    self.last_step = now
        for name, p in self.procs.items():
            if p.poll() is not None and name not in self.killed and name not in self.unexpected:
                with open(os.path.join(self.dir, name + ".err")) as f:
                    tail = f.read()[-1500:]
                self.unexpected.append(name)
                self.conflicts.append(f"{name} exited with {p.returncode}: {tail}")

    def run(self) -> dict:
        t0 = time.monotonic()
        try:
            for _ in range(3):
                self.spawn()
            next_event = time.monotonic() + self.rng.uniform(0.5, 2.0)
            while time.monotonic() - t0 < self.seconds:
                time.sleep(0.1)
                self.scan()
                if self.conflicts:
                    break
                gap = time.monotonic() - self.last_step
                if gap > self.stall_s:
                    self.conflicts.append(f"no completed step for {gap:.1f} s")
                    break
                if time.monotonic() >= next_event:
                    alive = sum(p.poll() is None for p in self.procs.values())
                    # spawning slightly more often than killing keeps worlds of 3-6 peers
                    if alive < 2 or (alive < self.max_peers and self.rng.random() < 0.6):
                        self.spawn()
                    elif not self.kill() and alive < self.max_peers:
                        self.spawn()
                    next_event = time.monotonic() + self.rng.uniform(0.5, 2.0)
            # let the last changes settle, then require progress once more
            mark = self.steps
            end = time.monotonic() + self.stall_s
            while self.steps <= mark + 3 and time.monotonic() < end and not self.conflicts:
                time.sleep(0.1)
                self.scan()
            if self.steps <= mark and not self.conflicts:
                self.conflicts.append("no step completed after the last peer change")
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
            snap = self.svc.snapshot()
            self.svc.stop()
        if self.own_dir and not self.conflicts:
            import shutil
            shutil.rmtree(self.dir, ignore_errors=True)
        return {"seconds": round(time.monotonic() - t0, 1), "peer_changes": self.spawns + self.kills,
                "spawns": self.spawns, "kills": self.kills, "steps": self.steps, "max_revision": self.max_rev,
                "revisions_checked": len(self.hashes), "longest_gap_s": round(self.longest_gap, 2),
                "peer_steps_by_world": dict(sorted(self.worlds.items())),
                "failures": self.conflicts, "service": snap["counters"], "workdir": self.dir}


class GroupChurn:
    """Sites of `ranks` ODC ranks joining and dying at random while the job trains (see the module
    doc). Sites run `jaxodc train` with the job's options (`train_args`)."""

    def __init__(self, seconds: float, seed: int = 0, max_sites: int = 4, ranks: int = 2, inner_steps: int = 2,
                 wan_mbps: float = 20.0, workdir: str | None = None, log=print):
        import tempfile
        from jaxodc.cli import sites
        from jaxodc.cli.train import parser, worker_argv
        self.seconds, self.max_sites, self.log = seconds, max_sites, log
        self.rng = random.Random(seed)
        self.dir = workdir or tempfile.mkdtemp(prefix="jaxodc-group-churn-")
        self.out, self.stop = os.path.join(self.dir, "rec"), os.path.join(self.dir, "stop")
        self.args = parser().parse_args([
            "--groups", "2", "--ranks", str(ranks), "--diloco", str(inner_steps), "--steps", "100000000", "--samples", "1024",
            "--minibatch", "2", "--max-tokens", "96", "--d-model", "32", "--layers", "1", "--heads", "2",
            "--wan-mbps", str(wan_mbps), "--wan-ms", "5", "--trace-sites", "--stop-file", self.stop,
            "--json", self.out, "--timeout", str(int(seconds + 600))])
        # a newcomer compiles from the job's cache: the others would wait for its first minibatch
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(self.dir, "jax-cache"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        self.sites = sites
        self.job = sites.LocalJob(self.args, worker_argv(self.args), echo=None)
        self.next_site, self.joins, self.kills = 0, 0, 0
        self.killed: set[int] = set()

    def alive(self) -> list[int]:
        return [s for s, p in self.job.sites.items() if p.poll() is None]

    def training(self) -> list[int]:
        """Sites that have completed an outer step (hold the shared state)."""
        seen = {int(m.group(1)) for _, line in self.job.lines for m in [self.sites.OUTER_LINE.search(line)] if m}
        return [s for s in self.alive() if s in seen]

    def start(self, join: bool) -> None:
        self.job.start(self.next_site, join=join)
        self.log(f"[group churn] started site {self.next_site}" + (" (joins)" if join else ""))
        self.next_site += 1
        self.joins += join

    def kill(self) -> bool:
        live = self.training()
        if len(live) < 2:  # never the last site holding the shared state
            return False
        site = self.rng.choice(live)
        try:
            self.job.kill_rank(site, index=self.rng.randrange(self.args.ranks))
        except RuntimeError:
            return False
        self.killed.add(site)
        self.kills += 1
        self.log(f"[group churn] killed a rank of site {site}")
        return True

    def gaps(self) -> float:
        """Longest time without an inner minibatch completed on any site (from the ranks' clocks)."""
        import re
        rx = re.compile(r"minibatch \d+ done at ([0-9.]+)")
        times = sorted(float(m.group(1)) for _, line in self.job.lines for m in [rx.search(line)] if m)
        return max((b - a for a, b in zip(times, times[1:])), default=float("inf"))

    def run(self) -> dict:
        t0 = time.monotonic()
        failures = []
        try:
            self.start(False)
            self.start(False)
            self.job.wait_outer(1, timeout_s=300)
            t_train = time.monotonic()
            next_event = time.monotonic() + self.rng.uniform(4, 12)
            while time.monotonic() - t0 < self.seconds:
                time.sleep(0.2)
                if time.monotonic() < next_event:
                    continue
                n = len(self.alive())
                if n < 2 or (n < self.max_sites and self.rng.random() < 0.5) or not self.kill():
                    if n < self.max_sites:
                        self.start(True)
                next_event = time.monotonic() + self.rng.uniform(4, 12)
            open(self.stop, "w").close()
            status = self.job.wait(timeout_s=300)
        finally:
            self.job.close()
        with open(os.path.join(self.dir, "sites.log"), "w") as f:  # every site's lines, for a post-mortem
            f.writelines(f"{t:.3f} {line}\n" for t, line in self.job.lines)
        unexpected = {s: rc for s, rc in status.items() if rc and s not in self.killed}
        if unexpected:
            failures.append(f"sites ended with errors: {unexpected}")
        per = self.sites.ring_hashes(self.out, sorted(self.job.sites))
        diverged = {f"ring {r} step {k}": h for (r, k), h in per.items() if len(set(h.values())) > 1}
        if diverged:
            failures.append(f"shared state diverged: {diverged}")
        first = min((t for t, line in self.job.lines if "minibatch" in line), default=None)
        return {"seconds": round(time.monotonic() - t0, 1), "group_changes": self.joins + self.kills,
                "joins": self.joins, "kills": self.kills, "outer_steps": self.job.outer_done,
                "ring_steps_checked": len(per), "longest_gap_s": round(self.gaps(), 2),
                "training_s": None if first is None else round(time.monotonic() - t_train, 1),
                "failures": failures, "workdir": self.dir}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker(*argv[1:6])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=float(os.environ.get("JAXODC_CHURN_MINUTES", 1.5)))
    ap.add_argument("--max-peers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--link-mbps", type=float, default=20.0,
                    help="emulated outgoing link cap per peer in MB/s (0: loopback speed)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--groups", action="store_true", help="churn whole sites of 2 ODC ranks (DiLoCo across sites)")
    args = ap.parse_args(argv)
    if args.groups:
        res = GroupChurn(args.minutes * 60, args.seed).run()
        print(json.dumps(res, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        bars = [("group changes", res["group_changes"], ">= 50", res["group_changes"] >= 50),
                ("longest gap without an inner minibatch (s)", res["longest_gap_s"], "<= 5", res["longest_gap_s"] <= 5)]
        for name, v, bar, met in bars:
            print(f"{name}: {v} (bar {bar}: {'met' if met else 'NOT met'})")
        diverged = any(f.startswith("shared state diverged") for f in res["failures"])
        print(f"shared state: {'DIVERGED' if diverged else 'bit-identical on every site, ring and outer step'}")
        for f in res["failures"]:
            print(f"failure: {f[:2000]}")
        return 1 if res["failures"] else 0
    res = Churn(args.minutes * 60, args.max_peers, args.seed, link_bps=args.link_mbps * 1e6).run()
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
