"""Lock-step collectives over jaxodc's own transports (csrc/lockstep/group.h).

The collective baseline (`CollectiveTrainer(transport="jaxodc")`) runs its per-unit all-gather and
reduce-scatter, and its scalar all-sums, through a `LockstepGroup` instead of gloo: over POSIX shared
memory between ranks of one host and TCP otherwise -- the paths the ODC runtime uses -- so that
ODC vs. collective compares the protocols, not the transports.

A group is built over fixed *channels* (`Channel(kind, n, name)`); every rank builds the same ones.
Call s of a channel on one rank meets call s of that channel on every other rank; calls on
different channels are independent (XLA may run them in any order). Inside jit use
`jaxodc.ops.lockstep_collective`; `run` does the same from the host.

    group = LockstepGroup([Channel("gather", shard, "unit 0")], rank=r, world=w, allgather=...)
    full = jaxodc.ops.lockstep_collective(shard, group=group, channel=0)   # inside jit
"""
from __future__ import annotations

import itertools
import os
import re
import secrets
from typing import Callable, NamedTuple, Sequence

import msgpack
import numpy as np

from jaxodc._native import C as _C
from jaxodc.auth import secret_from_env

KINDS = {"gather": 0, "scatter": 1, "reduce": 2}
DTYPES = {"float32": 0, "bfloat16": 1}
LINKS = {"shm": 1, "tcp": 2}
_names = itertools.count()


class Channel(NamedTuple):
    """One stream of collective calls. kind "gather": in [n] -> out [world * n] (rank order);
    "scatter": in [world * n] -> out [n], the sum over ranks of their slice `rank` (reduce-scatter);
    "reduce": in [n] -> out [n], the sum over ranks (all-reduce; the same bits on every rank). Sums
    add the ranks' contributions in rank order. `dtype`: "float32" or "bfloat16" (mixed precision's
    units: half the bytes); bfloat16 sums add in float32 and round to bfloat16 after each rank's
    addition."""

    kind: str
    n: int
    name: str
    dtype: str = "float32"


class LockstepGroup:
    """One rank's endpoint of the lock-step collectives.

    Args:
      channels: the channels, the same on every rank (checked).
      rank, world: this process's rank and the number of ranks.
      allgather: every rank's bytes (index = rank), used once to exchange addresses (a trainer's
        `allgather_bytes`, or a rendezvous' allgather).
      link: "auto" (shm on the same host, tcp otherwise), "shm" or "tcp", for every peer.
      timeout_s: bound on every wait for a peer; the error names the channel, call and peer.
      listen_host: address of this rank's TCP listener (default: $JAXODC_LOCAL_ADDR, else the address of
        this host that routes to the job's coordinator, loopback for a one-host job; jaxodc.launch.address).
      job_id: names the shared-memory segment (default $JAXODC_JOB_ID); the name is removed once
        every peer mapped it.
      secret: the job secret every tcp link proves (jaxodc.auth; listener "lockstep_tcp", bound to
        the job id); None: the launcher's ($JAXODC_JOB_SECRET). Empty only with a loopback listen_host.
    """

    def __init__(self, channels: Sequence[Channel], *, rank: int, world: int,
                 allgather: Callable[[bytes], list[bytes]], link: str = "auto", timeout_s: float = 60.0,
                 listen_host: str | None = None, job_id: str | None = None, secret: bytes | None = None):
        if link not in ("auto", "shm", "tcp"):
            raise ValueError(f"rank {rank}: lockstep link must be auto, shm or tcp, got {link!r}")
        self.channels = tuple(Channel(*c) for c in channels)
        for c in self.channels:
            if c.kind not in KINDS:
                raise ValueError(f"rank {rank}: channel {c.name!r} has kind {c.kind!r}; use {sorted(KINDS)}")
            if c.dtype not in DTYPES:
                raise ValueError(f"rank {rank}: channel {c.name!r} has dtype {c.dtype!r}; use {sorted(DTYPES)}")
        self.rank, self.world = rank, world
        from jaxodc.odc.runtime import host_identity

        job_id = job_id or os.environ.get("JAXODC_JOB_ID") or ""  # the same on every rank: it is authenticated
        job = job_id or f"p{os.getpid()}{secrets.token_hex(3)}"
        shm_name = f"/jaxodc_{job}_lockstep{rank}_{next(_names)}"
        from jaxodc.launch.address import default_listen_host, unreachable_hint
        listen_host = listen_host or default_listen_host()
        self._native = _C.LockstepGroup(rank, world, shm_name, [(KINDS[c.kind], int(c.n), c.name, DTYPES[c.dtype])
                                                                   for c in self.channels],
                                        float(timeout_s), listen_host,
                                        secret_from_env() if secret is None else bytes(secret), job_id)
        try:
            me = {"rank": rank, "host": host_identity(), "address": listen_host, "port": self._native.port,
                  "shm_name": shm_name, "layout": self._native.layout_hash}
            infos = [msgpack.unpackb(b) for b in allgather(msgpack.packb(me))] if world > 1 else [me]
            for info in infos:
                if info["layout"] != me["layout"]:
                    raise ValueError(f"rank {rank}: rank {info['rank']} built other lockstep channels (every rank "
                                     "must pass the same kinds and sizes, in the same order)")
            self.links = [self._link(me, info, link) for info in infos]
            try:
                self._native.connect([(i["rank"], LINKS.get(l, 0), i["shm_name"], i["address"], i["port"])
                                      for i, l in zip(infos, self.links)])
            except Exception as e:
                m = re.search(r"could not connect to rank (\d+)", str(e))
                peer = int(m.group(1)) if m else -1
                if not 0 <= peer < len(infos) or self.links[peer] != "tcp":
                    raise
                i = infos[peer]
                where = f"{i['address']}:{i['port']}"
                raise type(e)(f"{e} -- {unreachable_hint(peer, i['host'].split('/')[0], where)}") from None
            if world > 1:
                allgather(b"connected")  # every peer mapped my segment: its name can go
            self._native.unlink_segment()
        except BaseException:
            self._native.close()
            raise
        self._closed = False

    @staticmethod
    def _link(me: dict, peer: dict, link: str) -> str:
        if peer["rank"] == me["rank"]:
            return "self"
        same_host = peer["host"] == me["host"]
        if link == "shm" and not same_host:
            raise ValueError(f"rank {me['rank']}: rank {peer['rank']} runs on another host; shm cannot reach it")
        return link if link != "auto" else ("shm" if same_host else "tcp")

    @property
    def handle(self) -> int:
        """Names this group in jitted lockstep ops."""
        return int(self._native.handle)

    @property
    def segment_bytes(self) -> int:
        """This rank's shared-memory segment: a header, the channels' post table and two staging
        areas shared by every channel, each of the largest single post (csrc/lockstep/group.h)."""
        return int(self._native.segment_bytes)

    @property
    def native_bytes(self) -> int:
        """All this rank's memory in the group outside XLA: its segment and its tcp peers' receive
        buffers (double buffers of every channel's n elements per tcp peer)."""
        return int(self._native.segment_bytes) + int(self._native.tcp_buffer_bytes)

    def in_size(self, channel: int) -> int:
        return int(self._native.in_elems(channel))

    def out_size(self, channel: int) -> int:
        return int(self._native.out_elems(channel))

    def run(self, channel: int, x) -> np.ndarray:
        """The collective of `channel` on host data (blocking; every rank calls it), in the
        channel's dtype (ml_dtypes.bfloat16 for "bfloat16")."""
        if self.channels[channel].dtype == "bfloat16":
            import ml_dtypes
            x = np.ascontiguousarray(x, dtype=ml_dtypes.bfloat16).reshape(-1)
            out = np.empty(self.out_size(channel), ml_dtypes.bfloat16)
            self._native.run(int(channel), x.view(np.uint16), out.view(np.uint16))
            return out
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        out = np.empty(self.out_size(channel), np.float32)
        self._native.run(int(channel), x, out)
        return out

    def close(self) -> None:
        """Shuts the group down (not collective); its handle is dead from then on."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._native.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
