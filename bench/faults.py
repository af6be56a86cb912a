"""Network faults under the fault-tolerant communicator, on emulated hosts (jaxodc.launch.cluster).

    python -m jaxodc bench faults --json bench/out/faults.json [--scenarios stop,flap,...]

Scenarios sites-partition, sites-master and sites-loss run real DiLoCo sites (`jaxodc train
--groups 3`, one per host): bench/faults_sites.py; odc-link and odc-loss run ODC across 2 hosts:
bench/faults_odc.py. The others run the communicator's own loop, below.

Host 0 runs `jaxodc master`; hosts 1..N run one peer each (a site's communicator). Every peer runs
the PCCL loop: admit pending peers, sync the shared state, all-reduce (sum) this step's input with
retry, add the result to the shared state. Inputs are integer-valued float32 (any summation order
gives the same bits) and carry a one-hot slot per contributor, so the driver checks each completed
all-reduce against numpy for exactly the peers that took part, and replays the shared state.

Scenarios (the faulted peer is the last one):
  stop       its process is SIGSTOPped (sockets open, nothing read) for `down` s, then SIGCONTed
  flap       its link goes down 1 s every 5 s for `down` s
  partition  its link goes down for `down` s (mid all-reduce)
  master     it cannot reach the master (a silent partition) for `down` s, its peers still can
  loss       every host drops 1% of its incoming packets at random for `down` s (run at 100 Mbit/s):
             nobody is dropped, results equal a loss-free run's; throughput during vs before

A peer that lost the master registers again and is voted back in; the workers stop together once
the driver has seen every peer back in the group (a stop vote carried inside the all-reduce, so
every peer ends after the same step). Records: {"scenario", "detected_s", "recovered",
"params_equal", "lost_steps", "rc", "leftovers", ...}.

``python bench/faults.py worker MASTER SECRET_FILE K NPEERS OUTFILE SIZE HB_TIMEOUT STOPFILE`` is one peer.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # through jaxodc/bench too
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SLOTS = 8            # one-hot contributor slots (peer k adds 1 at slot k)
STOP = SLOTS         # the stop vote
HEAD = SLOTS + 1     # the payload starts here
PORT = 48148
SCENARIOS = ("stop", "flap", "partition", "master", "loss")


def inputs(step: int, k: int, size: int, stop: bool = False) -> np.ndarray:
    """Peer k's input at `step`: integers in [-1000, 1000] as float32 (exact sums)."""
    x = np.empty(HEAD + size, np.float32)
    x[:HEAD] = 0
    x[k] = 1
    x[STOP] = float(stop)
    x[HEAD:] = np.random.default_rng((step, k)).integers(-1000, 1001, size, dtype=np.int16)
    return x


def result_digest(y: np.ndarray) -> int:
    """What is checked of a result: everything but the stop vote (which peers saw the file varies)."""
    return zlib.crc32(y[:STOP].tobytes()) ^ zlib.crc32(y[HEAD:].tobytes())


def state_digest(state: dict) -> int:
    from jaxodc.comm import shared_state as ss
    return ss.combined_hash(ss.state_hashes(state))


def fresh_state(size: int) -> dict:
    return {"w": np.zeros(size, np.float32), "step": np.zeros(1, np.int64)}


# --- one peer -----------------------------------------------------------------------------------

def worker(master: str, secret_file: str, k: str, npeers: str, outfile: str, size: str, hb_timeout: str,
           stopfile: str) -> int:
    from jaxodc.comm.communicator import RETRYABLE, Communicator, MasterUnavailable
    k, npeers, size, hb = int(k), int(npeers), int(size), float(hb_timeout)
    out = open(outfile, "a", buffering=1)

    def emit(ev, **kw):
        out.write(json.dumps({"ev": ev, "t": time.time(), **kw}) + "\n")

    # the peer gives the master up after hb s of silence, as the master gives up the peer; a ring
    # transfer stalled for hb s fails too
    from jaxodc.auth import read_secret_file
    comm = Communicator(master, secret=read_secret_file(secret_file), heartbeat_s=hb / 10, timeout_s=60.0,
                        ring_timeout_s=hb, master_timeout_s=hb)
    state, rev, newcomer = fresh_state(size), 0, False
    comm.connect()
    comm.update_topology(timeout_s=120.0)
    deadline = time.monotonic() + 120.0
    while comm.world_size < npeers:  # the founders admit each other; all start at step 0 together
        if comm.are_peers_pending():
            comm.update_topology()
        elif time.monotonic() > deadline:
            raise TimeoutError(f"only {comm.world_size} of {npeers} peers in the group after 120 s")
        else:
            time.sleep(0.05)
    emit("joined", world=comm.world_size)
    while True:
        try:
            if not comm.accepted:  # back after losing the master: voted in again, then fetch
                comm.update_topology(timeout_s=300.0, found=False)
                newcomer = True
                emit("rejoined", world=comm.world_size)
            elif comm.are_peers_pending():
                comm.update_topology()
            info = comm.run_with_retry(comm.sync_shared_state, state, rev,
                                       strategy="receive_only" if newcomer else "enforce_popular")
            rev, newcomer = info.revision, False
            step = int(state["step"][0])
            emit("sync", rev=rev, hash=info.hash, world=comm.world_size, step=step,
                 fetched=info.bytes_received)
            x = inputs(step, k, size, os.path.exists(stopfile))
            for attempt in range(1, 21):
                try:
                    y = comm.all_reduce(x, op="sum", tag=1)
                    break
                except RETRYABLE as e:  # aborted: re-form the ring without the lost peer, retry
                    emit("abort", step=step, attempt=attempt, reason=str(e)[:300])
                    if attempt == 20:
                        raise
                    comm.update_topology(accept_new=False)
            state["w"] += y[HEAD:]
            state["step"][0] += 1
            rev += 1
            emit("step", step=step, world=comm.world_size, attempts=attempt,
                 members=[i for i in range(SLOTS) if y[i]], result=result_digest(y), hash=state_digest(state))
            if y[STOP]:
                break
        except MasterUnavailable as e:
            emit("master_lost", reason=str(e)[:300])
            deadline = time.monotonic() + 300.0
            while True:  # register again once the master is reachable
                try:
                    comm.reconnect()
                    break
                except MasterUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            emit("reconnected")
    emit("done", step=int(state["step"][0]), hash=state_digest(state))
    comm.close()
    return 0


# --- the driver ---------------------------------------------------------------------------------

class FaultRun:
    """One scenario on a fresh cluster of `peers` + 1 emulated hosts (see the module doc)."""

    def __init__(self, scenario: str, peers: int = 3, hb_timeout: float = 3.0, down_s: float = 6.0,
                 size: int = 1 << 20, gbps: float | None = 0.2, workdir: str | None = None, log=print):
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; choose from {SCENARIOS}")
        self.scenario, self.n, self.hb, self.down_s = scenario, peers, hb_timeout, down_s
        self.size, self.gbps, self.log = size, gbps, log
        self.dir = workdir or tempfile.mkdtemp(prefix=f"jaxodc-faults-{scenario}-")
        self.stopfile = os.path.join(self.dir, "stop")
        self.faulty = peers  # host index of the faulted peer (peers on hosts 1..N)
        self.events: dict[int, list[dict]] = {i: [] for i in range(1, peers + 1)}
        self._offsets = {i: 0 for i in self.events}

    def _path(self, i: int) -> str:
        return os.path.join(self.dir, f"peer{i}.jsonl")

    def scan(self) -> None:
        for i in self.events:
            try:
                with open(self._path(i)) as f:
                    f.seek(self._offsets[i])
                    data = f.read()
            except FileNotFoundError:
                continue
            done = data[: data.rfind("\n") + 1]
            self._offsets[i] += len(done)
            self.events[i] += [json.loads(l) for l in done.splitlines()]

    def wait_until(self, cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.scan()
            if cond():
                return
            for i, p in self.procs.items():
                if p.poll() is not None and p.returncode != 0:
                    raise RuntimeError(f"peer on host {i} exited {p.returncode} waiting for {what}: "
                                       f"{open(self._err(i)).read()[-1500:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:g} s")
            time.sleep(0.05)

    def _err(self, i: int) -> str:
        return os.path.join(self.dir, f"peer{i}.err")

    def steps_with_all(self, after: float = 0.0) -> int:
        """Steps after time `after` that every peer completed in a group of all of them."""
        return min(sum(e["ev"] == "step" and e["world"] == self.n and e["t"] > after for e in ev)
                   for ev in self.events.values())

    def inject(self, c) -> float:
        """Runs the scenario's fault; returns the time it began."""
        f = self.faulty
        t0 = time.time()
        if self.scenario == "stop":
            os.kill(self.procs[f].pid, signal.SIGSTOP)
            time.sleep(self.down_s)
            os.kill(self.procs[f].pid, signal.SIGCONT)
        elif self.scenario == "partition":
            c.link(f, False)
            time.sleep(self.down_s)
            c.link(f, True)
        elif self.scenario == "master":
            c.partition({0}, {f})
            time.sleep(self.down_s)
            c.heal()
        elif self.scenario == "loss":
            for i in range(self.n + 1):
                c.loss(i, 0.01)
            time.sleep(self.down_s)
            for i in range(self.n + 1):
                c.loss(i, 0.0)
        elif self.scenario == "flap":
            end = t0 + self.down_s
            while time.time() < end:
                c.link(f, False)
                time.sleep(1.0)
                c.link(f, True)
                time.sleep(max(0.0, min(4.0, end - time.time())))
        return t0

    def run(self) -> dict:
        from jaxodc.launch.cluster import Cluster
        secret = os.path.join(self.dir, "secret")
        with open(secret, "wb") as f:
            f.write(os.urandom(32).hex().encode())
        env = {**os.environ, "PYTHONPATH": ROOT}
        self.procs: dict[int, subprocess.Popen] = {}
        rec = {"scenario": self.scenario, "peers": self.n, "heartbeat_timeout_s": self.hb, "down_s": self.down_s,
               "link_gbps": self.gbps}
        t_start = time.monotonic()
        c = Cluster(self.n + 1, gbps=self.gbps).start()
        master = None
        try:
            addr = f"{c.hosts[0].address}:{PORT}"
            merr = open(os.path.join(self.dir, "master.err"), "w")
            master = c.popen(0, [sys.executable, "-m", "jaxodc", "master", "--host", c.hosts[0].address,
                                 "--port", str(PORT), "--secret-file", secret, "--heartbeat-timeout", str(self.hb)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=merr, text=True)
            if "listening" not in master.stdout.readline():
                raise RuntimeError(f"jaxodc master did not start: {open(merr.name).read()[-1500:]}")
            for i in self.events:
                with open(self._err(i), "w") as err:
                    self.procs[i] = c.popen(i, [sys.executable, os.path.join(ROOT, "bench", "faults.py"), "worker",
                                                addr, secret, str(i - 1), str(self.n), self._path(i), str(self.size), str(self.hb),
                                                self.stopfile], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                            stderr=err)
            self.wait_until(lambda: self.steps_with_all() >= 3, 180, "3 steps of every peer together")
            before = self.throughput()
            # land the fault inside an all-reduce: just after a sync, the all-reduce follows
            mark = len(self.events[1])
            self.wait_until(lambda: any(e["ev"] == "sync" for e in self.events[1][mark:]), 60, "a sync")
            time.sleep(0.05)
            t_fault = self.inject(c)
            t_heal = time.time()
            self.wait_until(lambda: self.steps_with_all(t_heal) >= 3, 300,
                            f"every peer back in the group after the heal ({self.scenario})")
            open(self.stopfile, "w").close()
            deadline = time.monotonic() + 120
            rec["rc"] = finish(self.procs, master, deadline)
            self.scan()
            rec["leftovers"], rec["closing_sockets"] = leftovers_on_hosts(c)
            rec.update(self.analyse(t_fault, t_heal))
            rec["steps_per_s_before"], rec["steps_per_s_after"] = before, self.throughput(t_heal)
            rec["steps_per_s_during"] = self.throughput(t_fault, t_heal)
            t = [e["t"] for e in self.events[1] if e["ev"] == "step"]
            rec["longest_gap_s"] = round(max(np.diff(t)), 2) if len(t) > 1 else None
        finally:
            tear_down(c, [*self.procs.values(), master], rec, t_start)
        return rec

    def throughput(self, after: float = 0.0, before: float = float("inf")) -> float | None:
        """Steps per second of peer 1 between two times."""
        t = sorted(e["t"] for e in self.events[1] if e["ev"] == "step" and after < e["t"] < before)
        return round((len(t) - 1) / (t[-1] - t[0]), 3) if len(t) > 1 else None

    def analyse(self, t_fault: float, t_heal: float) -> dict:
        """Checks every completed all-reduce and the shared state against numpy (module doc)."""
        failures = []
        steps: dict[int, list[tuple[int, dict]]] = {}
        for i, ev in self.events.items():
            seen = set()
            for e in ev:
                if e["ev"] == "step":
                    if e["step"] in seen:
                        failures.append(f"peer {i} applied step {e['step']} twice")
                    seen.add(e["step"])
                    steps.setdefault(e["step"], []).append((i, e))
        last = max(steps) if steps else -1
        lost = [s for s in range(last + 1) if s not in steps]
        state = fresh_state(self.size)
        for s in range(last + 1):
            recs = steps.get(s, [])
            if not recs:
                continue
            members = recs[0][1]["members"]
            want = sum(inputs(s, k, self.size) for k in members)
            for i, e in recs:
                if e["members"] != members:
                    failures.append(f"step {s}: peer {i} summed {e['members']}, peer {recs[0][0]} {members}")
                elif e["result"] != result_digest(want):
                    failures.append(f"step {s}: peer {i}'s all-reduce differs from numpy's sum over {members}")
            state["w"] += want[HEAD:]
            state["step"][0] += 1
            digest = state_digest(state)
            bad = [i for i, e in recs if e["hash"] != digest]
            if bad:
                failures.append(f"step {s}: shared state of peers {bad} differs from the numpy replay")
        syncs: dict[int, set] = {}
        for ev in self.events.values():
            for e in ev:
                if e["ev"] == "sync":
                    syncs.setdefault(e["rev"], set()).add(e["hash"])
        failures += [f"revision {r}: {len(h)} different synced states" for r, h in syncs.items() if len(h) > 1]
        done = {i: [e for e in ev if e["ev"] == "done"] for i, ev in self.events.items()}
        finals = {d[-1]["hash"] for d in done.values() if d}
        survivors = [i for i in self.events if i != self.faulty]
        t_detect = [e["t"] for i in survivors for e in self.events[i]
                    if e["ev"] in ("abort", "master_lost") and e["t"] >= t_fault]
        faulty = self.events[self.faulty]
        return {
            "detected_s": round(min(t_detect) - t_fault, 2) if t_detect else None,
            "recovered": all(done.values()) and len({d[-1]["step"] for d in done.values()}) == 1
                         and self.steps_with_all(t_heal) >= 3,
            "params_equal": len(finals) == 1 and all(done.values()) and not failures,
            "lost_steps": len(lost),
            "steps": last + 1,
            "aborts": sum(e["ev"] == "abort" for ev in self.events.values() for e in ev),
            "max_attempts": max((e["attempts"] for ev in self.events.values() for e in ev if e["ev"] == "step"),
                                default=0),
            "faulty_rejoined": any(e["ev"] == "rejoined" for e in faulty),
            "faulty_fetched_bytes": sum(e.get("fetched", 0) for e in faulty if e["ev"] == "sync"),
            "min_world": min((e["world"] for ev in self.events.values() for e in ev if e["ev"] == "step"), default=0),
            "failures": failures[:20],
        }


# TCP states of a socket its process already closed: the kernel alone finishes (or times out) the
# FIN exchange, which a link that was down for long backs off for tens of seconds.
CLOSING_STATES = ("TIME-WAIT", "FIN-WAIT-1", "FIN-WAIT-2", "CLOSING", "LAST-ACK")


def finish(procs: dict, master, deadline: float) -> int:
    """Waits for the peers until `deadline` (killing the late ones), then stops the master
    (SIGTERM, killed after 30 s); the worst exit status of them all."""
    for p in procs.values():
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    master.send_signal(signal.SIGTERM)
    try:
        master.wait(timeout=30)
    except subprocess.TimeoutExpired:
        master.kill()
        master.wait()
    return max([p.returncode for p in procs.values()] + [master.returncode])


def tear_down(c, procs, rec: dict, t_start: float) -> dict:
    """Kills what still runs of `procs`, removes the cluster, and completes `rec` with what the
    cluster left behind and the run's seconds."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
    c.close()
    rec["leftovers"] = rec.get("leftovers", []) + leftovers_of_cluster(c.name)
    rec["seconds"] = round(time.monotonic() - t_start, 1)
    return rec


def leftovers_on_hosts(c, settle_s: float = 30.0) -> tuple[list[str], list[str]]:
    """(leftovers, orphans) on the cluster's hosts once every process of the run has ended.
    Leftovers: processes (besides each host's namespace holder), TCP sockets not closing, /dev/shm
    entries. Orphans: sockets still closing after `settle_s` (owned by no process; they go with
    the namespace): reported apart, not leftovers."""
    deadline = time.monotonic() + settle_s
    while True:
        out, orphans = [], []
        for h in c.hosts:
            r = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True, timeout=30)
            out += [f"host{h.index}: process {p}" for p in r.stdout.split() if int(p) != h.holder]
            r = c.run(h.index, ["ss", "-Htan"], capture_output=True, text=True, timeout=30)
            for line in r.stdout.splitlines():
                if line.strip() and not line.startswith("TIME-WAIT"):
                    (orphans if line.split()[0] in CLOSING_STATES else out).append(
                        f"host{h.index}: socket {' '.join(line.split())}")
            r = c.run(h.index, ["ls", "-A", "/dev/shm"], capture_output=True, text=True, timeout=30)
            out += [f"host{h.index}: /dev/shm/{n}" for n in r.stdout.split()]
        if not orphans or time.monotonic() > deadline:
            return out, orphans
        time.sleep(1.0)


def leftovers_of_cluster(name: str) -> list[str]:
    """Namespaces, links or state of cluster `name` still on the machine after it was closed."""
    from jaxodc.launch import cluster
    return [f"cluster {name} remains"] if name in cluster._names_in_use() else []


# --- `jaxodc bench faults` ----------------------------------------------------------------------

def bars(rec: dict) -> list[str]:
    """The issue's bars a record misses (empty: all met)."""
    miss = []
    if not rec.get("recovered"):
        miss.append("recovered")
    if not rec.get("params_equal"):
        miss.append("params_equal")
    if rec.get("detected_s") is not None and rec["detected_s"] > rec["heartbeat_timeout_s"] + 2:
        miss.append("detected_s")
    if rec.get("leftovers"):
        miss.append("leftovers")
    if rec.get("lost_steps"):
        miss.append("lost_steps")
    if rec.get("rc"):
        miss.append("rc")
    return miss


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker(*argv[1:9])
    from bench.common import print_table, write_records
    ap = argparse.ArgumentParser(prog="jaxodc bench faults", description=__doc__.split("\n\n")[0])
    from bench import faults_odc, faults_sites
    ap.add_argument("--scenarios", default=",".join(SCENARIOS + faults_sites.SCENARIOS + faults_odc.SCENARIOS))
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0, help="the master's and the peers' (s)")
    ap.add_argument("--partition-s", type=float, default=30.0, help="partition / master: fault length (s)")
    ap.add_argument("--flap-s", type=float, default=60.0, help="flap: how long the link flaps (s)")
    ap.add_argument("--stop-s", type=float, default=15.0, help="stop: how long the peer stays stopped (s)")
    ap.add_argument("--loss-s", type=float, default=30.0, help="loss: how long 1%% of packets are lost (s)")
    ap.add_argument("--loss-gbps", type=float, default=0.1, help="loss: link rate (the issue's 100 Mbit/s WAN)")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--size", type=int, default=1 << 20, help="float32 elements per all-reduce")
    ap.add_argument("--gbps", type=float, default=0.2, help="link rate of every host")
    ap.add_argument("--json", help="write the records here")
    a = ap.parse_args(argv)
    from jaxodc.launch.cluster import unavailable
    why = unavailable()
    if why:
        print(f"bench faults: {why}", file=sys.stderr)
        return 2
    down = {"stop": a.stop_s, "flap": a.flap_s, "partition": a.partition_s, "master": a.partition_s,
            "loss": a.loss_s}
    records = []
    for s in [x.strip() for x in a.scenarios.split(",") if x.strip()]:
        gbps = a.loss_gbps if s == "loss" else a.gbps
        try:
            if s in faults_odc.SCENARIOS:
                rec = faults_odc.OdcRun(s).run()
            elif s == "sites-loss":
                rec = faults_sites.loss_record(a.heartbeat_timeout, gbps=a.loss_gbps)
            elif s in faults_sites.SCENARIOS:
                rec = {k: v for k, v in faults_sites.SitesRun(s, hb_timeout=a.heartbeat_timeout,
                                                              down_s=a.partition_s).run().items() if k != "final_shards"}
            else:
                rec = FaultRun(s, a.peers, a.heartbeat_timeout, down[s], a.size, gbps or None).run()
        except Exception as e:  # a scenario that failed to run is a record too; the others still run
            rec = {"scenario": s, "heartbeat_timeout_s": a.heartbeat_timeout, "recovered": False,
                   "error": f"{type(e).__name__}: {e}"[:3000]}
        rec["bars_missed"] = bars(rec)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    print()
    print_table(records, ["scenario", "down_s", "detected_s", "recovered", "params_equal", "lost_steps", "rc",
                          "leftovers", "aborts", "max_attempts", "longest_gap_s", "steps_per_s_before", "steps_per_s_during",
                          "seconds_clean", "seconds_faulted"])
    write_records(a.json, records)
    return 1 if any(r["bars_missed"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
