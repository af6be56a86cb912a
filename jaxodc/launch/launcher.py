"""`jaxodc launch`: start the ranks of a job on this machine (torchrun-like).

    jaxodc launch -n N [--timeout S] [--grace S] [--[no-]tag-output] script.py args...
    jaxodc launch -n N ... -m package.module args...
    multi-host, one launcher per host:
    jaxodc launch -n N --nnodes M --node-rank R --coordinator HOST0:PORT [--job-id ID] script.py

Each rank is a subprocess in its own process group, with the environment described in
jaxodc.launch.context. Rank 0 hosts the rendezvous server at the coordinator address. When a rank exits
non-zero or dies from a signal, the launcher stops the others (SIGTERM, SIGKILL after the grace
period), reports the failing rank with its last output, and exits with that rank's status
(128 + signal number for a signal). --timeout stops everything and exits 124. SIGINT/SIGTERM to the
launcher are forwarded to every rank, which is then torn down the same way. On exit the job's
shared-memory segments (/dev/shm/jaxodc_<job>_*) are removed.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxodc.launch.context import cleanup_shm, free_port, new_job_id, sanitize_job_id

__all__ = ["main", "rank_env", "TAIL_LINES", "TIMEOUT_STATUS"]

TAIL_LINES = 50
TIMEOUT_STATUS = 124

# options that take a value (everything up to the script / -m module belongs to the launcher)
_VALUE_OPTS = {"-n", "--nproc", "--nproc-per-node", "--hosts", "--timeout", "--grace", "--nnodes",
               "--node-rank", "--coordinator", "--jax-coordinator", "--job-id"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxodc launch",
        usage="jaxodc launch -n N [options] (script.py | -m module) [args ...]",
        description="Start N ranks of a script on this machine (torchrun-like environment).")
    p.add_argument("-n", "--nproc", "--nproc-per-node", dest="nproc", type=int, required=True,
                   help="ranks to start on this machine")
    p.add_argument("--hosts", default=None,
                   help="comma-separated hosts; only names of this machine are accepted (run one "
                        "launcher per host with --nnodes/--node-rank/--coordinator instead)")
    p.add_argument("--nnodes", type=int, default=1, help="number of launchers (hosts) in the job")
    p.add_argument("--node-rank", type=int, default=0, help="index of this launcher's host")
    p.add_argument("--coordinator", default=None,
                   help="host:port of the rendezvous server (on node 0; required with --nnodes>1)")
    p.add_argument("--jax-coordinator", default=None,
                   help="host:port for jax.distributed (default: coordinator port + 1 with "
                        "--nnodes>1, a free local port otherwise)")
    p.add_argument("--job-id", default=None, help="job id shared by all hosts ([A-Za-z0-9_])")
    p.add_argument("--timeout", type=float, default=None, help="kill the job after S seconds")
    p.add_argument("--grace", type=float, default=3.0,
                   help="seconds between SIGTERM and SIGKILL on teardown (default 3)")
    p.add_argument("--tag-output", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix each output line with [rank k] (default on)")
    return p


def _split_argv(argv: list[str]) -> tuple[list[str], list[str], bool]:
    """(launcher options, [target, *target args], target_is_module)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv[:i], argv[i + 1:], False
        if a == "-m":
            return argv[:i], argv[i + 1:], True
        if a.startswith("-m") and not a.startswith("--"):
            return argv[:i], [a[2:]] + argv[i + 1:], True
        if not a.startswith("-") or a == "-":
            return argv[:i], argv[i:], False
        i += 2 if (a in _VALUE_OPTS) else 1
    return argv, [], False


def _local_names() -> set[str]:
    names = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}
    for n in (socket.gethostname(), socket.getfqdn()):
        names.add(n)
        names.add(n.split(".")[0])
    return names


def _is_local(host: str) -> bool:
    if host in _local_names():
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def rank_env(base: dict, *, rank: int, world: int, local_rank: int, local_world: int,
             coordinator: str, jax_coordinator: str, job_id: str, node_rank: int = 0,
             nnodes: int = 1) -> dict:
    """Environment of one rank: `base` plus the jaxodc / torchrun variables."""
    host, _, port = coordinator.rpartition(":")
    env = dict(base)
    env.update({
        "JAXODC_RANK": str(rank), "JAXODC_WORLD_SIZE": str(world),
        "JAXODC_LOCAL_RANK": str(local_rank), "JAXODC_LOCAL_WORLD_SIZE": str(local_world),
        "JAXODC_NODE_RANK": str(node_rank), "JAXODC_NNODES": str(nnodes),
        "JAXODC_COORDINATOR": coordinator, "JAXODC_JAX_COORDINATOR": jax_coordinator,
        "JAXODC_JOB_ID": job_id,
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": host, "MASTER_PORT": port,
        "PYTHONUNBUFFERED": "1",  # output reaches us (and the failure report) as it is written
    })
    return env


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (status {128 - returncode})"
    return f"exited with status {returncode}"


class _Rank:
    def __init__(self, rank: int, proc: subprocess.Popen):
        self.rank = rank
        self.proc = proc
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.readers: list[threading.Thread] = []


class _Job:
    def __init__(self, ranks: list[_Rank], tag: bool):
        self.ranks = ranks
        self.tag = tag
        self.out_lock = threading.Lock()
        self.pending_signals: list[int] = []  # appended by the launcher's signal handler

    def pump(self, r: _Rank, pipe, sink) -> None:
        prefix = f"[rank {r.rank}] " if self.tag else ""
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            r.tail.append(line)
            with self.out_lock:
                try:
                    sink.write(prefix + line + "\n")
                    sink.flush()
                except (OSError, ValueError):
                    pass  # our own stdout went away; keep draining so the rank never blocks
        pipe.close()

    def signal_all(self, sig: int) -> None:
        for r in self.ranks:
            # Each rank leads its own process group (start_new_session), so this reaches the rank
            # and its children only. The group id cannot be reused while members exist.
            try:
                os.killpg(r.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def teardown(self, grace: float, first_sig: int = signal.SIGTERM) -> None:
        self.signal_all(first_sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(r.proc.poll() is None for r in self.ranks):
            time.sleep(0.02)
        self.signal_all(signal.SIGKILL)  # also reaps grandchildren that ignored SIGTERM
        for r in self.ranks:
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def join_readers(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for r in self.ranks:
            for t in r.readers:
                t.join(max(0.0, deadline - time.monotonic()))


def _err(msg: str) -> None:
    sys.stderr.write(f"jaxodc launch: {msg}\n")
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    opts, target, is_module = _split_argv(list(argv))
    parser = _parser()
    if any(a in ("-h", "--help") for a in opts):
        parser.print_help()
        return 0
    args = parser.parse_args(opts)
    if not target:
        parser.print_usage(sys.stderr)
        _err("missing the script to run (script.py or -m module)")
        return 2
    if args.nproc < 1:
        _err(f"-n must be >= 1, got {args.nproc}")
        return 2
    if args.hosts:
        remote = [h for h in args.hosts.split(",") if h.strip() and not _is_local(h.strip())]
        if remote:
            _err(f"remote hosts {remote} are not started by this launcher. Run one "
                 f"`jaxodc launch -n N --nnodes M --node-rank R --coordinator HOST0:PORT` on each "
                 f"host (R = 0..M-1; HOST0 is the host of node rank 0, PORT a free port there).")
            return 2
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        _err(f"--node-rank {args.node_rank} is outside --nnodes {args.nnodes}")
        return 2

    if args.nnodes > 1:
        if not args.coordinator:
            _err("--coordinator HOST0:PORT is required with --nnodes > 1")
            return 2
        coordinator = args.coordinator
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            _err(f"--coordinator must be host:port, got {coordinator!r}")
            return 2
        jax_coordinator = args.jax_coordinator or f"{host}:{int(port) + 1}"
        job_id = args.job_id or sanitize_job_id("n" + coordinator)
    else:
        coordinator = args.coordinator or f"127.0.0.1:{free_port()}"
        jax_coordinator = args.jax_coordinator or f"127.0.0.1:{free_port()}"
        job_id = args.job_id or new_job_id()
    if sanitize_job_id(job_id) != job_id:
        _err(f"--job-id {job_id!r} may contain only [A-Za-z0-9_]")
        return 2

    if is_module:
        cmd = [sys.executable, "-u", "-m", *target]
    else:
        cmd = [sys.executable, "-u", *target]
    world = args.nproc * args.nnodes
    return _run(cmd, args, world, coordinator, jax_coordinator, job_id)


def _run(cmd, args, world, coordinator, jax_coordinator, job_id) -> int:
    ranks: list[_Rank] = []
    job = _Job(ranks, args.tag_output)
    old_handlers = {}

    def on_signal(signum, _frame):
        job.pending_signals.append(signum)

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old_handlers[s] = signal.signal(s, on_signal)
    try:
        for local in range(args.nproc):
            rank = args.node_rank * args.nproc + local
            env = rank_env(os.environ, rank=rank, world=world, local_rank=local,
                           local_world=args.nproc, coordinator=coordinator,
                           jax_coordinator=jax_coordinator, job_id=job_id,
                           node_rank=args.node_rank, nnodes=args.nnodes)
            try:
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
            except OSError as e:
                _err(f"could not start rank {rank}: {e}")
                job.teardown(args.grace)
                return 1
            r = _Rank(rank, proc)
            ranks.append(r)
            for pipe, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=job.pump, args=(r, pipe, sink), daemon=True)
                t.start()
                r.readers.append(t)
        return _supervise(job, args)
    finally:
        if ranks and any(r.proc.poll() is None for r in ranks):
            job.teardown(args.grace)
        job.join_readers()
        for s, h in old_handlers.items():
            signal.signal(s, h)
        removed = cleanup_shm(job_id)
        if removed:
            _err(f"removed {len(removed)} leftover shared-memory segment(s) of job {job_id}")


def _supervise(job: _Job, args) -> int:
    start = time.monotonic()
    ranks = job.ranks
    while True:
        if job.pending_signals:
            signum = job.pending_signals[0]
            _err(f"received {signal.Signals(signum).name}; forwarding it to all ranks and "
                 f"shutting down")
            job.teardown(args.grace, first_sig=signum)
            return 128 + signum
        failed = [r for r in ranks if r.proc.poll() not in (None, 0)]
        if failed:
            # The first to fail is the one whose pid was reaped first; poll order is by rank, so
            # among ranks found dead in the same sweep the lowest rank is reported.
            bad = failed[0]
            code = bad.proc.returncode
            _err(f"rank {bad.rank} (pid {bad.proc.pid}) {_describe(code)}; stopping the other "
                 f"ranks")
            job.teardown(args.grace)
            job.join_readers()
            _report_tail(bad)
            return _status(code)
        if all(r.proc.poll() == 0 for r in ranks):
            return 0
        if args.timeout is not None and time.monotonic() - start > args.timeout:
            alive = [r.rank for r in ranks if r.proc.poll() is None]
            _err(f"timeout after {args.timeout:g} s; killing all ranks (still running: ranks "
                 f"{alive})")
            job.teardown(args.grace)
            return TIMEOUT_STATUS
        time.sleep(0.02)


def _report_tail(r: _Rank) -> None:
    lines = list(r.tail)
    with_lines = f"last {len(lines)} line(s) of output" if lines else "no output"
    body = "".join(f"  [rank {r.rank}] {line}\n" for line in lines)
    sys.stderr.write(f"jaxodc launch: rank {r.rank} {with_lines}:\n{body}")
    sys.stderr.flush()


# One compute thread per rank so that ranks sharing few cores do not fight over them.
RANK_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "OMP_NUM_THREADS": "1"}


def rank_env_defaults(environ=None) -> dict:
    """RANK_ENV over `environ` (default os.environ), keeping the caller's own XLA_FLAGS: ours are
    prepended, so a flag the caller set (e.g. --xla_cpu_use_onednn) survives and wins."""
    environ = os.environ if environ is None else environ
    ours, theirs = RANK_ENV["XLA_FLAGS"].split(), environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in theirs}
    flags = [f for f in ours if f.split("=", 1)[0] not in names] + theirs
    return {**RANK_ENV, "XLA_FLAGS": " ".join(flags)}


def pin_one_core(index: int = 0) -> int | None:
    """Pin this process to one of its allowed cores (`index` modulo their count), before jax is
    imported: XLA sizes its intra-op thread pool from the CPU affinity, so without this a rank
    that asked for one compute thread still spreads work over every core and two ranks fight
    over them. Returns the core, or None where affinity is not supported."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[index % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def rank_pythonpath() -> str:
    """PYTHONPATH for rank processes: the directory holding this jaxodc/ first, then the caller's."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def launch_ranks(world: int, module: str, args: list[str], timeout_s: float, env: dict | None = None) -> None:
    """Runs `python -m module args` on `world` local ranks through `jaxodc launch` (`env` on top of
    RANK_ENV); raises SystemExit naming the module when a rank fails."""
    os.environ.update(rank_env_defaults())
    os.environ.update(env or {})
    os.environ["PYTHONPATH"] = rank_pythonpath()
    status = main(["-n", str(world), "--timeout", str(int(timeout_s)), "-m", module] + args)
    if status != 0:
        raise SystemExit(f"ranks of {module} failed with status {status}")
