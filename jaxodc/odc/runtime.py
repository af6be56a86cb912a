"""The ODC runtime of one rank: server memory for its shards plus one-sided access to its peers.

Typical use (one process per rank)::

    rt = Runtime.create(unit_sizes, ctx)          # ctx from jaxodc.launch.context.init_from_env()
    rt.publish(u, initial_shard, version=0)
    ... jitted steps gather version v and push gradients for version v, naming the runtime:
        jaxodc.ops.odc_gather(shard, v, runtime=rt, unit=u, numel=n) ...
    rt.done(v); rt.wait_complete(v)
    g = rt.fetch_grad(u); rt.publish(u, new_shard, v + 1)

Transports per peer pair: "shm" (POSIX shared memory, same host), "tcp" (anywhere) and, when both
ranks keep their server memory on a GPU, "cuda_ipc" (same host: the data moves GPU to GPU, the
control words stay in shared memory) and, across hosts, "nvshmem" (the data moves with NVSHMEM
between symmetric GPU blocks, the control words over tcp; needs the plugin jaxodc/_nvshmem_plugin.so,
built when the nvidia-nvshmem-cu13 wheel is present). `device="auto"` puts the server memory on the
GPU when jax runs on one (call jaxodc.launch.context.init_jax_distributed first: this looks at jax's backend).
NVSHMEM's bootstrap picks a network interface itself; NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME overrides it.
"""
from __future__ import annotations

import atexit
import ctypes
import glob
import os
import socket
import weakref
from dataclasses import dataclass
from typing import Mapping, Sequence

import msgpack
import numpy as np

from jaxodc._native import C as _C
from jaxodc.auth import secret_from_env
from jaxodc.launch.address import default_listen_host, unreachable_hint

TRANSPORTS = {"self": 0, "shm": 1, "tcp": 2, "cuda_ipc": 3, "nvshmem": 4}
NVSHMEM_PLUGIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_nvshmem_plugin.so")

OdcError = _C.OdcError
OdcTimeoutError = _C.OdcTimeoutError
PeerError = _C.PeerError


class LayoutMismatchError(OdcError):
    """Ranks registered different unit layouts."""


@dataclass(frozen=True)
class Link:
    """An emulated network for the tcp transport (a benchmark knob: two ranks on one host then
    behave like two hosts on a slower link). Every connection and direction is capped at `mbps`
    megabits/s (0: uncapped) by a token bucket, and every message arrives `ms` milliseconds after
    it was sent. The same emulation as the communicator's `set_link` (csrc/transport/link_shaper.h).
    Ranks reached over shm are unaffected: use transport="tcp"."""

    mbps: float = 0.0
    ms: float = 0.0

    def __post_init__(self):
        if self.mbps < 0 or self.ms < 0:
            raise ValueError(f"Link(mbps={self.mbps}, ms={self.ms}): both must be >= 0")


def host_identity() -> str:
    """Same string on two processes iff they can share POSIX memory (same host, same boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class PeerInfo:
    rank: int
    host_id: str
    address: str
    port: int
    pid: int
    shm_name: str
    unit_sizes: tuple[int, ...]
    device_uuid: str = ""  # "" when the rank keeps its server memory on the host only
    nvshmem_error: str = "not tried"  # "" when the rank can use nvshmem (plugin loaded, device present)
    slot_elems: int = 0  # receive-slot capacity (clients write in chunks of it)
    host_cache: bool = False  # the rank reads owners on other hosts through its host's gather cache


def nvshmem_usable(info: PeerInfo) -> bool:
    return bool(info.device_uuid) and not info.nvshmem_error


_nvshmem_status: str | None = None


def load_nvshmem_plugin() -> str:
    """Loads the NVSHMEM plugin into this process (once): "" when loaded, else why it cannot be."""
    global _nvshmem_status
    if _nvshmem_status is None:
        if not os.path.exists(NVSHMEM_PLUGIN):
            _nvshmem_status = (f"{NVSHMEM_PLUGIN} does not exist (jaxodc was built without nvcc or without the "
                               "nvidia-nvshmem-cu13 wheel)")
        else:
            # The plugin's rpath names the wheel it was built with; a wheel in this interpreter's
            # environment is preferred when present.
            try:
                import nvidia
                for base in nvidia.__path__:
                    for lib in sorted(glob.glob(os.path.join(base, "nvshmem", "lib", "libnvshmem_host.so.*"))):
                        ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
                        break
            except (ImportError, OSError):
                pass  # the plugin's dlopen reports what is missing
            _nvshmem_status = _C.odc_nvshmem_load(NVSHMEM_PLUGIN)
    return _nvshmem_status


def check_layouts(infos: Sequence[PeerInfo]) -> None:
    """Raises LayoutMismatchError naming the first rank and unit that differ from rank 0."""
    ref = infos[0].unit_sizes
    for info in infos[1:]:
        if info.unit_sizes == ref:
            if info.slot_elems != infos[0].slot_elems:
                raise LayoutMismatchError(f"rank {info.rank} has receive slots of {info.slot_elems} elements, "
                                          f"rank 0 of {infos[0].slot_elems}: every rank must pass the same slot_elems")
            continue
        if len(info.unit_sizes) != len(ref):
            raise LayoutMismatchError(
                f"rank {info.rank} registered {len(info.unit_sizes)} units, rank 0 registered {len(ref)}")
        unit = next(u for u, (a, b) in enumerate(zip(ref, info.unit_sizes)) if a != b)
        raise LayoutMismatchError(
            f"unit {unit} has {info.unit_sizes[unit]} elements on rank {info.rank} but {ref[unit]} on rank 0")


def choose_transport(me: PeerInfo, peer: PeerInfo, override: str | Mapping[int, str]) -> str:
    if peer.rank == me.rank:
        return "self"
    if isinstance(override, Mapping):
        override = override.get(peer.rank, "auto")
    same_host = peer.host_id == me.host_id
    if override == "auto":
        if not same_host:
            return "nvshmem" if nvshmem_usable(me) and nvshmem_usable(peer) else "tcp"
        return "cuda_ipc" if me.device_uuid and peer.device_uuid else "shm"
    if override not in ("shm", "tcp", "cuda_ipc", "nvshmem"):
        raise ValueError(f"unknown ODC transport {override!r} for rank {peer.rank}; "
                         "use auto, shm, tcp, cuda_ipc or nvshmem")
    if override in ("shm", "cuda_ipc") and not same_host:
        raise ValueError(f"rank {peer.rank} runs on another host ({peer.host_id}); {override} cannot reach it")
    if override in ("cuda_ipc", "nvshmem"):
        for info in (me, peer):
            if not info.device_uuid:
                raise ValueError(f"{override} between ranks {me.rank} and {peer.rank}: rank {info.rank} keeps its "
                                 "server memory on the host (Runtime(device=...) is None or no GPU)")
    if override == "nvshmem":
        for info in (me, peer):
            if info.nvshmem_error:
                raise ValueError(f"nvshmem between ranks {me.rank} and {peer.rank}: rank {info.rank} cannot use "
                                 f"the nvshmem plugin: {info.nvshmem_error}")
    return override


def resolve_device(device: int | str | None, rank: int) -> int | None:
    """CUDA ordinal for the rank's device block, or None for host memory only.

    "auto": the first local jax device when jax runs on a GPU and jaxodc was built with CUDA;
    jax's backend is consulted only when JAX_PLATFORMS allows a GPU and a CUDA device is visible."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (int, str)):
        raise TypeError(f"rank {rank}: device must be 'auto', None or a CUDA ordinal, got {device!r}")
    if isinstance(device, int):
        if not _C.odc_cuda_built():
            raise OdcError(f"rank {rank}: device={device} needs jaxodc built with CUDA (nvcc at build time)")
        return device
    if device != "auto":
        raise ValueError(f"rank {rank}: device must be 'auto', None or a CUDA ordinal, got {device!r}")
    if not _C.odc_cuda_built():
        return None
    import jax

    platforms = os.environ.get("JAX_PLATFORMS") or (jax.config.jax_platforms or "")
    names = [p.strip() for p in platforms.split(",") if p.strip()]
    if names and not any(p in ("cuda", "gpu") for p in names):
        return None
    if not _C.odc_cuda_device_uuids():
        return None
    if jax.default_backend() != "gpu":
        return None
    dev = jax.local_devices()[0]
    ordinal = getattr(dev, "local_hardware_id", None)
    return int(dev.id if ordinal is None else ordinal)


ACCUMULATE = ("exact", "fp32")


def accumulate_mode(accumulate: str | None, rank: int | None = None, device: int | None = None) -> str:
    """Runtime's `accumulate`, checked: None means $JAXODC_ODC_ACCUMULATE, else "fp32" (FSDP's
    memory; the exact sum's 16 bytes per owned element are an opt-in). `device`: the owner's CUDA
    ordinal (None: host memory), where the exact sum is refused."""
    where = "accumulate"
    if accumulate is None:
        accumulate, where = os.environ.get("JAXODC_ODC_ACCUMULATE") or "fp32", "JAXODC_ODC_ACCUMULATE"
    if accumulate not in ACCUMULATE:
        raise ValueError(f"{where}={accumulate!r}: use one of {', '.join(ACCUMULATE)}")
    if accumulate == "exact" and device is not None:
        # Pushes landing in a device accumulator (cuda_ipc, nvshmem) are summed there in fp32,
        # in arrival order: "exact" would promise bits it cannot keep.
        raise ValueError(f"rank {rank}: {where}='exact' (reproducible=True) is implemented for CPU owners only: "
                         f"this rank's owner memory is on CUDA device {device}; pass device=None to keep it on "
                         "the host, or use the fp32 sum")
    return accumulate


def _with_hint(message: str, infos: Sequence[PeerInfo], transports: Sequence[str]) -> str:
    """A connect error, plus what to do about the tcp peer it names (its advertised address)."""
    import re
    m = re.search(r"could not connect to rank (\d+)", message)
    if m is None or not 0 <= int(m.group(1)) < len(infos) or transports[int(m.group(1))] not in ("tcp", "nvshmem"):
        return message
    info = infos[int(m.group(1))]
    return f"{message} -- {unreachable_hint(info.rank, info.host_id.split('/')[0], f'{info.address}:{info.port}')}"


def host_cache_wanted(host_cache: bool | None) -> bool:
    """Runtime's `host_cache`: given, else $JAXODC_ODC_HOST_CACHE ("0" off), else on."""
    if host_cache is not None:
        return bool(host_cache)
    return os.environ.get("JAXODC_ODC_HOST_CACHE", "1").strip() not in ("0", "false", "off", "")


_live: "weakref.WeakSet[Runtime]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for rt in list(_live):
        rt.close(barrier=False)


class Runtime:
    """One rank's ODC runtime: server memory for its shards of every unit and one-sided access to
    every peer's (see the module docstring). A context manager: leaving closes it.

    Args:
      unit_sizes: elements of each unit; every rank passes the same (else LayoutMismatchError).
      rank, world: this process's rank and the number of ranks.
      rendezvous: exchanges the peers' addresses (jaxodc.launch.rendezvous; unused when world == 1).
      job_id: names the job's shared-memory segments (letters, digits, '_').
      transport: "auto", "shm", "tcp", "cuda_ipc" or "nvshmem", or {rank: transport} per peer.
      timeout_s: bound on every wait for a peer.
      listen_host: address of this rank's TCP server (default: $JAXODC_LOCAL_ADDR, else the address of
        this host that routes to the job's coordinator, loopback for a one-host job;
        jaxodc.launch.address).
      device: "auto", None (host memory only) or a CUDA ordinal for the server memory.
      slot_elems: fp32 elements per receive slot (0: a shard of the largest unit); smaller slots
        save server memory, pushes then travel in chunks. Every rank must pass the same.
      link: an emulated slower network for the tcp transport (`Link`), None for none.
      secret: the job secret every tcp peer proves (jaxodc.auth; listener "odc_tcp", bound to
        job_id); None: the launcher's ($JAXODC_JOB_SECRET). Empty only with a loopback listen_host.
      host_cache: read the pieces of owners on other hosts through a per-host gather cache: each
        fetched once per minibatch by one rank of the host into the host's shared memory, the
        others copying it (csrc/odc/host_cache.h; memory: every remote owner's pieces in fp32, once
        per host, `host_cache_bytes`). Used by a host all of whose ranks ask for it and that holds
        several ranks; default $JAXODC_ODC_HOST_CACHE, else on ("0" turns it off).
      accumulate: how this rank sums the pushes it owns: "exact" (order-independent fixed point:
        same pushes, same bits, whatever order they arrive in; 16 bytes per shard element) or
        "fp32" (arrival order, 4 bytes per element: FSDP's memory); default $JAXODC_ODC_ACCUMULATE
        or "fp32". "exact" needs host owners (device=None or no GPU): ValueError otherwise
        (csrc/odc/accumulator.h, docs/reproducibility.md).
    """

    def __init__(self, unit_sizes: Sequence[int], *, rank: int, world: int, rendezvous, job_id: str,
                 transport: str | Mapping[int, str] = "auto", timeout_s: float = 60.0,
                 listen_host: str | None = None, device: int | str | None = "auto", slot_elems: int = 0,
                 link: Link | None = None, secret: bytes | None = None, accumulate: str | None = None,
                 host_cache: bool | None = None):
        self.unit_sizes = tuple(int(n) for n in unit_sizes)
        self.rank, self.world, self.job_id = rank, world, job_id
        listen_host = listen_host or default_listen_host()
        ordinal = resolve_device(device, rank)
        self.accumulate = accumulate_mode(accumulate, rank, ordinal)  # checked before anything is made
        secret = secret_from_env() if secret is None else bytes(secret)
        self._native = _C.OdcRuntime(rank, world, job_id, list(self.unit_sizes), float(timeout_s), listen_host,
                                     int(slot_elems), secret)
        try:
            self._native.set_exact_sum(self.accumulate == "exact")
            if link is not None:  # before the peer exchange: peers connect once they know our address
                self._native.set_link(link.mbps * 1e6 / 8, link.ms / 1e3)
            self.link = link
            if ordinal is not None:
                # Before the peer exchange: peers read the device block's IPC handle at connect.
                self._native.enable_device(ordinal)
            self.device = ordinal
            advertised = socket.gethostname() if listen_host == "0.0.0.0" else listen_host
            nvshmem_error = "no device" if ordinal is None or world == 1 else load_nvshmem_plugin()
            me = PeerInfo(rank, host_identity(), advertised, self._native.port, os.getpid(),
                          self._native.shm_name, self.unit_sizes, self._native.device_uuid, nvshmem_error,
                          self._native.slot_elems, host_cache_wanted(host_cache))
            if world > 1:
                raw = rendezvous.allgather(f"odc/{job_id}/peers", msgpack.packb(me.__dict__), world)
                infos = [PeerInfo(**{**msgpack.unpackb(b), "unit_sizes": tuple(msgpack.unpackb(b)["unit_sizes"])})
                         for b in raw]
            else:
                infos = [me]
            check_layouts(infos)
            self.transports = [choose_transport(me, info, transport) for info in infos]
            self.nvshmem = self._join_nvshmem(infos, rendezvous)
            self.remote_ranks = [i.rank for i in infos if i.host_id != me.host_id]
            self.host_cache = self._open_host_cache(infos, rendezvous)
            try:
                self._native.connect([(i.rank, TRANSPORTS[t], i.shm_name, i.address, i.port)
                                      for i, t in zip(infos, self.transports)])
            except PeerError as e:
                raise PeerError(_with_hint(str(e), infos, self.transports)) from None
            if world > 1:
                rendezvous.barrier(f"odc/{job_id}/connected", world)
            # Every peer has mapped our segment: drop its name so a crash leaves nothing behind.
            self._native.unlink_segment()
            self._native.unlink_host_cache()
        except BaseException:
            self._native.close(collective=False)
            raise
        self._rendezvous, self._timeout_s = rendezvous, timeout_s
        self._closed = False
        _live.add(self)

    def _open_host_cache(self, infos: Sequence[PeerInfo], rendezvous) -> bool:
        """The host gather cache (see `host_cache`): a host uses it when it holds several ranks,
        every one of them asks for it, and other hosts exist. Decided from every rank's PeerInfo,
        so all ranks agree; the host's first rank creates it, the others open it after a barrier."""
        hosts: dict[str, list[PeerInfo]] = {}
        for i in infos:
            hosts.setdefault(i.host_id, []).append(i)
        using = {h for h, members in hosts.items()
                 if len(hosts) > 1 and len(members) > 1 and all(m.host_cache for m in members)}
        if not using:
            return False
        mine = hosts[infos[self.rank].host_id]
        leader = min(m.rank for m in mine)
        name = f"/jaxodc_{self.job_id}_hostcache{leader}"
        if infos[self.rank].host_id in using and self.rank == leader:
            self._native.create_host_cache(name, self.remote_ranks)
        rendezvous.barrier(f"odc/{self.job_id}/host_cache", self.world)
        if infos[self.rank].host_id not in using:
            return False
        if self.rank != leader:
            self._native.open_host_cache(name)
        return True

    def remote_shard_bytes(self, itemsize: int = 4) -> int:
        """Bytes of every owner's pieces on other hosts than this rank's, all units: what this host
        must receive per minibatch to gather every unit once (gathered in `itemsize`-byte elements)."""
        total = 0
        for u, n in enumerate(self.unit_sizes):
            shard = self.shard_size(u)
            total += sum(max(0, min(shard, n - r * shard)) for r in self.remote_ranks)
        return total * itemsize

    @property
    def host_cache_bytes(self) -> int:
        """Bytes of the host gather cache's data on this host (0 without one)."""
        return int(self._native.host_cache_bytes)

    @property
    def gather_wire_bytes(self) -> int:
        """Bytes of gathered pieces this rank has received over the network so far."""
        return int(self._native.gather_wire_bytes)

    @property
    def gather_cache_hits(self) -> int:
        """Pieces this rank read from its host's gather cache that another rank of the host fetched."""
        return int(self._native.gather_cache_hits)

    def _join_nvshmem(self, infos: Sequence[PeerInfo], rendezvous) -> bool:
        """Joins the NVSHMEM job when any rank chose nvshmem for a peer: every rank able to use it
        is a PE (NVSHMEM's setup is collective), in rank order; the rank that is PE 0 makes the
        bootstrap id. Returns whether this rank joined."""
        members = [i.rank for i in infos if nvshmem_usable(i)]
        if len(members) < 2:  # nvshmem is only ever chosen between two such ranks
            return False
        key = f"odc/{self.job_id}"
        rows = rendezvous.allgather(f"{key}/transports", msgpack.packb(self.transports), self.world)
        if not any("nvshmem" in msgpack.unpackb(r) for r in rows):
            return False
        uid = self._native.nvshmem_uniqueid() if self.rank == members[0] else b""
        uids = rendezvous.allgather(f"{key}/nvshmem_uid", uid, self.world)
        if self.rank not in members:
            return False
        self._native.init_nvshmem(uids[members[0]], [members.index(r) if r in members else -1
                                                     for r in range(self.world)])
        return True

    @classmethod
    def create(cls, unit_sizes: Sequence[int], ctx, **kwargs) -> "Runtime":
        """Builds the runtime from a jaxodc.launch.Context (its rank, world, rendezvous and job id).

        Args:
          unit_sizes: as for Runtime.
          ctx: a jaxodc.launch.Context.
          **kwargs: Runtime's keyword arguments (transport, timeout_s, device, ...).
        """
        defaults = {"secret": ctx.secret, "listen_host": getattr(ctx, "local_addr", None)}
        return cls(unit_sizes, rank=ctx.rank, world=ctx.world, rendezvous=ctx.rendezvous,
                   job_id=ctx.job_id, **{**defaults, **kwargs})

    @property
    def handle(self) -> int:
        """Names this runtime in jitted ODC ops (their `runtime=` accepts it or the Runtime)."""
        return int(self._native.handle)

    @property
    def slot_elems(self) -> int:
        """fp32 elements per receive slot."""
        return self._native.slot_elems

    # Layout -------------------------------------------------------------------------------
    def shard_size(self, unit: int) -> int:
        """Elements of every rank's shard of `unit` (the last ranks' shards are padded)."""
        return self._native.shard_size(unit)

    def shard_range(self, unit: int) -> tuple[int, int]:
        """[lo, hi) of the unit's flat elements this rank owns (clipped to the unit's size)."""
        shard = self._native.shard_size(unit)
        n = self._native.numel(unit)
        return min(self.rank * shard, n), min((self.rank + 1) * shard, n)

    # Worker side ----------------------------------------------------------------------------
    def gather(self, unit: int, version: int, dtype=np.float32) -> np.ndarray:
        """Reads the whole unit from every owner (outside jit; see jaxodc.ops.odc_gather).

        Args:
          unit: the unit's index.
          version: waits until every owner published at least this version.
          dtype: float32 or bfloat16 (ml_dtypes) of the result.

        Returns:
          The flat unit.
        """
        out = np.empty(self._native.numel(unit), dtype=dtype)
        self._native.gather(unit, version, out)
        return out

    def scatter_accumulate(self, unit: int, version: int, grad: np.ndarray, offset: int | None = None) -> None:
        """Adds `grad` into the owners' accumulators for minibatch `version`.

        Args:
          unit: the unit's index.
          version: the minibatch the gradient belongs to (the owners' current one).
          grad: float32 or bfloat16; the whole flat unit, or with `offset` its elements
            [offset, offset + grad.size).
          offset: see `grad`.
        """
        flat = np.ascontiguousarray(grad).reshape(-1)
        if offset is None:
            self._native.scatter_accumulate(unit, version, flat)
        else:
            self._native.scatter_accumulate_range(unit, version, int(offset), flat)

    def add_range(self, unit: int, offset: int, size: int, *, fraction: float, ratio: float, seed: int = 0,
                  compress: bool = True) -> None:
        """TAGC: pushes of elements [offset, offset + size) of `unit` to other ranks travel as an
        index bitmap + count sketch (csrc/odc/compress.h); this rank's own slice stays dense. Call
        before the first push; ranges of a unit must not overlap.

        Args:
          unit, offset, size: the range of the unit's flat vector (e.g. one parameter).
          fraction: kept fraction per pushed chunk, in (0, 1] (exact top-|g| with error feedback).
          ratio: dense fp32 bytes / sketch bytes, > 1.
          seed: the sketch's hash seed.
          compress: False: the range travels dense and is only counted (`traffic`'s range fields).
        """
        self._native.add_range(int(unit), int(offset), int(size), float(fraction), float(ratio), int(seed),
                               bool(compress))

    def traffic(self, unit: int) -> dict:
        """This rank's gradient traffic of `unit` so far: `wire_bytes` pushed to other ranks,
        `range_bytes` / `range_elems` / `kept_elems` of the registered ranges among them, and as
        the owner, elements decoded exactly (`peeled`) or by the median estimate (`estimated`)."""
        return self._native.traffic(int(unit))

    def residual(self, unit: int, offset: int) -> np.ndarray:
        """A copy of the error-feedback residual of the compressed range of `unit` starting at
        `offset`: what this rank's pushes of it have not delivered yet."""
        return self._native.residual(int(unit), int(offset))

    def set_residual(self, unit: int, offset: int, values) -> None:
        """Replaces that residual (checkpoint restore): the range's size in float32. Between
        minibatches only: this rank's pushes rewrite it without a lock."""
        self._native.set_residual(int(unit), int(offset), np.ascontiguousarray(values, np.float32).reshape(-1))

    def done(self, version: int) -> None:
        """Tells every owner this rank pushed its last gradient of minibatch `version`."""
        self._native.done(version)

    def claim(self, version: int, owner: int, count: int, steal: bool = False) -> int:
        """LB-Steal: claims one of rank `owner`'s microbatches of minibatch `version`.

        The deque lives in the owner's segment (an atomic word; a request to it over tcp).

        Args:
          version: the minibatch.
          owner: the rank whose deque to take from.
          count: the owner's number of microbatches; every caller passes the same for one
            (version, owner).
          steal: take from the back (a thief) instead of the front (the owner).

        Returns:
          The microbatch's index, or -1 when none is left.
        """
        return self._native.claim(int(version), int(owner), int(count), bool(steal))

    def allgather_scalar(self, version: int, value: float) -> np.ndarray:
        """Every rank's `value`; all ranks make the same sequence of calls.

        Args:
          version: labels errors only.
          value: this rank's scalar.

        Returns:
          float64 array of world values, by rank.
        """
        return np.asarray(self._native.allgather_scalar(version, float(value)))

    def allgather(self, version: int, values) -> np.ndarray:
        """Every rank's vector of `values` in one exchange (what a minibatch's end agrees on:
        loss, token count, the optimizer's partial sums); all ranks make the same sequence of
        calls (this one and `allgather_scalar` share it) with vectors of the same length.

        Args:
          version: labels errors only.
          values: this rank's values (float64 on the wire; 62 per post, longer vectors take
            several posts).

        Returns:
          float64 array [world, len(values)], by rank.
        """
        flat = [float(x) for x in np.asarray(values, np.float64).reshape(-1)]
        return np.asarray(self._native.allgather(version, flat)).reshape(self.world, len(flat))

    # Owner side -----------------------------------------------------------------------------
    def wait_complete(self, version: int) -> None:
        """Waits until every rank sent done(version) and its pushes are accumulated here."""
        self._native.wait_complete(version)

    def fetch_grad(self, unit: int) -> np.ndarray:
        """The summed gradient of my shard of `unit` for the completed minibatch (a copy; the
        accumulator is cleared).

        Returns:
          float32 array of shard_size(unit) elements.
        """
        return self._native.fetch_grad(unit)

    def publish(self, unit: int, shard, version: int) -> None:
        """Publishes my new master shard of `unit` as `version` (after wait_complete(version - 1)).

        Args:
          unit: the unit's index.
          shard: shard_size(unit) float32 values.
          version: moves the unit forward; peers gathering it wait for it.
        """
        self._native.publish(unit, np.ascontiguousarray(shard, dtype=np.float32).reshape(-1), version)

    # Zero-copy owner path: the optimizer reads the summed gradient where it accumulated and
    # rewrites the master shard in place, so neither exists twice. Per minibatch v, after
    # wait_complete(v): grad_view(u) (= fetch_grad without the copy) ... clear_grad(u), then
    # publish_in_place(u, v + 1) once master_view(u) holds the new shard.
    def grad_view(self, unit: int) -> np.ndarray:
        """The completed minibatch's gradient of my shard, in place; valid until clear_grad."""
        return self._native.grad_view(unit)

    def clear_grad(self, unit: int) -> None:
        """Zeroes the accumulator of `unit` lent by grad_view (before publish_in_place)."""
        self._native.clear_grad(unit)

    def lend_grads(self, units: Sequence[int]) -> None:
        """grad_view of each of `units`, without making the arrays: for a caller that keeps views
        (or zero-copy arrays) from an earlier minibatch, whose memory never moves."""
        self._native.lend_grads([int(u) for u in units])

    def clear_and_publish_in_place(self, units: Sequence[int], version: int) -> None:
        """clear_grad of each of `units`, then publish_in_place(unit, version) of each."""
        self._native.clear_and_publish_in_place([int(u) for u in units], version)

    def master_view(self, unit: int) -> np.ndarray:
        """My master shard of `unit` (64-byte aligned, so jax on CPU wraps it without a copy).
        Write it only between wait_complete(v) and publish_in_place(v + 1)."""
        return self._native.master_view(unit)

    def publish_in_place(self, unit: int, version: int) -> None:
        """Announce the master shard as written in place for `version`."""
        self._native.publish_in_place(unit, version)

    def published_version(self, unit: int) -> int:
        """The version of my shard of `unit` peers can read (-1 before the first publish)."""
        return self._native.published_version(unit)

    def read_shard(self, unit: int) -> np.ndarray:
        """A copy of my published master shard of `unit`."""
        return self._native.read_shard(unit)

    def stats(self) -> dict:
        """Memory (slot/master/accumulator/segment/device bytes) and traffic counters."""
        return self._native.stats()

    def close(self, barrier: bool = True) -> None:
        """Shuts the runtime down; its handle is dead from then on.

        Args:
          barrier: first wait until every rank is closing, so no peer still reading this rank's
            shards loses them; pass False after a failure.
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        collective = False  # NVSHMEM's teardown waits for every rank: only after the barrier
        try:
            if barrier and self.world > 1:
                self._rendezvous.barrier(f"odc/{self.job_id}/close", self.world, self._timeout_s)
            collective = barrier
        finally:
            self._native.close(collective=collective)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(barrier=exc_type is None)
