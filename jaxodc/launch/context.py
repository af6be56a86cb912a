"""Process context of a jaxodc job, read from the environment the launcher (or SLURM) sets.

Variables set by `jaxodc launch` (torchrun-like)::

    JAXODC_RANK, JAXODC_WORLD_SIZE, JAXODC_LOCAL_RANK, JAXODC_LOCAL_WORLD_SIZE
    JAXODC_COORDINATOR       host:port of the rendezvous server (hosted by rank 0)
    JAXODC_JAX_COORDINATOR   host:port for jax.distributed (optional; rank 0 picks one if absent)
    JAXODC_JOB_ID            unique id, [A-Za-z0-9_] only; shared-memory names start jaxodc_<id>_
    JAXODC_JOB_SECRET        the job secret, hex (jaxodc.auth; or JAXODC_SECRET_FILE, a file holding it)
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT  (same values)

Under SLURM (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_JOB_ID/SLURM_STEP_NODELIST present and
JAXODC_RANK absent) the same facts come from SLURM, and the coordinator is the first host of the
step's node list at port JAXODC_PORT (default `DEFAULT_PORT`; jax.distributed uses port + 1).
With neither, the process is a world of one (rank 0 with a private rendezvous server).
"""
from __future__ import annotations

import glob
import os
import re
import socket
import uuid
from dataclasses import dataclass
from typing import Mapping

import msgpack

from jaxodc.auth import secret_from_env
from jaxodc.coord.protocol import parse_address
from jaxodc.launch import address
from jaxodc.launch.rendezvous import RendezvousClient, RendezvousServer

__all__ = [
    "Context", "Settings", "init_from_env", "init_jax_distributed", "shutdown", "settings_from_env",
    "expand_nodelist", "parse_tasks_per_node", "free_port", "new_job_id", "shm_prefix",
    "cleanup_shm", "DEFAULT_PORT", "SHM_DIR",
]

DEFAULT_PORT = 29533
SHM_DIR = "/dev/shm"
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass
class Settings:
    """What the environment says about this process, before anything is connected."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    job_id: str
    coordinator: str  # "" = no coordinator given (world of one): rank 0 picks a free port
    jax_coordinator: str  # "" = rank 0 picks a free port and publishes it via the rendezvous
    source: str  # "jaxodc", "slurm" or "single"
    secret: bytes = b""  # the job secret (jaxodc.auth): every listener of the job checks it


@dataclass
class Context:
    rank: int
    world: int
    local_rank: int
    local_world: int
    job_id: str
    coordinator: str
    rendezvous: RendezvousClient
    server: RendezvousServer | None
    jax_coordinator: str = ""
    timeout_s: float = 120.0
    jax_initialized: bool = False
    secret: bytes = b""  # the job secret (jaxodc.auth): every listener of the job checks it
    local_addr: str = "127.0.0.1"  # what this rank's listeners bind and advertise (jaxodc.launch.address)

    def barrier(self, name: str, timeout_s: float | None = None) -> None:
        self.rendezvous.barrier(name, self.world, timeout_s)

    def allgather(self, name: str, value: bytes, timeout_s: float | None = None) -> list[bytes]:
        return self.rendezvous.allgather(name, value, self.world, timeout_s)


# -- small utilities shared with the launcher and the test harness -------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 probe)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_job_id() -> str:
    return "j" + uuid.uuid4().hex[:12]


def sanitize_job_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", text) or "job"


def shm_prefix(job_id: str) -> str:
    """Prefix of every POSIX shared-memory segment of this job (names under /dev/shm)."""
    return f"jaxodc_{job_id}_"


def cleanup_shm(job_id: str) -> list[str]:
    """Remove /dev/shm/jaxodc_<job_id>_* (leftovers of crashed ranks); returns removed paths."""
    if not _JOB_ID_RE.match(job_id):
        raise ValueError(f"job id {job_id!r} must match [A-Za-z0-9_]+")
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(shm_prefix(job_id))) + "*"):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: 'node[01-03,07],gpu5' -> node01 node02 node03 node07 gpu5."""
    hosts: list[str] = []
    for item in _split_top(nodelist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in node list {text!r}")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[: m.start()], item[m.end():]
    out = []
    for rng in m.group(1).split(","):
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {rng!r} in node list item {item!r}")
        width = len(lo)
        for i in range(int(lo), int(hi if sep else lo) + 1):
            out.extend(_expand_one(f"{head}{i:0{width}d}{tail}"))
    return out


def parse_tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed tasks-per-node list: '4(x2),3' -> [4, 4, 3]."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"bad SLURM tasks-per-node list {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


# -- reading the environment ----------------------------------------------------------------------

def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _need(env: Mapping[str, str], names: list[str], source: str) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        raise ValueError(f"{source} environment is incomplete: missing {', '.join(missing)}")


def settings_from_env(environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    if "JAXODC_RANK" in env:
        _need(env, ["JAXODC_WORLD_SIZE", "JAXODC_COORDINATOR", "JAXODC_JOB_ID"], "jaxodc launcher")
        rank, world = _int(env, "JAXODC_RANK"), _int(env, "JAXODC_WORLD_SIZE")
        local_rank = _int(env, "JAXODC_LOCAL_RANK") if "JAXODC_LOCAL_RANK" in env else rank
        local_world = (_int(env, "JAXODC_LOCAL_WORLD_SIZE") if "JAXODC_LOCAL_WORLD_SIZE" in env
                       else world)
        s = Settings(rank, world, local_rank, local_world, env["JAXODC_JOB_ID"],
                     env["JAXODC_COORDINATOR"], env.get("JAXODC_JAX_COORDINATOR", ""), "jaxodc")
    elif "SLURM_PROCID" in env:
        _need(env, ["SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID"], "SLURM")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ValueError("SLURM environment is incomplete: missing SLURM_STEP_NODELIST")
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID")
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        node_id = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        if per_node:
            counts = parse_tasks_per_node(per_node)
            if not 0 <= node_id < len(counts):
                raise ValueError(f"SLURM_NODEID={node_id} outside tasks-per-node list {per_node!r}")
            local_world = counts[node_id]
        elif "SLURM_NTASKS_PER_NODE" in env:
            local_world = _int(env, "SLURM_NTASKS_PER_NODE")
        else:
            local_world = world
        port = _int(env, "JAXODC_PORT") if "JAXODC_PORT" in env else DEFAULT_PORT
        host = expand_nodelist(nodelist)[0]
        job = sanitize_job_id("slurm_" + env["SLURM_JOB_ID"] + "_" + env.get("SLURM_STEP_ID", "0"))
        s = Settings(rank, world, local_rank, local_world, job, f"{host}:{port}",
                     f"{host}:{port + 1}", "slurm")
    else:
        s = Settings(0, 1, 0, 1, new_job_id(), "", "", "single")
    s.secret = secret_from_env(env)
    _check(s)
    return s


def _check(s: Settings) -> None:
    if s.world < 1 or not 0 <= s.rank < s.world:
        raise ValueError(f"rank {s.rank} is outside world size {s.world} ({s.source} environment)")
    if s.local_world < 1 or not 0 <= s.local_rank < s.local_world:
        raise ValueError(f"rank {s.rank}: local rank {s.local_rank} is outside local world size "
                         f"{s.local_world} ({s.source} environment)")
    if not _JOB_ID_RE.match(s.job_id):
        raise ValueError(f"rank {s.rank}: job id {s.job_id!r} must match [A-Za-z0-9_]+")


def _bind_host(host: str) -> str:
    """Interface rank 0 serves the coordinator address `host` on (jaxodc.launch.address.bind_address)."""
    return address.bind_address(host)


# -- public entry points --------------------------------------------------------------------------

def init_from_env(timeout_s: float = 120.0) -> Context:
    """Connect this process to its job: rank 0 starts the rendezvous server at the coordinator
    address, every rank connects (retrying until timeout_s) and all ranks check that they agree
    on world size and job id."""
    s = settings_from_env()
    server = None
    coordinator = s.coordinator
    # Each rank holds one connection (plus a reconnect in flight); more is someone else.
    guard = dict(secret=s.secret, job_id=s.job_id, world=s.world, max_connections=2 * s.world + 8)
    if s.rank == 0:
        if coordinator:
            host, port = parse_address(coordinator, "coordinator address")
            try:
                server = RendezvousServer(_bind_host(host), port, **guard)
            except OSError as e:
                raise RuntimeError(
                    f"rank 0 could not start the rendezvous server at {coordinator}: {e}") from None
        else:
            server = RendezvousServer("127.0.0.1", 0, **guard)
            coordinator = server.address
    try:
        client = RendezvousClient(coordinator, s.rank, timeout_s, secret=s.secret, job_id=s.job_id)
    except BaseException:
        if server is not None:
            server.close()
        raise
    ctx = Context(s.rank, s.world, s.local_rank, s.local_world, s.job_id, coordinator, client,
                  server, s.jax_coordinator, timeout_s, secret=s.secret)
    try:
        # The address this rank's listeners bind and advertise (jaxodc.launch.address).
        mine = address.listen_address(coordinator)
        me = {"world": s.world, "job": s.job_id, "local_world": s.local_world,
              "host": socket.gethostname(), "pid": os.getpid(), "addr": mine}
        peers = [msgpack.unpackb(b) for b in
                 client.allgather("jaxodc/init", msgpack.packb(me), s.world, timeout_s)]
        ctx.local_addr = mine if address.override() else address.refine(mine, me["host"], peers)
        address.set_process_address(ctx.local_addr)
        bad = [r for r, p in enumerate(peers) if (p["world"], p["job"]) != (s.world, s.job_id)]
        if bad:
            raise RuntimeError(
                f"rank {s.rank}: ranks {bad} disagree on the job: they report "
                f"{[(peers[r]['world'], peers[r]['job']) for r in bad]}, this rank has world "
                f"{s.world}, job {s.job_id!r}")
    except BaseException:
        _close(ctx)
        raise
    return ctx


def _local_device_ids(ctx: Context, local_device_ids):
    if local_device_ids != "auto":
        return local_device_ids
    import jax

    platforms = os.environ.get("JAX_PLATFORMS") or (jax.config.jax_platforms or "")
    names = [p.strip() for p in platforms.split(",") if p.strip()]
    if names and all(p == "cpu" for p in names):
        return None  # each CPU process sees its own CPU devices
    # Accelerators: one device per process when several ranks share a host (torchrun convention).
    return [ctx.local_rank] if ctx.local_world > 1 else None


def init_jax_distributed(ctx: Context, cpu_collectives: str = "gloo",
                         local_device_ids="auto", timeout_s: float | None = None) -> None:
    """jax.distributed.initialize for this job, with `cpu_collectives` ("gloo" or "mpi") for
    cross-process collectives on CPU. Must run before jax creates its backends.

    local_device_ids "auto": all local devices on CPU; on accelerators [local_rank] when several
    ranks share a host, else all. The jax coordinator is JAXODC_JAX_COORDINATOR, or a port rank 0
    picks and publishes through the rendezvous. Its service listens where the rendezvous does:
    loopback, or the coordinator's own address on its host (jaxodc.launch.address.bind_address)."""
    import jax

    timeout = ctx.timeout_s if timeout_s is None else timeout_s
    address = ctx.jax_coordinator
    if not address:
        if ctx.rank == 0:
            host = parse_address(ctx.coordinator, "coordinator address")[0]
            address = f"{host}:{free_port(_bind_host(host))}"
            ctx.rendezvous.set("jaxodc/jax_coordinator", address.encode())
        else:
            address = ctx.rendezvous.get("jaxodc/jax_coordinator", timeout).decode()
        ctx.jax_coordinator = address
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    host, port = parse_address(address, "jax coordinator address")
    jax.distributed.initialize(
        coordinator_address=address, coordinator_bind_address=f"{_bind_host(host)}:{port}",
        num_processes=ctx.world, process_id=ctx.rank,
        local_device_ids=_local_device_ids(ctx, local_device_ids),
        initialization_timeout=max(1, int(timeout)))
    ctx.jax_initialized = True


def _close(ctx: Context) -> None:
    ctx.rendezvous.close()
    if ctx.server is not None:
        ctx.server.close()


def shutdown(ctx: Context, timeout_s: float | None = None) -> None:
    """Leave the job cleanly: shut jax.distributed down (if this module started it), meet the
    other ranks at a final barrier so rank 0 does not close the server while others still use it,
    and close the client (and, on rank 0, the server)."""
    timeout = ctx.timeout_s if timeout_s is None else timeout_s
    try:
        if ctx.jax_initialized:
            import jax

            jax.distributed.shutdown()
            ctx.jax_initialized = False
        ctx.rendezvous.barrier("jaxodc/shutdown", ctx.world, timeout)
    finally:
        ctx.rendezvous.close()
        if ctx.server is not None:
            # Give the other ranks a moment to read their barrier reply and hang up.
            ctx.server.wait_for_disconnects(min(timeout, 10.0))
            ctx.server.close()
