"""The coordination service: membership, votes, micro-consensus, abort propagation.

One asyncio loop. Peers connect, authenticate (HMAC challenge-response), and are *registered*;
they become *accepted* only when every accepted peer of their group votes for them inside an
``update_topology`` round. Everything is per peer group (membership, ring, major operations,
collectives, shared-state revision): groups never wait for each other, which is what lets a
hybrid run (e.g. DiLoCo across groups) keep going when one group churns.

Major operations (topology update, shared-state sync, topology optimisation) are opened by a
unanimous vote of the group's accepted peers and closed by a second unanimous vote once every
participant has done its part; only one runs per group at a time and never beside a collective.
Collectives are opened and closed the same way per tag, and several tags may be in flight.
``are_peers_pending`` is a consensus round that may overlap anything: every peer gets the same
answer. When a peer dies (closed connection, heartbeat timeout) every in-flight collective of
its group is aborted at all survivors, the group's ring is marked stale, and the next collective
is refused until an ``update_topology`` installs a ring without the dead peer.

The service never touches the data path: all-reduces and shared-state transfers go peer to peer.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import signal
import threading
import time

import numpy as np

from jaxodc.coord import protocol as P

log = logging.getLogger("jaxodc.coord")


class Peer:
    def __init__(self, pid: int, group: int, ring_addr: str, ss_addr: str, writer, remote):
        self.id = pid
        self.group = group
        self.ring_addr = ring_addr
        self.ss_addr = ss_addr
        self.writer = writer
        self.remote = remote
        self.accepted = False
        self.alive = True
        self.last_seen = time.monotonic()

    def __repr__(self) -> str:
        return f"peer {self.id} ({self.ring_addr}, group {self.group})"


class MajorOp:
    def __init__(self, kind: str, op_id: int):
        self.kind = kind
        self.id = op_id
        self.phase = "vote"
        self.votes: dict[int, tuple[int, dict]] = {}   # pid -> (rid, request)
        self.participants: set[int] = set()
        self.done: dict[int, int] = {}                 # pid -> rid of the closing request
        self.plan = None


class Collective:
    def __init__(self, tag: int, op_id: int):
        self.tag = tag
        self.id = op_id
        self.phase = "open"
        self.votes: dict[int, int] = {}
        self.participants: set[int] = set()
        self.done: dict[int, int] = {}


class Group:
    def __init__(self, gid: int):
        self.id = gid
        self.members: list[Peer] = []           # accepted, in acceptance order
        self.registered: dict[int, Peer] = {}   # connected, not accepted
        self.waiting: dict[int, int] = {}       # registered pid -> rid of its update_topology
        self.ring: list[int] = []
        self.epoch = 0
        self.stale = True                       # ring must be (re)installed before collectives
        self.preferred: list[int] | None = None  # optimised order (peer ids)
        self.major: MajorOp | None = None
        self.colls: dict[int, Collective] = {}
        self.finished: dict[tuple[int, int], str | None] = {}  # (tag, op) -> None ok / reason
        self.pending_round: dict[int, int] = {}
        self.last_revision: int | None = None

    def alive_ids(self) -> set[int]:
        return {p.id for p in self.members if p.alive}


class CoordinatorService:
    """The service; ``start()`` runs it embedded in a background thread with its own loop."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: bytes = b"",
                 heartbeat_timeout_s: float = 10.0, auth_timeout_s: float = 5.0,
                 measure_bytes: int = 1 << 20, tsp_time_limit_s: float = 1.0):
        self.host, self.port = host, port
        self.secret = secret
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.auth_timeout_s = auth_timeout_s
        self.measure_bytes = measure_bytes
        self.tsp_time_limit_s = tsp_time_limit_s
        self.peers: dict[int, Peer] = {}
        self.groups: dict[int, Group] = {}
        self._ids = itertools.count(1)
        self._op_ids = itertools.count(1)
        self._measure: dict[int, tuple[int, asyncio.Future]] = {}
        self.counters = {"joined": 0, "accepted": 0, "removed": 0, "auth_failures": 0,
                         "malformed_frames": 0, "aborts": 0, "rejected_revisions": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._stopped = None
        self.address: str | None = None

    # --- lifecycle --------------------------------------------------------------------------

    async def serve_start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.host}:{port}"
        self._monitor = asyncio.ensure_future(self._heartbeat_monitor())
        log.info("coordination service listening on %s", self.address)

    async def serve_stop(self) -> None:
        self._monitor.cancel()
        self._server.close()
        for p in list(self.peers.values()):
            p.writer.close()
        await self._server.wait_closed()

    def start(self) -> "CoordinatorService":
        ready = threading.Event()
        errors = []

        def run():
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.serve_start())
            except Exception as e:  # e.g. port in use: report to the starting thread
                errors.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_until_complete(self._stopped.wait())
                loop.run_until_complete(self.serve_stop())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="jaxodc-coord", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise TimeoutError("coordination service did not start listening within 30 s")
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout=10)

    def call(self, fn, timeout: float = 10.0):
        """Run fn() on the service loop from another thread and return its result."""
        async def wrap():
            return fn()
        return asyncio.run_coroutine_threadsafe(wrap(), self._loop).result(timeout)

    def snapshot(self) -> dict:
        """Thread-safe view: per group accepted peer ids, ring, epoch; counters."""
        def snap():
            return {"counters": dict(self.counters),
                    "groups": {g.id: {"accepted": [p.id for p in g.members],
                                      "registered": sorted(g.registered),
                                      "waiting": sorted(g.waiting),
                                      "ring": list(g.ring), "epoch": g.epoch, "stale": g.stale,
                                      "revision": g.last_revision,
                                      "preferred": list(g.preferred or [])}
                               for g in self.groups.values()}}
        return self.call(snap)

    # --- connections ------------------------------------------------------------------------

    def _send(self, peer: Peer, obj: dict) -> None:
        if peer.alive:
            try:
                peer.writer.write(P.pack(obj))
            except Exception as e:  # a transport closing under us: treated as failure below
                log.debug("write to %r failed: %s", peer, e)

    def _reply(self, peer: Peer, rid: int, **fields) -> None:
        self._send(peer, {"t": "reply", "rid": rid, **fields})

    def _error(self, peer: Peer, rid: int, reason: str, kind: str = "error") -> None:
        self._reply(peer, rid, ok=False, kind=kind, reason=reason)

    async def _authenticate(self, reader, writer) -> dict:
        chal = P.challenge()
        writer.write(P.pack(chal))
        frame = P.decode(await P.read_body(reader))
        cn = P.verify_answer(self.secret, chal, frame)
        for field, typ in (("group", int), ("ring_addr", str), ("ss_addr", str)):
            if not isinstance(frame.get(field), typ):
                raise P.ProtocolError(f"hello lacks {field!r} of type {typ.__name__}")
        return frame, chal, cn

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = writer.get_extra_info("peername")
        try:
            hello, chal, cn = await asyncio.wait_for(self._authenticate(reader, writer), self.auth_timeout_s)
        except (P.ProtocolError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            self.counters["auth_failures"] += 1
            reason = "timed out" if isinstance(e, asyncio.TimeoutError) else str(e) or type(e).__name__
            log.warning("dropped unauthenticated connection from %s: %s", remote, reason)
            if isinstance(e, P.AuthError):  # tell an honest client with the wrong secret why
                writer.write(P.pack({"t": "error", "reason": "authentication failed"}))
            writer.close()
            return
        pid = next(self._ids)
        peer = Peer(pid, hello["group"], hello["ring_addr"], hello["ss_addr"], writer, remote)
        self.peers[pid] = peer
        group = self.groups.setdefault(peer.group, Group(peer.group))
        group.registered[pid] = peer
        self.counters["joined"] += 1
        writer.write(P.pack(P.welcome(self.secret, chal, cn, {"peer_id": pid})))
        log.info("registered %r from %s", peer, remote)
        reason = "connection closed"
        try:
            while True:
                try:
                    body = await P.read_body(reader)
                except P.FrameTooLarge as e:
                    self.counters["malformed_frames"] += 1
                    reason = f"unrecoverable frame: {e}"
                    break
                peer.last_seen = time.monotonic()
                try:
                    msg = P.decode(body)
                    self._dispatch(peer, msg)
                except (P.ProtocolError, KeyError, TypeError, ValueError) as e:
                    self.counters["malformed_frames"] += 1
                    log.warning("dropped malformed frame from %r: %s: %s", peer, type(e).__name__, e)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            reason = "service stopping"
        finally:
            self._remove(peer, reason)
            writer.close()

    async def _heartbeat_monitor(self) -> None:
        period = max(0.05, min(0.5, self.heartbeat_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for peer in list(self.peers.values()):
                if peer.alive and now - peer.last_seen > self.heartbeat_timeout_s:
                    self._remove(peer, f"no heartbeat for {now - peer.last_seen:.1f} s "
                                       f"(timeout {self.heartbeat_timeout_s} s)")
                    peer.writer.transport.abort()

    # --- removal and aborts -----------------------------------------------------------------

    def _remove(self, peer: Peer, reason: str) -> None:
        if not peer.alive:
            return
        peer.alive = False
        self.peers.pop(peer.id, None)
        self.counters["removed"] += 1
        group = self.groups[peer.group]
        log.info("removed %r: %s", peer, reason)
        group.registered.pop(peer.id, None)
        group.waiting.pop(peer.id, None)
        for mid, (owner, fut) in list(self._measure.items()):
            if owner == peer.id and not fut.done():
                fut.set_exception(ConnectionError(f"{peer!r} failed during a bandwidth measurement: {reason}"))
        if not peer.accepted:
            self._check_topology(group)
            return
        group.members = [p for p in group.members if p.id != peer.id]
        why = f"{peer!r} failed: {reason}"
        if peer.id in group.ring:
            group.stale = True
        if group.colls:
            self._abort_collectives(group, why)
        op = group.major
        if op is not None:
            if op.kind == "topology" and op.phase == "run" and peer.id in op.participants:
                self._fail_major(group, why, abort=True)
            elif op.kind == "optimize" and op.phase == "run":
                pass  # the measurement task sees the failed future and fails the op
            else:
                self._progress_major(group)
        if not group.alive_ids():
            if group.major is not None and group.major.phase == "vote":
                group.major = None  # nobody left to vote
            self._check_topology(group)  # parked newcomers bootstrap the group again
        self._check_pending_round(group)

    def _abort_collectives(self, group: Group, reason: str) -> None:
        """Abort every in-flight collective of the group at every survivor."""
        self.counters["aborts"] += 1
        tags = sorted(group.colls)
        for c in group.colls.values():
            waiting = c.votes if c.phase == "open" else c.done  # requests not yet answered
            for pid, rid in waiting.items():
                if pid in self.peers:
                    self._error(self.peers[pid], rid, reason, kind="aborted")
            group.finished[(c.tag, c.id)] = reason
        for p in group.members:
            self._send(p, {"t": "abort", "tags": tags, "reason": reason})
        group.colls.clear()
        group.stale = True
        if len(group.finished) > 4096:  # late closes only ever ask about recent ops
            for k in list(group.finished)[:2048]:
                del group.finished[k]

    def _fail_major(self, group: Group, reason: str, abort: bool = False) -> None:
        op = group.major
        group.major = None
        if op is None:
            return
        log.warning("group %d: %s %d failed: %s", group.id, op.kind, op.id, reason)
        pending = dict(op.done)
        if op.phase == "vote" or op.kind == "optimize":
            pending.update({pid: rid for pid, (rid, _) in op.votes.items()})
        for pid, rid in pending.items():
            if pid in self.peers:
                self._error(self.peers[pid], rid, reason, kind="aborted")
        if abort:
            group.stale = True
            for pid in op.participants:
                if pid in self.peers:
                    self._send(self.peers[pid], {"t": "abort", "tags": [], "reason": reason})

    # --- dispatch ---------------------------------------------------------------------------

    def _dispatch(self, peer: Peer, msg: dict) -> None:
        t = msg["t"]
        if t == "hb":
            self._send(peer, {"t": "hb"})
            return
        if t == "measured":
            entry = self._measure.pop(int(msg["mid"]), None)
            if entry and not entry[1].done():
                if msg.get("ok", False):
                    entry[1].set_result(float(msg["bw"]))
                else:
                    entry[1].set_exception(RuntimeError(f"{peer!r} could not measure: {msg.get('reason')}"))
            return
        rid = int(msg["rid"])
        handler = getattr(self, f"_on_{t}", None)
        if handler is None:
            self.counters["malformed_frames"] += 1
            log.warning("dropped frame of unknown type %r from %r", t, peer)
            self._error(peer, rid, f"unknown request type {t!r}")
            return
        group = self.groups[peer.group]
        if t not in ("topo",) and not peer.accepted:
            self._error(peer, rid, f"{peer!r} is registered but not accepted: call update_topology first",
                        kind="not_accepted")
            return
        handler(peer, group, rid, msg)

    def _begin_major(self, peer: Peer, group: Group, rid: int, kind: str, msg: dict) -> MajorOp | None:
        if kind == "topology" and group.colls and all(c.phase == "open" for c in group.colls.values()):
            # A peer re-forming the ring after a failure others have not seen yet: collectives
            # that are still gathering votes cannot succeed on this ring; send them to the vote.
            reason = f"group {group.id}: {peer!r} is re-forming the ring; call update_topology"
            for c in group.colls.values():
                for pid, r in c.votes.items():
                    if pid in self.peers:
                        self._error(self.peers[pid], r, reason, kind="stale")
                group.finished[(c.tag, c.id)] = reason
            group.colls.clear()
        if group.colls:
            self._error(peer, rid, f"group {group.id}: {kind} requested while collectives "
                                   f"{sorted(group.colls)} are in flight", kind="busy")
            return None
        op = group.major
        if op is None:
            op = group.major = MajorOp(kind, next(self._op_ids))
        elif op.kind != kind or op.phase != "vote":
            self._error(peer, rid, f"group {group.id}: {kind} requested while {op.kind} {op.id} "
                                   f"is in phase {op.phase}", kind="busy")
            return None
        if peer.id in op.votes:
            self._error(peer, rid, f"{peer!r} voted twice in {kind} {op.id}")
            return None
        op.votes[peer.id] = (rid, msg)
        return op

    def _progress_major(self, group: Group) -> None:
        op = group.major
        if op is None:
            return
        if op.kind == "topology":
            self._check_topology(group)
        elif op.kind == "sync":
            if op.phase == "vote":
                self._check_sync_votes(group)
            else:
                self._check_sync_done(group)
        elif op.kind == "optimize" and op.phase == "vote":
            self._check_optimize_votes(group)

    # --- are_peers_pending --------------------------------------------------------------------

    def _on_pending(self, peer, group, rid, msg):
        group.pending_round[peer.id] = rid
        self._check_pending_round(group)

    def _check_pending_round(self, group: Group) -> None:
        rnd = group.pending_round
        alive = group.alive_ids()
        if not rnd or not alive <= set(rnd):
            return
        pending = any(p.alive for p in group.registered.values())
        group.pending_round = {}
        for pid, rid in rnd.items():
            if pid in self.peers:
                self._reply(self.peers[pid], rid, ok=True, pending=pending)

    # --- topology update ----------------------------------------------------------------------

    def _on_topo(self, peer, group, rid, msg):
        if not peer.accepted:
            group.waiting[peer.id] = rid  # parked until the accepted peers vote
            self._check_topology(group)
            return
        if self._begin_major(peer, group, rid, "topology", msg) is not None:
            self._check_topology(group)

    def _check_topology(self, group: Group) -> None:
        op = group.major
        alive = group.alive_ids()
        if op is None:
            if alive or not group.waiting:
                return
            op = group.major = MajorOp("topology", next(self._op_ids))  # bootstrap an empty group
        if op.kind != "topology":
            return
        if op.phase == "run":
            self._check_topology_done(group)
            return
        if not alive <= set(op.votes):
            return
        accept = all(bool(m.get("accept_new", True)) for _, m in op.votes.values())
        newcomers = []
        if accept:
            for pid in sorted(group.waiting):
                p = group.registered.pop(pid)
                p.accepted = True
                group.members.append(p)
                newcomers.append((p, group.waiting[pid]))
                self.counters["accepted"] += 1
                log.info("group %d accepted %r", group.id, p)
            group.waiting.clear()
        member_ids = [p.id for p in group.members]
        pref = [pid for pid in (group.preferred or []) if pid in member_ids]
        ring = pref + [pid for pid in member_ids if pid not in pref]
        voters = [(self.peers[pid], rid) for pid, (rid, _) in op.votes.items() if pid in self.peers]
        if ring == group.ring and not group.stale:
            group.major = None
            for p, rid in voters:
                self._reply(p, rid, ok=True, changed=False, epoch=group.epoch,
                            ring=[self.peers[i].ring_addr for i in ring], rank=ring.index(p.id))
            return
        group.epoch += 1
        group.ring = ring
        group.stale = True
        op.phase = "run"
        op.participants = set(ring)
        addrs = [self.peers[i].ring_addr for i in ring]
        log.info("group %d: installing ring epoch %d: %s", group.id, group.epoch, ring)
        for p, rid in voters + newcomers:
            self._reply(p, rid, ok=True, changed=True, op=op.id, epoch=group.epoch, ring=addrs,
                        rank=ring.index(p.id))
        if not ring:
            group.major = None

    def _on_topo_done(self, peer, group, rid, msg):
        op = group.major
        if op is None or op.kind != "topology" or op.phase != "run" or op.id != msg["op"]:
            self._error(peer, rid, f"topology update {msg['op']} is not running (it failed or finished)",
                        kind="aborted")
            return
        if not msg.get("ok", False):
            self._fail_major(group, f"{peer!r} could not connect the ring: {msg.get('reason')}", abort=True)
            self._error(peer, rid, "ring connection failed", kind="aborted")
            return
        op.done[peer.id] = rid
        self._check_topology_done(group)

    def _check_topology_done(self, group: Group) -> None:
        op = group.major
        if not {pid for pid in op.participants if pid in self.peers} <= set(op.done):
            return
        group.major = None
        group.stale = False
        for pid, rid in op.done.items():
            if pid in self.peers:
                self._reply(self.peers[pid], rid, ok=True, epoch=group.epoch)

    # --- collectives --------------------------------------------------------------------------

    def _on_open(self, peer, group, rid, msg):
        tag = int(msg["tag"])
        if group.major is not None:
            # during a topology vote the right move for this peer is to join it (retry path)
            kind = "stale" if group.major.kind == "topology" or group.stale else "busy"
            self._error(peer, rid, f"group {group.id}: collective tag {tag} requested while "
                                   f"{group.major.kind} {group.major.id} runs", kind=kind)
            return
        if group.stale or peer.id not in group.ring:
            self._error(peer, rid, f"group {group.id}: ring is stale (a peer left or a collective "
                                   f"was aborted); call update_topology", kind="stale")
            return
        if int(msg["epoch"]) != group.epoch:
            self._error(peer, rid, f"{peer!r} is on ring epoch {msg['epoch']}, group {group.id} on "
                                   f"{group.epoch}; call update_topology", kind="stale")
            return
        c = group.colls.get(tag)
        if c is None:
            c = group.colls[tag] = Collective(tag, next(self._op_ids))
        elif c.phase != "open" or peer.id in c.votes:
            self._error(peer, rid, f"collective tag {tag} already in flight for {peer!r}", kind="busy")
            return
        c.votes[peer.id] = rid
        if group.alive_ids() <= set(c.votes):
            c.phase = "run"
            c.participants = set(c.votes)
            for pid, r in c.votes.items():
                self._reply(self.peers[pid], r, ok=True, op=c.id, world=len(group.ring))

    def _on_close(self, peer, group, rid, msg):
        tag, op_id = int(msg["tag"]), int(msg["op"])
        c = group.colls.get(tag)
        if c is None or c.id != op_id:
            reason = group.finished.get((tag, op_id), f"collective tag {tag} op {op_id} is unknown")
            self._error(peer, rid, reason or "already closed", kind="aborted")
            return
        if not msg.get("ok", False):
            self._error(peer, rid, "aborted", kind="aborted")
            self._abort_collectives(group, f"{peer!r} failed collective tag {tag}: {msg.get('reason')}")
            return
        c.done[peer.id] = rid
        if {pid for pid in c.participants if pid in self.peers} <= set(c.done):
            del group.colls[tag]
            group.finished[(tag, op_id)] = None
            for pid, r in c.done.items():
                if pid in self.peers:
                    self._reply(self.peers[pid], r, ok=True)

    # --- shared state -------------------------------------------------------------------------

    def _on_sync(self, peer, group, rid, msg):
        if msg.get("strategy") not in ("enforce_popular", "send_only", "receive_only"):
            self._error(peer, rid, f"unknown shared-state strategy {msg.get('strategy')!r}")
            return
        hashes = msg.get("hashes")
        if (not isinstance(hashes, dict) or not isinstance(msg.get("revision"), int)
                or not all(isinstance(k, str) and isinstance(h, int) and 0 <= h < 1 << 64 for k, h in hashes.items())):
            raise ValueError("sync request needs a revision (int) and hashes (map of str -> uint64)")
        if self._begin_major(peer, group, rid, "sync", msg) is not None:
            self._check_sync_votes(group)

    def _check_sync_votes(self, group: Group) -> None:
        op = group.major
        if not group.alive_ids() <= set(op.votes):
            return
        votes = {pid: m for pid, (_, m) in op.votes.items() if pid in self.peers}
        order = {p.id: k for k, p in enumerate(group.members)}
        expected = None if group.last_revision is None else group.last_revision + 1
        rejected: dict[int, str] = {}
        for pid, m in votes.items():
            r = m["revision"]
            if expected is not None and r > expected:
                rejected[pid] = (f"revision {r} skips ahead: group {group.id} last synced revision "
                                 f"{group.last_revision}, expected {expected} (a sync must be exactly "
                                 f"one revision ahead)")
                self.counters["rejected_revisions"] += 1
                log.warning("rejected shared-state revision from %r: %s", self.peers[pid], rejected[pid])
            elif expected is not None and r < expected and m["strategy"] != "receive_only":
                log.info("%r is outdated: revision %d, expected %d", self.peers[pid], r, expected)

        def eligible(pid, m, strict):
            return (m["strategy"] != "receive_only" and pid not in rejected
                    and (not strict or expected is None or m["revision"] == expected))

        cands = {pid: m for pid, m in votes.items() if eligible(pid, m, True)}
        if not cands:
            cands = {pid: m for pid, m in votes.items() if eligible(pid, m, False)}
            if cands:
                log.warning("group %d: no peer offers revision %s; falling back to the popular "
                            "state among %s", group.id, expected, sorted(cands))
        if not cands:
            self._fail_major(group, f"group {group.id}: no peer offers shared state "
                                    f"(all receive_only or rejected)")
            return
        buckets: dict[tuple, list[int]] = {}
        for pid, m in cands.items():
            key = (m["revision"], tuple(sorted((k, int(h)) for k, h in m["hashes"].items())))
            buckets.setdefault(key, []).append(pid)
        # most holders wins; ties go to the state held by the longest-accepted peer
        (pop_rev, pop_items), holders = min(buckets.items(),
                                             key=lambda kv: (-len(kv[1]), min(order.get(p, 1 << 30) for p in kv[1])))
        popular = dict(pop_items)
        holders = sorted(holders, key=lambda p: order.get(p, 1 << 30))
        op.plan = {"revision": pop_rev}
        op.phase = "run"
        op.participants = set(votes)
        for pid, m in votes.items():
            mine = {k: int(h) for k, h in m["hashes"].items()}
            differing = sorted(k for k, h in popular.items() if mine.get(k) != h)
            extra = sorted(set(mine) - set(popular))
            fetch = {}
            if m["strategy"] != "send_only" and pid not in holders:
                for n, k in enumerate(differing):  # spread keys over the holders
                    srcs = [self.peers[h].ss_addr for h in holders if h in self.peers]
                    fetch[k] = srcs[n % len(srcs):] + srcs[:n % len(srcs)]
            elif differing:
                log.warning("%r (send_only) differs from the popular state in %d keys; not updated",
                            self.peers[pid], len(differing))
            rid = op.votes[pid][0]
            self._reply(self.peers[pid], rid, ok=True, op=op.id, revision=pop_rev,
                        expected={k: popular[k] for k in differing}, fetch=fetch, extra=extra,
                        rejected=rejected.get(pid), popular=list(popular.items()),
                        adopt=m["strategy"] != "send_only")

    def _on_sync_done(self, peer, group, rid, msg):
        op = group.major
        if op is None or op.kind != "sync" or op.phase != "run" or op.id != msg["op"]:
            self._error(peer, rid, f"shared-state sync {msg['op']} is not running", kind="aborted")
            return
        if not msg.get("ok", False):
            self._error(peer, rid, "sync failed", kind="aborted")
            self._fail_major(group, f"{peer!r} could not fetch shared state: {msg.get('reason')}")
            return
        op.done[peer.id] = rid
        self._check_sync_done(group)

    def _check_sync_done(self, group: Group) -> None:
        op = group.major
        if not {pid for pid in op.participants if pid in self.peers} <= set(op.done):
            return
        group.major = None
        group.last_revision = op.plan["revision"]
        for pid, rid in op.done.items():
            if pid in self.peers:
                self._reply(self.peers[pid], rid, ok=True, revision=group.last_revision)

    # --- topology optimisation ----------------------------------------------------------------

    def _on_optimize(self, peer, group, rid, msg):
        nbytes = msg.get("nbytes")
        if nbytes is not None and (not isinstance(nbytes, int) or not 0 < nbytes <= 1 << 30):
            raise ValueError(f"optimize: nbytes must be a positive int up to 1 GiB, got {nbytes!r}")
        if self._begin_major(peer, group, rid, "optimize", msg) is not None:
            self._check_optimize_votes(group)

    def _check_optimize_votes(self, group: Group) -> None:
        op = group.major
        if not group.alive_ids() <= set(op.votes):
            return
        if not op.votes:
            group.major = None
            return
        op.phase = "run"
        op.participants = set(op.votes)
        nbytes = max(int(m.get("nbytes") or self.measure_bytes) for _, m in op.votes.values())
        asyncio.ensure_future(self._run_optimize(group, op, nbytes))

    async def _run_optimize(self, group: Group, op: MajorOp, nbytes: int) -> None:
        from jaxodc.comm import topology
        ids = [p.id for p in group.members]
        n = len(ids)
        bw = np.zeros((n, n))
        try:
            for i, a in enumerate(ids):  # one pair at a time: concurrent probes would share links
                for j, b in enumerate(ids):
                    if i == j:
                        continue
                    if a not in self.peers or b not in self.peers:
                        raise ConnectionError("a peer left during the bandwidth measurement")
                    mid = next(self._op_ids)
                    fut = self._loop.create_future()
                    self._measure[mid] = (a, fut)
                    self._send(self.peers[a], {"t": "measure", "mid": mid, "peer": self.peers[b].ring_addr,
                                               "nbytes": nbytes})
                    bw[i, j] = await asyncio.wait_for(fut, timeout=60.0)
            order, cost = await self._loop.run_in_executor(
                None, lambda: topology.solve_ring(bw, self.tsp_time_limit_s))
        except Exception as e:
            if group.major is op:
                self._fail_major(group, f"topology optimisation failed: {type(e).__name__}: {e}")
            return
        if group.major is not op:
            return
        cmat = topology.cost_matrix(bw)
        current = [ids.index(pid) for pid in group.ring if pid in ids]
        current += [k for k in range(n) if k not in current]
        cur_cost = topology.ring_cost(current, cmat)
        improved = topology.is_better(cost, cur_cost)
        if improved:
            group.preferred = [ids[k] for k in order]
        log.info("group %d: measured ring cost %s -> optimum %s (%s)", group.id, cur_cost, cost,
                 "installed at next update_topology" if improved else "kept")
        group.major = None
        best = [ids[k] for k in order] if improved else [ids[k] for k in current]
        for pid, (rid, _) in op.votes.items():
            if pid in self.peers:
                self._reply(self.peers[pid], rid, ok=True, improved=improved,
                            ring=[self.peers[i].ring_addr for i in best if i in self.peers],
                            bottleneck=cost[0] if improved else cur_cost[0],
                            previous_bottleneck=cur_cost[0],
                            peers=[self.peers[i].ring_addr for i in ids if i in self.peers],
                            bandwidth=bw.tolist())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxodc master", description="run the coordination service standalone")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=48148)
    ap.add_argument("--secret-file", help="file whose bytes are the shared secret (default: no secret)")
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds of silence before a peer is dropped")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    secret = b""
    if args.secret_file:
        with open(args.secret_file, "rb") as f:
            secret = f.read().strip()
    svc = CoordinatorService(args.host, args.port, secret, heartbeat_timeout_s=args.heartbeat_timeout)

    async def run():
        await svc.serve_start()
        print(f"jaxodc master listening on {svc.address}", flush=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, svc._stopped.set)
        await svc._stopped.wait()
        await svc.serve_stop()

    asyncio.run(run())
    return 0
