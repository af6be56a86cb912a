"""`jaxodc bench fuzz`: a protocol fuzzer for every listener of a jaxodc job (its cases:
bench/fuzz_cases.py).

Every listener but the coordination service (`jaxodc.auth.LISTENERS`) starts with the same
jaxodc-auth-v2 handshake, so their unauthenticated cases are generic (`fuzz_cases.KINDS`): random
bytes, truncated and oversized handshake replies, claimed ranks and lengths at the edges of their
integer types, valid-looking transcripts replayed with a stale nonce, a wrong or missing secret,
another listener's or job's tags, and idle connections held open. A case is *rejected* when the
listener ends the connection (or lets it time out) without proving the secret; a listener that
ever sends a valid proof to one of these peers has let an unauthenticated peer in.

The coordination service (`coord`) speaks its own dialect (jaxodc-coord-v2, `jaxodc.coord.protocol`:
length-prefixed msgpack frames, HMAC over both nonces and the client's claims); its cases
(`fuzz_cases.COORD_KINDS`) are random bytes, truncated frames, length prefixes at and beyond the
auth frame's limit, auth frames with a wrong secret, without a mac or nonce, over a stale nonce,
replayed byte for byte, with the wrong type or claims, bodies that are not maps, and idle
connections. A case is rejected when the service ends the connection without a welcome.

Two kinds of job are disturbed, each compared with an undisturbed run of the same job; both run
by default (``--jobs native,train``: every listener), ``--jobs native`` alone is the quick run:

- ``--jobs native`` (no jax): a 2-rank job in this process over the native listeners --
  an ODC runtime pair over tcp (`odc_tcp`: minibatches of scatter_accumulate / wait_complete /
  fetch_grad), a lock-step group pair with tcp links (`lockstep_tcp`: all-reduces) and a ring
  endpoint pair (`ring`: all-reduces). The ODC owners sum exactly (accumulate="exact", the opt-in
  of reproducible runs) and two-rank all-reduces add two terms, so whatever the arrival order the
  disturbed results must equal the undisturbed ones bit for bit (`same_params`).
- ``--jobs train``: 2-rank ``jaxodc train`` runs (ODC over tcp: `odc_tcp`, `rendezvous`; two sites
  of DiLoCo: `coord`, `ring`, `shared_state`); their listening ports are found from the ranks'
  sockets (/proc) and told apart by a handshake with the job secret. They run with
  ``--reproducible``, and `same_params` compares the runs' ``params_sha256`` (the sites': the
  sha256 of their final shards).

One record per listener: {"listener", "cases", "rejected", "crashes", "same_params"}; `crashes`
counts ranks that exit non-zero or by a signal or log a sanitizer report, and listeners that stop
answering while their rank still runs: the native job's are probed before its ranks may close;
a train job's throughout the job (`Watch`), where one that falls silent counts only if its
process outlives the silence by more than `SHUTDOWN_S` (a rank closes its listeners in its normal
shutdown, just before it exits 0). Bars: >= 10 000 cases in all, 0 crashes, every case rejected.

    python -m jaxodc bench fuzz --json fuzz.json                 # every listener: ~18 000 cases (~4 min)
    python -m jaxodc bench fuzz --jobs native --json fuzz.json   # the native listeners only (no jax)
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import itertools
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from jaxodc import auth
from jaxodc.bench.fuzz_cases import SECRET, Target, _coord_auth, _coord_challenge, _recv_exact, fuzz
from jaxodc.coord import protocol as P

# -- the native job (in this process) -----------------------------------------------------------------

class _Allgather:
    """allgather across the threads of an in-process job (one call per rank, in step)."""

    def __init__(self, world: int):
        self.world, self.cv, self.rounds = world, threading.Condition(), {}

    def __call__(self, key, rank: int, value: bytes) -> list[bytes]:
        with self.cv:
            got = self.rounds.setdefault(key, {})
            got[rank] = value
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: len(got) == self.world, timeout=120):
                raise TimeoutError(f"in-process allgather {key!r}: {len(got)} of {self.world} ranks")
            return [got[r] for r in range(self.world)]


class _Rendezvous:
    """What jaxodc.odc.Runtime needs of a rendezvous, for the ranks of one process."""

    def __init__(self, ag: _Allgather, rank: int):
        self.ag, self.rank = ag, rank

    def allgather(self, key, value, world, timeout_s=None):
        return self.ag(key, self.rank, value)

    def barrier(self, key, world, timeout_s=None):
        self.ag(key, self.rank, b"")


def native_job(job_id: str, secret: bytes, steps: int, started=None) -> dict:
    """A 2-rank job over the native listeners in this process: returns each part's results
    (arrays), bit-exact functions of `steps` alone. `started(targets)` runs once they listen and
    returns an event the ranks wait for before they close (None: close at once)."""
    from jaxodc.comm.lockstep import Channel, LockstepGroup
    from jaxodc.comm.ring import RingEndpoint
    from jaxodc.odc.runtime import Runtime

    world, sizes = 2, [33, 1000, 4096]
    ag = _Allgather(world)
    out: dict = {"odc_tcp": [None] * world, "lockstep_tcp": [None] * world, "ring": [None] * world}
    targets: list[Target] = []
    errors: list[str] = []
    ready = threading.Barrier(world + 1)
    go = threading.Event()
    release = threading.Event()
    calls = [itertools.count() for _ in range(world)]

    def grad(rank, u, step):
        return np.random.default_rng([rank, u, step]).standard_normal(sizes[u]).astype(np.float32)

    def rank_main(rank):
        rt = group = ep = None
        try:
            # the exact sum (opt-in): `same_params` compares bits, which must not depend on arrival order
            rt = Runtime(sizes, rank=rank, world=world, rendezvous=_Rendezvous(ag, rank), job_id=job_id,
                         transport="tcp", timeout_s=60, device=None, secret=secret, accumulate="exact")
            group = LockstepGroup([Channel("reduce", 777, "r")], rank=rank, world=world, link="tcp", timeout_s=60,
                                  allgather=lambda b: ag(("lockstep", next(calls[rank])), rank, b), job_id=job_id,
                                  secret=secret)
            ep = RingEndpoint(secret=secret, group_id=job_id, timeout_s=60)
            addrs = [a.decode() for a in ag("ring", rank, ep.address.encode())]
            ep.connect_ring(addrs, rank, 1)
            targets.extend([Target("odc_tcp", "127.0.0.1", rt._native.port, job_id, world, secret),
                            Target("lockstep_tcp", "127.0.0.1", group._native.port, job_id, world, secret),
                            Target("ring", "127.0.0.1", int(ep.address.rsplit(":", 1)[1]), job_id, 1 << 20,
                                   secret)])
            ready.wait(120)
            go.wait(120)
            odc, ls, rg = [], [], []
            for step in range(steps):
                for u in range(len(sizes)):
                    rt.scatter_accumulate(u, step, grad(rank, u, step))
                rt.done(step)
                rt.wait_complete(step)
                odc += [rt.fetch_grad(u).copy() for u in range(len(sizes))]
                ls.append(group.run(0, grad(rank, 1, step)[:777]))
                rg.append(ep.all_reduce(grad(rank, 2, step)))
                time.sleep(0.05)  # the job lasts while the fuzzer works on it
            out["odc_tcp"][rank], out["lockstep_tcp"][rank], out["ring"][rank] = odc, ls, rg
            release.wait(600)  # the listeners stay up until the fuzzer has checked them
        except Exception as e:  # noqa: BLE001 - reported as the job's failure
            errors.append(f"rank {rank}: {type(e).__name__}: {e}")
            try:
                ready.abort()
            except threading.BrokenBarrierError:
                pass
        finally:
            for closer in (lambda: group and group.close(), lambda: ep and ep.close(),
                           lambda: rt and rt.close(barrier=False)):
                try:
                    closer()
                except Exception as e:  # noqa: BLE001
                    errors.append(f"rank {rank}: close: {e}")

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for th in threads:
        th.start()
    try:
        ready.wait(120)
        hold = started(targets) if started is not None else None
    except threading.BrokenBarrierError:
        hold = None
    go.set()
    if hold is None:
        release.set()
    else:
        threading.Thread(target=lambda: (hold.wait(900), release.set()), daemon=True).start()
    for th in threads:
        th.join(600)
    return {"results": out, "errors": errors, "targets": targets}


def _same(a, b) -> bool:
    if a is None or b is None:
        return False
    return all(len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y)) for x, y in zip(a, b))


def run_native(cases_per_listener: int, steps: int, seed: int, threads: int) -> list[dict]:
    calm = native_job(f"fz{os.getpid()}a", SECRET, steps)
    holder: dict = {}

    def attack(targets):
        # The fuzzer runs beside the job, from the moment its listeners are up; the job closes once
        # the fuzzer has checked that every listener still answers.
        done = threading.Event()

        def work():
            try:
                fuzz(targets, cases_per_listener // 2, seed, threads)  # two ranks: two listeners of each kind
            finally:
                holder["dead"] = [t for t in targets if not t.alive()]
                done.set()

        holder["thread"] = threading.Thread(target=work)
        holder["thread"].start()
        holder["targets"] = targets
        return done

    stormy = native_job(f"fz{os.getpid()}b", SECRET, steps, started=attack)
    if "thread" not in holder:
        raise RuntimeError(f"the native job did not start: {stormy['errors']}")
    holder["thread"].join()
    records = []
    for name in ("odc_tcp", "lockstep_tcp", "ring"):
        ts = [t for t in holder["targets"] if t.listener == name]
        crashes = sum(t in holder["dead"] for t in ts) + len(stormy["errors"])
        records.append({"listener": name, "job": "native", "cases": sum(t.cases for t in ts),
                        "rejected": sum(t.rejected for t in ts), "admitted": sum((t.admitted for t in ts), []),
                        "crashes": crashes, "errors": stormy["errors"] + calm["errors"],
                        "same_params": _same(calm["results"][name], stormy["results"][name])})
    return records


# -- jaxodc train jobs (every listener, the Python ones included) --------------------------------------

def _listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on (its sockets' inodes matched in /proc/net/tcp)."""
    inodes = set()
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _children(pid: int) -> list[int]:
    out = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            out += [int(c) for c in open(task).read().split()]
        except OSError:
            pass
    return out + [g for c in out for g in _children(c)]


def _dialect(port: int) -> str | None:
    """What a listener says first: "v2" (a jaxodc-auth-v2 challenge), "coord" (a jaxodc-coord-v2
    challenge frame) or None (nothing we know)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            head = _recv_exact(s, 4)
            if head == auth.MAGIC:
                return "v2"
            (n,) = P.HEADER.unpack(head) if len(head) == 4 else (0,)
            if 0 < n <= P.AUTH_FRAME_MAX:
                chal = P.decode(_recv_exact(s, n))
                if chal.get("t") == P.Msg.CHALLENGE and chal.get("v") == P.PROTOCOL_VERSION:
                    return "coord"
    except (OSError, P.ProtocolError, struct.error):
        pass
    return None


def _coord_secret(port: int, secrets: list[bytes]) -> bytes | None:
    """Which of `secrets` the coordination service on `port` holds, found without joining it: an auth
    frame with a right mac but no claims is dropped in silence, one with a wrong mac is refused
    with an error frame."""
    for secret in secrets:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.settimeout(5)
                chal = _coord_challenge(s)
                if chal is None:
                    return None
                s.sendall(P.pack(_coord_auth(secret, chal["nonce"], {})))
                try:
                    answer = P.recv_frame(s)
                except (P.ProtocolError, ConnectionError):
                    return secret
                if answer.get("t") == P.Msg.WELCOME:
                    raise RuntimeError(f"the coordination service on port {port} welcomed a peer without claims")
        except OSError:
            continue
    return None


def _identify(port: int, secrets: list[bytes], job_ids: list[str]) -> tuple[str, str, bytes, str] | None:
    """Which listener, job id, secret and dialect answer a handshake on `port`; None when none does (a
    listener that does not challenge its peers at all among them)."""
    dialect = _dialect(port)
    if dialect == "coord":
        secret = _coord_secret(port, secrets)
        return None if secret is None else ("coord", "", secret, "coord")
    if dialect != "v2":
        return None
    for secret in secrets:
        for job in job_ids:
            for name in auth.LISTENERS:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                        auth.client_handshake(s, secret, name, job, 0, timeout_s=5)
                        return name, job, secret, "v2"
                except (OSError, auth.AuthError):
                    continue
    return None


def _running(pid: int) -> bool:
    """Process `pid` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Watch:
    """Probes every listener of a running job each `period` s, from the moment they are found until
    the job ends: when each first stopped answering (two probes in a row) and when its process
    ended. A listener that stops answering while its process lives on is a crash; one that stops
    within `SHUTDOWN_S` of its process's end was closed by that process's shutdown."""

    def __init__(self, targets: list[Target], period: float = 1.0):
        self.targets, self.period = targets, period
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="fuzz-watch")
        self.thread.start()

    def _run(self) -> None:
        failed: dict[int, float] = {}  # id(target) -> when the current run of failed probes began
        while True:
            for t in self.targets:
                now = time.monotonic()
                if t.pid is not None and t.gone_at is None and not _running(t.pid):
                    t.gone_at = now
                if t.silent_at is not None:
                    continue
                if t.alive(timeout_s=10):
                    failed.pop(id(t), None)
                elif id(t) in failed:
                    t.silent_at = failed[id(t)]
                else:
                    failed[id(t)] = now
            if self.stop.wait(self.period):
                return

    def close(self, job_ended_at: float) -> None:
        """Stops probing; a process still found running now ended with the job."""
        self.stop.set()
        self.thread.join(60)
        for t in self.targets:
            if t.gone_at is None:
                t.gone_at = job_ended_at

    @staticmethod
    def crashed(t: Target) -> bool:
        """`t` stopped answering and its process lived on for more than SHUTDOWN_S."""
        return t.silent_at is not None and (t.gone_at is None or t.gone_at - t.silent_at > SHUTDOWN_S)


def _train(args: list[str], json_path: str, secret: bytes, timeout_s: float, discover=None):
    env = dict(os.environ, **{auth.SECRET_ENV: secret.hex()})
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "jaxodc", "train", "--json", json_path] + args, env=env,
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    extra = discover(proc) if discover is not None else None
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = -9
    log.seek(0)
    text = log.read()
    log.close()
    os.unlink(log.name)
    return rc, text, extra


def _final(json_path: str):
    """What two runs must share: every run's last params_sha256 when its records carry one (wt-repro's
    reproducible accumulation adds it), else every rank's loss at the last minibatch; for sites, the
    sha256 of every site's final parameter shards."""
    site_files = sorted(glob.glob(json_path + ".site*.json"))
    if site_files:
        h = hashlib.sha256()
        for path in site_files:
            with open(path) as f:
                h.update(json.dumps(json.load(f)["shards"], sort_keys=True).encode())
        return ("shards_sha256", h.hexdigest())
    try:
        with open(json_path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    hashes = {name: [r["params_sha256"] for r in recs if r.get("params_sha256")] for name, recs in raw.items()}
    if hashes and all(hashes.values()):
        return ("params_sha256", {name: h[-1] for name, h in hashes.items()})
    last: dict = {}
    for name, recs in raw.items():
        for r in recs:
            key = f"{name} rank {r['rank']}"
            if key not in last or r["step"] >= last[key][0]:
                last[key] = (r["step"], r["loss"])
    return ("final_loss", sorted(last.items()))


def _secrets_of(pids: list[int]) -> list[bytes]:
    """The secrets the job's processes were handed: $JAXODC_JOB_SECRET and any --secret-file."""
    found = []
    for pid in pids:
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        found += [bytes.fromhex(e.split(b"=", 1)[1].decode()) for e in env if e.startswith(auth.SECRET_ENV.encode() + b"=")]
        for flag, path in zip(argv, argv[1:]):
            if flag == b"--secret-file":
                try:
                    found.append(auth.read_secret_file(path.decode()))
                except auth.AuthError:
                    pass
    return list(dict.fromkeys(found))


# job -> (its jaxodc train arguments, the listeners it opens, its minibatches unless --steps says):
# enough for the default --cases to reach every listener before the job ends (about 200 cases/s).
# --reproducible: `same_params` compares the calm and stormy runs' params_sha256, bit for bit.
TRAIN_JOBS = {
    "odc_tcp": (["--ranks", "2", "--comm", "odc", "--transport", "tcp", "--reproducible"], {"odc_tcp", "rendezvous"},
                800),
    "sites": (["--groups", "2", "--ranks", "1", "--diloco", "2", "--reproducible"],
              {"coord", "ring", "shared_state", "rendezvous"}, 1600),
}
CRASH_MARKS = ("AddressSanitizer", "runtime error:", "Segmentation fault", "munmap_chunk", "double free",
               "core dumped", "Fatal Python error", "was killed by")
# Seconds from a listener's last answer to the end of its process that a normal shutdown may take
# (observed: under 1 s once the rendezvous stopped waiting for unauthenticated connections).
SHUTDOWN_S = 10.0


def _discover(proc, expected: set[str], timeout_s: float) -> tuple[list[Target], list[int]]:
    """The listeners of the running job `proc` (found in /proc, told apart by a handshake with the job
    secret), once every `expected` one is up or none has appeared for 15 s; and the ports that
    answer no handshake of the job."""
    found: dict[int, Target] = {}
    unknown: set[int] = set()
    deadline = time.monotonic() + min(timeout_s, 300)
    settled = None  # when the set of listeners last grew
    while time.monotonic() < deadline and proc.poll() is None:
        pids = _children(proc.pid)
        job_ids = []
        for pid in pids:
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            job_ids += [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"JAXODC_JOB_ID=")]
        job_ids = sorted(set(job_ids)) + ["group0", "group1", ""]
        secrets = _secrets_of(pids + [proc.pid]) + [SECRET]
        for pid in pids + [proc.pid]:
            for port in _listening_ports(pid) - set(found) - unknown:
                who = _identify(port, secrets, job_ids)
                if who:
                    found[port] = Target(who[0], "127.0.0.1", port, who[1], 2, who[2], dialect=who[3], pid=pid)
                else:
                    unknown.add(port)
                settled = time.monotonic()
        kinds = {t.listener for t in found.values()}
        if kinds >= expected or (kinds and time.monotonic() - settled > 15):  # every listener is up
            break
        time.sleep(0.5)
    return list(found.values()), sorted(unknown)


def run_train(cases_per_listener: int, steps: int | None, seed: int, threads: int, timeout_s: float,
              jobs=None) -> list[dict]:
    records = []
    for job in jobs or TRAIN_JOBS:
        job_args, expected, job_steps = TRAIN_JOBS[job]
        args = job_args + ["--steps", str(steps or job_steps), "--seed", str(seed)]
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.monotonic()
            calm_rc, calm_log, _ = _train(args, os.path.join(tmp, "calm.json"), SECRET, timeout_s)
            t1 = time.monotonic()

            def discover(proc):
                targets, unknown = _discover(proc, expected, timeout_s)
                watch = Watch(targets)  # from here until the job ends
                if proc.poll() is None and targets:
                    per = {k: max(1, cases_per_listener // sum(t.listener == k for t in targets))
                           for k in {t.listener for t in targets}}
                    fuzz(targets, per, seed, threads)
                return targets, unknown, watch

            rc, log, (targets, unknown, watch) = _train(args, os.path.join(tmp, "stormy.json"), SECRET, timeout_s,
                                                        discover)
            t2 = time.monotonic()
            watch.close(t2)
            calm, stormy = _final(os.path.join(tmp, "calm.json")), _final(os.path.join(tmp, "stormy.json"))
            marks = [m for m in CRASH_MARKS if m in log]
            for name in sorted({t.listener for t in targets or []}):
                ts = [t for t in targets if t.listener == name]
                silent = [{"port": t.port, "pid": t.pid, "silent_for_s": round(t.gone_at - t.silent_at, 2)}
                          for t in ts if t.silent_at is not None]
                records.append({"listener": name, "job": job, "cases": sum(t.cases for t in ts),
                                "rejected": sum(t.rejected for t in ts), "admitted": sum((t.admitted for t in ts), []),
                                "crashes": sum(map(Watch.crashed, ts)) + (rc != 0) + len(marks),
                                "same_params": calm is not None and calm == stormy and calm_rc == 0,
                                "compared": [calm, stormy], "exit": [calm_rc, rc], "marks": marks,
                                "silent_before_exit": silent, "seconds": [round(t1 - t0, 1), round(t2 - t1, 1)]})
            for port in unknown:  # listening, but without the job's handshake: fails the bar
                records.append({"listener": f"unauthenticated:{port}", "job": job, "cases": 0, "rejected": 0,
                                "crashes": 0, "same_params": False,
                                "error": "a listening socket of the job that answers no handshake of the job"})
            if not targets:
                records.append({"listener": None, "job": job, "cases": 0, "rejected": 0, "crashes": int(rc != 0),
                                "same_params": False, "error": "no listener found", "log_tail": log[-2000:]})
    return records


def _merge(records: list[dict]) -> list[dict]:
    """One record per listener (a listener fuzzed in several jobs sums its counts)."""
    out: dict = {}
    for r in records:
        m = out.setdefault(r["listener"], {"listener": r["listener"], "cases": 0, "rejected": 0, "crashes": 0,
                                           "same_params": True, "jobs": [], "admitted": []})
        m["cases"] += r["cases"]
        m["rejected"] += r["rejected"]
        m["crashes"] += r["crashes"]
        m["same_params"] = m["same_params"] and r["same_params"]
        m["admitted"] += r.get("admitted", [])
        m["jobs"].append({k: v for k, v in r.items() if k not in ("listener", "admitted")})
    return list(out.values())


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc bench fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="one record per listener")
    p.add_argument("--jobs", default="native,train",
                   help="native (the C++ listeners odc_tcp, lockstep_tcp, ring, in this process) and/or train "
                        "(jaxodc train runs: odc_tcp, rendezvous, coord, ring, shared_state), comma separated; "
                        "default both: every listener")
    p.add_argument("--cases", type=int, default=2000, help="fuzz cases per listener and job")
    p.add_argument("--steps", type=int, help="minibatches of each job (default: 60 for the native job, "
                                             "TRAIN_JOBS' own for the train jobs)")
    p.add_argument("--threads", type=int, default=8, help="concurrent fuzz connections")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds a train job may take")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = _args(sys.argv[1:] if argv is None else argv)
    records = []
    jobs = [j.strip() for j in a.jobs.split(",") if j.strip()]
    for j in jobs:
        if j not in ("native", "train"):
            print(f"jaxodc bench fuzz: unknown job kind {j!r} (native, train)", file=sys.stderr)
            return 2
    if "native" in jobs:
        records += run_native(a.cases, a.steps or 60, a.seed, a.threads)
    if "train" in jobs:
        records += run_train(a.cases, a.steps, a.seed, a.threads, a.timeout)
    merged = _merge(records)
    total = sum(r["cases"] for r in merged)
    for r in merged:
        print(f"{r['listener']!s:>13}: {r['cases']:6d} cases, {r['rejected']:6d} rejected, {r['crashes']} crashes, "
              f"same params: {r['same_params']}")
    ok = total >= 10000 and all(r["crashes"] == 0 and r["rejected"] == r["cases"] for r in merged)
    print(f"{total} cases in all; bars (>= 10000 cases, 0 crashes, every case rejected): {'met' if ok else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(merged, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
