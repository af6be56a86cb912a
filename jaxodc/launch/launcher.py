"""`jaxodc launch`: start the ranks of a job on this machine (torchrun-like).

    jaxodc launch -n N [--timeout S] [--grace S] [--[no-]tag-output] script.py args...
    jaxodc launch -n N ... -m package.module args...
    multi-host, one launcher per host:
    jaxodc launch -n N --nnodes M --node-rank R --coordinator HOST0:PORT --secret-file F script.py

Across hosts every listener of a rank binds and advertises the address of its host that routes to
the coordinator (jaxodc.launch.address); --local-addr ADDR picks another on hosts with several networks.

Each rank is a subprocess in its own process group, with the environment described in
jaxodc.launch.context. Rank 0 hosts the rendezvous server at the coordinator address.

The job secret (jaxodc.auth) reaches the ranks in the environment, never argv: a fresh random one
per job on one host; across hosts every launcher must be given the same one (--secret-file, or
JAXODC_JOB_SECRET / JAXODC_SECRET_FILE already in the environment, as a SLURM job sets it). Only a
job whose coordinator is loopback may run without one.

When a rank exits non-zero or dies from a signal, the launcher stops the others (SIGTERM, SIGKILL
after the grace period), prints one line naming the failing rank, its last line of output and the
log file holding all of it, and exits with that rank's status (128 + signal number for a signal).
--timeout stops everything and exits 124. SIGINT/SIGTERM to the launcher, at any point of start-up
or later, stop every rank (SIGTERM, then SIGKILL) with one line. A launcher that is itself killed
takes its ranks along: each rank has a parent-death signal, and a watchdog process
(jaxodc.launch.watchdog) kills the ranks' process groups and removes the job's segments. On exit
the job's shared-memory segments (/dev/shm/jaxodc_<job>_*) are removed. -n above what this machine
can hold (`capacity_error`) is refused with the reason.
"""
from __future__ import annotations

import argparse
import codecs
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from jaxodc import auth
from jaxodc.launch.address import ADDR_ENV
from jaxodc.launch.context import cleanup_shm, free_port, new_job_id, sanitize_job_id

__all__ = ["main", "rank_env", "capacity_error", "TIMEOUT_STATUS", "LOG_DIR_ENV"]

TIMEOUT_STATUS = 124
LOG_DIR_ENV = "JAXODC_LOG_DIR"  # where a rank may write its traceback (the launcher's log folder)
# The least memory a Python rank that imports jax takes; -n beyond MemAvailable / this is refused.
RANK_MEMORY_FLOOR = 256 << 20
RANKS_PER_CORE = 16  # beyond this the ranks only fight over the cores

# options that take a value (everything up to the script / -m module belongs to the launcher)
_VALUE_OPTS = {"-n", "--nproc", "--nproc-per-node", "--hosts", "--timeout", "--grace", "--nnodes",
               "--node-rank", "--coordinator", "--jax-coordinator", "--job-id", "--secret-file",
               "--local-addr"}


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
    p.add_argument("--secret-file", default=None,
                   help="file holding the job secret every host's ranks prove (needed with --nnodes>1 "
                        "unless JAXODC_JOB_SECRET / JAXODC_SECRET_FILE is set); default: a fresh one")
    p.add_argument("--local-addr", default=None, metavar="ADDR",
                   help="address of this host the ranks' listeners bind and advertise to the other hosts "
                        "(sets $JAXODC_LOCAL_ADDR); default: the address that routes to the coordinator "
                        "(loopback for a one-host job). For hosts with several networks")
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
    def __init__(self, rank: int, proc: subprocess.Popen, log_path: str):
        self.rank = rank
        self.proc = proc
        self.log_path = log_path
        self.log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.last_line = {"stdout": "", "stderr": ""}  # the last non-blank line of each stream
        self.readers: list[threading.Thread] = []


# A complete piece of output: a line, or a progress update ended by a carriage return.
_PIECE = re.compile(r"[^\r\n]*(?:\r\n|[\r\n])")
_HELD_MAX = 1 << 16


class _Job:
    def __init__(self, ranks: list[_Rank], tag: bool):
        self.ranks = ranks
        self.tag = tag
        self.out_lock = threading.Lock()
        self.pending_signals: list[int] = []  # appended by the launcher's signal handler
        self.silenced: set[int] = set()  # ranks being stopped: their dying words go to their logs only

    def pump(self, r: _Rank, pipe, sink, stream: str) -> None:
        """Copy a rank's output to its log and to `sink`: whole lines, so ranks never split each
        other's lines, except on a line that a carriage return has made a progress bar, whose
        updates go out as they come (the bar stays live). Every line and update gets the prefix."""
        prefix = f"[rank {r.rank}] " if self.tag else ""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        fd, held = pipe.fileno(), ""
        at_start, in_bar = True, False  # next text begins a line / update; a \r was seen on this line
        while True:
            data = os.read(fd, 65536)
            held += decoder.decode(data, final=not data)
            pieces = _PIECE.findall(held)
            held = held[sum(map(len, pieces)):]
            if held and (not data or in_bar or "\r" in "".join(pieces)[-1:] or len(held) > _HELD_MAX):
                # the end of output, a bar's update, or a line too long to hold (memory bounded)
                pieces.append(held + ("\n" if not data else ""))
                held = ""
            if pieces:
                try:  # whole pieces, one write each time: stdout and stderr never split a line
                    os.write(r.log_fd, "".join(pieces).encode())
                except OSError:
                    pass  # a full disk must not block the rank
            out = []
            for piece in pieces:
                if at_start and piece != "\r":
                    out.append(prefix)
                out.append(piece)
                at_start = piece.endswith(("\r", "\n"))
                in_bar = (in_bar or piece.endswith("\r")) and not piece.endswith("\n")
                if piece.endswith("\n") and piece.strip():
                    r.last_line[stream] = piece.strip()
            if out and r.rank not in self.silenced:
                with self.out_lock:
                    try:
                        sink.write("".join(out))
                        sink.flush()
                    except (OSError, ValueError):
                        pass  # our own stdout went away; keep draining so the rank never blocks
            if not data:
                break
        pipe.close()

    def signal_all(self, sig: int) -> None:
        for r in self.ranks:
            # Each rank leads its own process group (start_new_session), so this reaches the rank
            # and its children only. The group id cannot be reused while members exist.
            try:
                os.killpg(r.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def teardown(self, grace: float) -> None:
        self.signal_all(signal.SIGTERM)
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
    why = capacity_error(args.nproc)
    if why:
        _err(why)
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
    try:
        secret_env = _secret_env(args, coordinator)
    except auth.AuthError as e:
        _err(str(e))
        return 2

    if is_module:
        cmd = [sys.executable, "-u", "-m", *target]
    else:
        cmd = [sys.executable, "-u", *target]
    world = args.nproc * args.nnodes
    return _run(cmd, args, world, coordinator, jax_coordinator, job_id, secret_env)


def capacity_error(nproc: int, flag: str = "-n") -> str | None:
    """Why this machine cannot hold `nproc` ranks (memory, cores), or None; `flag` names the option."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc > RANKS_PER_CORE * cores:
        return (f"{flag} {nproc}: more ranks than this machine can run: {cores} core(s) hold at most "
                f"{RANKS_PER_CORE * cores} ranks ({RANKS_PER_CORE} per core); use fewer ranks or more hosts")
    avail = _mem_available()
    if avail is not None and nproc * RANK_MEMORY_FLOOR > avail:
        return (f"{flag} {nproc}: the ranks need at least {nproc * RANK_MEMORY_FLOOR / 2**30:.1f} GiB "
                f"({RANK_MEMORY_FLOOR >> 20} MiB each) but only {avail / 2**30:.1f} GiB of memory is "
                f"available; at most {avail // RANK_MEMORY_FLOOR} ranks fit. Use fewer ranks or more hosts")
    return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _secret_env(args, coordinator: str) -> dict:
    """The ranks' secret variables: --secret-file, else the caller's, else a fresh secret (one
    host only: other hosts could not know it)."""
    if args.secret_file:
        path = os.path.abspath(args.secret_file)
        auth.read_secret_file(path)  # unreadable or empty: refused here, not in every rank
        return {auth.SECRET_FILE_ENV: path, auth.SECRET_ENV: ""}
    if auth.secret_from_env():
        return {}  # given by the caller (e.g. SLURM's job environment): the ranks inherit it
    if args.nnodes == 1:
        return {auth.SECRET_ENV: auth.new_secret().hex()}
    if auth.is_loopback(coordinator.rpartition(":")[0].strip("[]")):
        return {}
    raise auth.AuthError(
        f"--nnodes {args.nnodes}: every host needs the same job secret; give each launcher "
        f"--secret-file FILE (the same random bytes on every host) or set ${auth.SECRET_FILE_ENV}")


# Run by each rank's own process before its command: arm the parent-death signal (it survives
# exec), then become the command (same pid). A preexec_fn would do this between fork and exec, but
# one makes subprocess fork() and run the at-fork handlers of whatever the launcher imported (jax
# warns that forking its threads deadlocks); without one the child runs no Python before exec.
# -I -S: nothing from the environment, the working directory or site-packages can shadow a module.
_ARM_AND_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):  # the launcher died before the signal was armed\n"
    "    os._exit(128 + signal.SIGKILL)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def _with_parent_death_signal(cmd: list[str], launcher_pid: int) -> list[str]:
    """`cmd` started so that the rank dies with the launcher, even a SIGKILLed one (Linux; elsewhere
    the watchdog alone covers a killed launcher)."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-I", "-S", "-c", _ARM_AND_EXEC, str(launcher_pid), *cmd]


def _start_watchdog(job_id: str):
    env = dict(os.environ, PYTHONPATH=rank_pythonpath())
    try:
        return subprocess.Popen([sys.executable, "-m", "jaxodc.launch.watchdog", job_id], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                start_new_session=True)
    except OSError as e:
        _err(f"could not start the watchdog ({e}); a killed launcher may leave ranks behind")
        return None


def _tell_watchdog(dog, line: str) -> None:
    if dog is not None:
        try:
            dog.stdin.write(line + "\n")
            dog.stdin.flush()
        except (OSError, ValueError):
            pass


def _run(cmd, args, world, coordinator, jax_coordinator, job_id, secret_env) -> int:
    ranks: list[_Rank] = []
    job = _Job(ranks, args.tag_output)
    old_handlers = {}

    def on_signal(signum, _frame):
        job.pending_signals.append(signum)

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old_handlers[s] = signal.signal(s, on_signal)
    log_dir = tempfile.mkdtemp(prefix=f"jaxodc_{job_id}_logs_")
    dog = _start_watchdog(job_id)
    me = os.getpid()
    status = 1
    try:
        for local in range(args.nproc):
            if job.pending_signals:  # honoured while spawning, not only once every rank runs
                status = _stop_on_signal(job, args, log_dir)
                return status
            rank = args.node_rank * args.nproc + local
            env = rank_env(os.environ, rank=rank, world=world, local_rank=local,
                           local_world=args.nproc, coordinator=coordinator,
                           jax_coordinator=jax_coordinator, job_id=job_id,
                           node_rank=args.node_rank, nnodes=args.nnodes)
            env.update(secret_env)
            if args.local_addr:
                env[ADDR_ENV] = args.local_addr
            env[LOG_DIR_ENV] = log_dir
            try:
                proc = subprocess.Popen(_with_parent_death_signal(cmd, me), env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
            except (OSError, subprocess.SubprocessError) as e:
                _err(f"could not start rank {rank}: {e}")
                job.teardown(args.grace)
                return 1
            _tell_watchdog(dog, str(proc.pid))  # its process group: it leads a new session
            r = _Rank(rank, proc, os.path.join(log_dir, f"rank{rank}.log"))
            ranks.append(r)
            for pipe, sink, stream in ((proc.stdout, sys.stdout, "stdout"), (proc.stderr, sys.stderr, "stderr")):
                t = threading.Thread(target=job.pump, args=(r, pipe, sink, stream), daemon=True)
                t.start()
                r.readers.append(t)
        status = _supervise(job, args, log_dir)
        return status
    finally:
        if ranks and any(r.proc.poll() is None for r in ranks):
            job.teardown(args.grace)
        job.join_readers()
        for r in ranks:
            os.close(r.log_fd)
        _tell_watchdog(dog, "done")
        if dog is not None:
            try:
                dog.stdin.close()
                dog.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                dog.kill()  # told "done": it has nothing left to do
                dog.wait()
        for s, h in old_handlers.items():
            signal.signal(s, h)
        removed = cleanup_shm(job_id)
        if removed:
            _err(f"removed {len(removed)} leftover shared-memory segment(s) of job {job_id}")
        if status == 0:
            shutil.rmtree(log_dir, ignore_errors=True)


def _stop_on_signal(job: _Job, args, log_dir: str) -> int:
    """One line, then every rank stopped: SIGTERM (a Python rank dies of it without a traceback),
    SIGKILL after the grace period. Their last output goes to their logs only."""
    signum = job.pending_signals[0]
    started = sum(1 for r in job.ranks if r.proc.poll() is None)
    _err(f"received {signal.Signals(signum).name}; stopping the job ({started} running rank(s); their "
         f"output is in {log_dir})")
    job.silenced.update(r.rank for r in job.ranks)
    job.teardown(args.grace)
    return 128 + signum


def _supervise(job: _Job, args, log_dir: str) -> int:
    start = time.monotonic()
    ranks = job.ranks
    while True:
        if job.pending_signals:
            return _stop_on_signal(job, args, log_dir)
        failed = [r for r in ranks if r.proc.poll() not in (None, 0)]
        if failed:
            # The first to fail is the one whose pid was reaped first; poll order is by rank, so
            # among ranks found dead in the same sweep the lowest rank is reported.
            bad = failed[0]
            code = bad.proc.returncode
            # the others die of the teardown: their words would bury the cause
            job.silenced.update(r.rank for r in ranks if r is not bad)
            job.teardown(args.grace)
            job.join_readers()
            last = bad.last_line["stderr"] or bad.last_line["stdout"]  # an error's words go to stderr
            said = f": {last}" if last else " without output"
            _err(f"rank {bad.rank} (pid {bad.proc.pid}) {_describe(code)}{said} -- its full output "
                 f"is in {bad.log_path}; the other ranks were stopped")
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


class RanksFailed(SystemExit):
    """`launch_ranks`' ranks failed (the launcher has said which and why); `status` is its exit status."""

    def __init__(self, module: str, status: int):
        super().__init__(f"ranks of {module} failed with status {status}")
        self.status = status


def launch_ranks(world: int, module: str, args: list[str], timeout_s: float, env: dict | None = None) -> None:
    """Runs `python -m module args` on `world` local ranks through `jaxodc launch` (`env` on top of
    RANK_ENV); raises RanksFailed (a SystemExit naming the module) when a rank fails."""
    os.environ.update(rank_env_defaults())
    os.environ.update(env or {})
    os.environ["PYTHONPATH"] = rank_pythonpath()
    status = main(["-n", str(world), "--timeout", str(int(timeout_s)), "-m", module] + args)
    if status != 0:
        raise RanksFailed(module, status)
