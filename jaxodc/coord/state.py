"""The coordination state machine (PCCL's ``ccoip_master_state``): membership, votes,
micro-consensus and abort propagation, per peer group, with no I/O.

Each public method takes one event (a peer registered, a message, a lost connection, a clock tick,
a solved ring) and returns the `Action` list the transport must carry out, in order. The protocol
and the phases are described in docs/coord.md.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import logging

import numpy as np

from jaxodc.coord import topology
from jaxodc.coord import protocol as P
from jaxodc.coord.protocol import ErrorKind, Msg, Strategy

log = logging.getLogger("jaxodc.coord")

# Late closes only ever ask about recent collectives: past twice this many outcomes per group,
# the older half is forgotten.
_FINISHED_KEPT = 2048


class PeerPhase(enum.StrEnum):
    """Connection phase of a peer (PCCL's ConnectionPhase)."""
    REGISTERED = "registered"  # authenticated; waits for the accepted peers to vote it in
    ACCEPTED = "accepted"      # a member of its group: votes, runs collectives


class OpKind(enum.StrEnum):
    """Major operations: one at a time per group, never beside a collective."""
    TOPOLOGY = "topology"  # admit newcomers, install a new ring
    SYNC = "sync"          # make the shared state bit-identical
    OPTIMIZE = "optimize"  # measure links, solve for a faster ring


class OpPhase(enum.StrEnum):
    """Phase of a major operation or a collective."""
    VOTE = "vote"  # gathering the opening votes of all accepted peers
    RUN = "run"    # opened; gathering the closing votes of all participants


@dataclasses.dataclass(frozen=True)
class Send:
    """Deliver ``msg`` to peer ``to``."""
    to: int
    msg: dict


@dataclasses.dataclass(frozen=True)
class SolveRing:
    """Solve the ring ATSP over ``bandwidth`` (bytes/s, [i, j] = i sends to j) off the event
    loop, then report to `CoordState.ring_solved` or `CoordState.ring_solve_failed`."""
    group: int
    op: int
    bandwidth: np.ndarray


Action = Send | SolveRing  # what every event method returns a list of


@dataclasses.dataclass(eq=False)
class Peer:
    """A registered or accepted peer: where its ring endpoint and shared-state server listen."""
    id: int
    group: int
    ring_addr: str
    ss_addr: str
    phase: PeerPhase = PeerPhase.REGISTERED

    def __repr__(self) -> str:
        return f"peer {self.id} ({self.ring_addr}, group {self.group})"


@dataclasses.dataclass
class Measurement:
    """Bandwidth probes of an optimize operation, one directed pair at a time (concurrent probes
    would share links)."""
    ids: list[int]                  # members when it started, in matrix order
    nbytes: int
    bandwidth: np.ndarray
    pairs: list[tuple[int, int]]    # (sender, receiver) matrix indices still to probe
    probe: tuple[int, int, int] | None = None  # (mid, sender, receiver) awaiting MEASURED
    deadline: float = 0.0


@dataclasses.dataclass(eq=False)
class MajorOp:
    """The group's running topology update, shared-state sync or topology optimisation."""
    kind: OpKind
    id: int
    phase: OpPhase = OpPhase.VOTE
    votes: dict[int, tuple[int, dict]] = dataclasses.field(default_factory=dict)  # pid -> (rid, request)
    participants: set[int] = dataclasses.field(default_factory=set)
    done: dict[int, int] = dataclasses.field(default_factory=dict)  # pid -> rid of its closing request
    revision: int | None = None                 # SYNC: the revision everyone adopts
    measurement: Measurement | None = None      # OPTIMIZE


@dataclasses.dataclass(eq=False)
class Collective:
    """One in-flight collective (all-reduce) of a tag."""
    tag: int
    id: int
    phase: OpPhase = OpPhase.VOTE
    votes: dict[int, int] = dataclasses.field(default_factory=dict)  # pid -> rid of its OPEN
    participants: set[int] = dataclasses.field(default_factory=set)
    done: dict[int, int] = dataclasses.field(default_factory=dict)   # pid -> rid of its CLOSE


@dataclasses.dataclass(eq=False)
class Group:
    """A peer group: its members, ring and operations; groups never wait for each other."""
    id: int
    members: list[Peer] = dataclasses.field(default_factory=list)  # accepted, in acceptance order
    registered: dict[int, Peer] = dataclasses.field(default_factory=dict)
    waiting: dict[int, int] = dataclasses.field(default_factory=dict)  # registered pid -> rid of its TOPO
    joiners: set[int] = dataclasses.field(default_factory=set)  # waiting pids that must not found the group
    ring: list[int] = dataclasses.field(default_factory=list)
    epoch: int = 0
    stale: bool = True                     # the ring must be (re)installed before a collective
    preferred: list[int] | None = None     # optimised ring order (peer ids)
    major: MajorOp | None = None
    colls: dict[int, Collective] = dataclasses.field(default_factory=dict)
    # (tag, op) -> None if it completed, else why it failed: answers late closes
    finished: dict[tuple[int, int], str | None] = dataclasses.field(default_factory=dict)
    pending_round: dict[int, int] = dataclasses.field(default_factory=dict)  # pid -> rid of its PENDING
    last_revision: int | None = None

    def member_ids(self) -> set[int]:
        return {p.id for p in self.members}


class CoordState:
    """All coordination state of one service, driven by events.

    Args:
        measure_bytes: default bytes per bandwidth probe of an optimize operation.
        measure_timeout_s: how long a probed peer may take to report its bandwidth.
    """

    def __init__(self, measure_bytes: int = 1 << 20, measure_timeout_s: float = 60.0):
        self.measure_bytes = measure_bytes
        self.measure_timeout_s = measure_timeout_s
        self.peers: dict[int, Peer] = {}
        self.groups: dict[int, Group] = {}
        # auth_failures and malformed_frames are counted by the transport
        self.counters = {"joined": 0, "accepted": 0, "removed": 0, "auth_failures": 0,
                         "malformed_frames": 0, "aborts": 0, "rejected_revisions": 0}
        self._ids = itertools.count(1)
        self._op_ids = itertools.count(1)  # operations and probes share one id space
        self._handlers = {Msg.PENDING: self._on_pending, Msg.TOPO: self._on_topo,
                          Msg.TOPO_DONE: self._on_topo_done, Msg.OPEN: self._on_open,
                          Msg.CLOSE: self._on_close, Msg.SYNC: self._on_sync,
                          Msg.SYNC_DONE: self._on_sync_done, Msg.OPTIMIZE: self._on_optimize}
        self._out: list[Action] = []
        self._now = 0.0

    # --- events -----------------------------------------------------------------------------

    def _host_order(self, pid: int) -> tuple:
        """A peer's place in an unoptimised ring: its ring endpoint's host (IPv4 numerically), then
        its id."""
        host = self.peers[pid].ring_addr.rpartition(":")[0].strip("[]")
        parts = host.split(".")
        numeric = len(parts) == 4 and all(x.isdigit() for x in parts)
        return (0, tuple(int(x) for x in parts), pid) if numeric else (1, host, pid)

    def register(self, group: int, ring_addr: str, ss_addr: str) -> int:
        """An authenticated peer joins ``group`` as REGISTERED.

        Args:
            ring_addr, ss_addr: its ring endpoint and shared-state server ("host:port").
        Returns:
            Its peer id.
        """
        peer = Peer(next(self._ids), group, ring_addr, ss_addr)
        self.peers[peer.id] = peer
        self.groups.setdefault(group, Group(group)).registered[peer.id] = peer
        self.counters["joined"] += 1
        return peer.id

    def receive(self, pid: int, msg: dict, now: float) -> list[Action]:
        """Handle one decoded frame from peer ``pid``; a malformed one is counted and dropped.

        Args:
            msg: the frame (its ``"t"`` is a string).
            now: monotonic clock, seconds.
        Returns:
            The actions to carry out, in order.
        """
        self._begin(now)
        peer = self.peers.get(pid)
        if peer is not None:  # else a frame read after the peer was removed
            try:
                self._dispatch(peer, msg)
            except P.ProtocolError as e:
                self.malformed(pid, e)
        return self._take()

    def disconnect(self, pid: int, reason: str, now: float) -> list[Action]:
        """Peer ``pid`` is gone (connection lost, heartbeat timeout): abort what it took part in.

        Args:
            reason: why, for the logs and the survivors' abort reasons.
            now: monotonic clock, seconds.
        Returns:
            The actions to carry out, in order (none for an unknown or already removed peer).
        """
        self._begin(now)
        peer = self.peers.pop(pid, None)
        if peer is not None:
            self._remove(peer, reason)
        return self._take()

    def tick(self, now: float) -> list[Action]:
        """Fail optimize operations whose bandwidth probe is overdue.

        Args:
            now: monotonic clock, seconds.
        Returns:
            The actions to carry out, in order.
        """
        self._begin(now)
        for group in self.groups.values():
            m = self._measuring(group)
            if m is not None and m.probe is not None and now > m.deadline:
                _, i, j = m.probe
                self._fail_optimize(group, f"peer {m.ids[i]} did not report its bandwidth to peer "
                                           f"{m.ids[j]} within {self.measure_timeout_s} s")
        return self._take()

    def ring_solved(self, group: int, op: int, order: list[int], cost: tuple[float, float]) -> list[Action]:
        """Finish optimize operation ``op`` of ``group`` with the solved ring.

        Args:
            order: the ring as indices into the `SolveRing` bandwidth matrix.
            cost: its (bottleneck, total) cost.
        Returns:
            The actions to carry out (none if the operation failed meanwhile).
        """
        self._begin()
        g = self.groups[group]
        m = self._measuring(g)
        if g.major is None or g.major.id != op or m is None:
            return self._take()
        ids, n = m.ids, len(m.ids)
        current = [ids.index(pid) for pid in g.ring if pid in ids]
        current += [k for k in range(n) if k not in current]
        cur_cost = topology.ring_cost(current, topology.cost_matrix(m.bandwidth))
        improved = topology.is_better(cost, cur_cost)
        best = [ids[k] for k in (order if improved else current)]
        if improved:
            g.preferred = best
        log.info("group %d: measured ring cost %s -> optimum %s (%s)", g.id, cur_cost, cost,
                 "installed at next update_topology" if improved else "kept")
        voters = g.major.votes
        g.major = None
        for pid, (rid, _) in voters.items():
            self._reply(pid, rid, ok=True, improved=improved,
                        ring=[self.peers[i].ring_addr for i in best if i in self.peers],
                        bottleneck=cost[0] if improved else cur_cost[0],
                        previous_bottleneck=cur_cost[0],
                        peers=[self.peers[i].ring_addr for i in ids if i in self.peers],
                        bandwidth=m.bandwidth.tolist())
        return self._take()

    def ring_solve_failed(self, group: int, op: int, reason: str) -> list[Action]:
        """Fail optimize operation ``op`` of ``group``: the ring solver raised or timed out.

        Returns:
            The actions to carry out (none if the operation failed meanwhile).
        """
        self._begin()
        g = self.groups[group]
        if g.major is not None and g.major.id == op:
            self._fail_optimize(g, reason)
        return self._take()

    def malformed(self, pid: int, error: Exception) -> None:
        """Count and log a frame from peer ``pid`` that broke the protocol (dropped; the peer stays)."""
        self.counters["malformed_frames"] += 1
        log.warning("dropped malformed frame from %r: %s: %s", self.peers.get(pid, f"peer {pid}"),
                    type(error).__name__, error)

    def snapshot(self) -> dict:
        """Per group: accepted and registered peer ids, ring, epoch, revision; the counters."""
        return {"counters": dict(self.counters),
                "groups": {g.id: {"accepted": [p.id for p in g.members],
                                  "registered": sorted(g.registered),
                                  "waiting": sorted(g.waiting),
                                  "ring": list(g.ring), "epoch": g.epoch, "stale": g.stale,
                                  "revision": g.last_revision,
                                  "preferred": list(g.preferred or [])}
                           for g in self.groups.values()}}

    # --- output -----------------------------------------------------------------------------

    def _begin(self, now: float | None = None) -> None:
        if now is not None:
            self._now = now
        self._out = []

    def _take(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    def _send(self, pid: int, msg: dict) -> None:
        if pid in self.peers:  # departed peers get nothing
            self._out.append(Send(pid, msg))

    def _reply(self, pid: int, rid: int, **fields) -> None:
        self._send(pid, {"t": Msg.REPLY, "rid": rid, **fields})

    def _error(self, pid: int, rid: int, reason: str, kind: ErrorKind = ErrorKind.ERROR) -> None:
        self._reply(pid, rid, ok=False, kind=kind, reason=reason)

    # --- dispatch ---------------------------------------------------------------------------

    def _dispatch(self, peer: Peer, msg: dict) -> None:
        t = msg["t"]
        fields = P.PEER_MESSAGE_FIELDS.get(t)
        if fields is None:
            P.check_fields(msg, {"rid": int})
            self._error(peer.id, msg["rid"], f"unknown request type {t!r}")
            raise P.ProtocolError(f"unknown request type {t!r}")
        P.check_fields(msg, fields)
        if t == Msg.HEARTBEAT:
            self._send(peer.id, {"t": Msg.HEARTBEAT})
        elif t == Msg.MEASURED:
            self._on_measured(peer, msg)
        elif t != Msg.TOPO and peer.phase is not PeerPhase.ACCEPTED:
            self._error(peer.id, msg["rid"], f"{peer!r} is registered but not accepted: call "
                                             f"update_topology first", ErrorKind.NOT_ACCEPTED)
        else:
            self._handlers[t](peer, self.groups[peer.group], msg["rid"], msg)

    # --- removal and aborts -----------------------------------------------------------------

    def _remove(self, peer: Peer, reason: str) -> None:
        self.counters["removed"] += 1
        group = self.groups[peer.group]
        log.info("removed %r: %s", peer, reason)
        group.registered.pop(peer.id, None)
        group.waiting.pop(peer.id, None)
        group.joiners.discard(peer.id)
        if peer.phase is PeerPhase.REGISTERED:
            self._check_topology(group)
            return
        group.members.remove(peer)
        why = f"{peer!r} failed: {reason}"
        if peer.id in group.ring:
            group.stale = True
        if group.colls:
            self._abort_collectives(group, why)
        op = group.major
        if op is not None:
            if op.kind is OpKind.TOPOLOGY and op.phase is OpPhase.RUN and peer.id in op.participants:
                self._fail_major(group, why, abort=True)
            elif op.kind is OpKind.OPTIMIZE and op.phase is OpPhase.RUN:
                if op.measurement.probe is not None:  # a solve in progress still completes
                    self._fail_optimize(group, f"{peer!r} failed during a bandwidth measurement: {reason}")
            else:
                self._progress_major(group)
        if not group.members:
            if group.major is not None and group.major.phase is OpPhase.VOTE:
                group.major = None  # nobody left to vote
            self._check_topology(group)  # parked newcomers bootstrap the group again
        self._check_pending_round(group)

    def _end_collectives(self, group: Group, reason: str, kind: ErrorKind) -> None:
        """Refuse every unanswered request of the group's collectives and forget them."""
        for c in group.colls.values():
            for pid, rid in (c.votes if c.phase is OpPhase.VOTE else c.done).items():
                self._error(pid, rid, reason, kind)
            group.finished[(c.tag, c.id)] = reason
        group.colls.clear()
        if len(group.finished) > 2 * _FINISHED_KEPT:
            for k in list(group.finished)[:_FINISHED_KEPT]:
                del group.finished[k]

    def _abort_collectives(self, group: Group, reason: str) -> None:
        """Abort every in-flight collective of the group at every survivor."""
        self.counters["aborts"] += 1
        tags = sorted(group.colls)
        self._end_collectives(group, reason, ErrorKind.ABORTED)
        for p in group.members:
            self._send(p.id, {"t": Msg.ABORT, "tags": tags, "reason": reason})
        group.stale = True

    def _fail_major(self, group: Group, reason: str, abort: bool = False) -> None:
        """Fail the group's major operation: refuse its unanswered requests; with ``abort``, also
        push an abort to its participants (they may be connecting a ring)."""
        op = group.major
        group.major = None
        if op is None:
            return
        log.warning("group %d: %s %d failed: %s", group.id, op.kind, op.id, reason)
        pending = dict(op.done)
        if op.phase is OpPhase.VOTE or op.kind is OpKind.OPTIMIZE:  # optimize answers only at the end
            pending.update({pid: rid for pid, (rid, _) in op.votes.items()})
        for pid, rid in pending.items():
            self._error(pid, rid, reason, ErrorKind.ABORTED)
        if abort:
            group.stale = True
            for pid in op.participants:
                self._send(pid, {"t": Msg.ABORT, "tags": [], "reason": reason})

    # --- major operations -------------------------------------------------------------------

    def _vote_major(self, peer: Peer, group: Group, rid: int, kind: OpKind, msg: dict) -> None:
        """Record peer's opening vote for a major operation (or refuse it) and start the operation
        once the vote is unanimous."""
        if (kind is OpKind.TOPOLOGY and group.colls
                and all(c.phase is OpPhase.VOTE for c in group.colls.values())):
            # A peer re-forming the ring after a failure others have not seen yet: collectives
            # that are still gathering votes cannot succeed on this ring; send them to the vote.
            self._end_collectives(group, f"group {group.id}: {peer!r} is re-forming the ring; call "
                                         f"update_topology", ErrorKind.STALE)
        if group.colls:
            self._error(peer.id, rid, f"group {group.id}: {kind} requested while collectives "
                                      f"{sorted(group.colls)} are in flight", ErrorKind.BUSY)
            return
        op = group.major
        if op is None:
            op = group.major = MajorOp(kind, next(self._op_ids))
        elif op.kind is not kind or op.phase is not OpPhase.VOTE:
            self._error(peer.id, rid, f"group {group.id}: {kind} requested while {op.kind} {op.id} "
                                      f"is in phase {op.phase}", ErrorKind.BUSY)
            return
        if peer.id in op.votes:
            self._error(peer.id, rid, f"{peer!r} voted twice in {kind} {op.id}")
            return
        op.votes[peer.id] = (rid, msg)
        self._progress_major(group)

    def _progress_major(self, group: Group) -> None:
        """Start or end the group's major operation if its votes are now complete."""
        op = group.major
        if op is None:
            return
        if op.kind is OpKind.TOPOLOGY:
            self._check_topology(group)
        elif op.phase is OpPhase.RUN:
            if op.kind is OpKind.SYNC:  # an optimize run ends with its measurement, not by votes
                self._check_sync_done(group)
        elif group.members and self._unanimous(group, op.votes):
            if op.kind is OpKind.SYNC:
                self._start_sync(group)
            else:
                self._start_optimize(group)

    @staticmethod
    def _unanimous(group: Group, votes: dict[int, object]) -> bool:
        """Every accepted member of the group voted (votes of departed peers do not matter)."""
        return group.member_ids() <= set(votes)

    def _close_votes_complete(self, op: MajorOp | Collective) -> bool:
        return {pid for pid in op.participants if pid in self.peers} <= set(op.done)

    def _running_major(self, group: Group, kind: OpKind, op_id: int) -> MajorOp | None:
        op = group.major
        return op if op is not None and op.kind is kind and op.phase is OpPhase.RUN and op.id == op_id else None

    def _close_major(self, group: Group, **results) -> bool:
        """End the major operation once every participant voted to close it, answering each
        closing vote with ``results``; False while votes are missing."""
        op = group.major
        if not self._close_votes_complete(op):
            return False
        group.major = None
        for pid, rid in op.done.items():
            self._reply(pid, rid, ok=True, **results)
        return True

    # --- are_peers_pending ------------------------------------------------------------------

    def _on_pending(self, peer: Peer, group: Group, rid: int, msg: dict) -> None:
        group.pending_round[peer.id] = rid
        self._check_pending_round(group)

    def _check_pending_round(self, group: Group) -> None:
        rnd = group.pending_round
        if not rnd or not self._unanimous(group, rnd):
            return
        group.pending_round = {}
        for pid, rid in rnd.items():
            self._reply(pid, rid, ok=True, pending=bool(group.registered))

    # --- topology update --------------------------------------------------------------------

    def _on_topo(self, peer: Peer, group: Group, rid: int, msg: dict) -> None:
        if peer.phase is PeerPhase.REGISTERED:
            group.waiting[peer.id] = rid  # parked until the accepted peers vote
            if not msg.get("found", True):
                group.joiners.add(peer.id)
            self._check_topology(group)
        else:
            self._vote_major(peer, group, rid, OpKind.TOPOLOGY, msg)

    def _check_topology(self, group: Group) -> None:
        op = group.major
        if op is None:
            if group.members or not set(group.waiting) - group.joiners:
                return  # a group is founded by a waiting peer that may found it, with every waiting peer
            op = group.major = MajorOp(OpKind.TOPOLOGY, next(self._op_ids))  # bootstrap an empty group
        if op.kind is not OpKind.TOPOLOGY:
            return
        if op.phase is OpPhase.RUN:
            self._check_topology_done(group)
            return
        if not self._unanimous(group, op.votes):
            return
        newcomers = []
        if all(bool(m.get("accept_new", True)) for _, m in op.votes.values()):
            for pid in sorted(group.waiting):
                p = group.registered.pop(pid)
                p.phase = PeerPhase.ACCEPTED
                group.members.append(p)
                group.joiners.discard(pid)
                newcomers.append((pid, group.waiting[pid]))
                self.counters["accepted"] += 1
                log.info("group %d accepted %r", group.id, p)
            group.waiting.clear()
        member_ids = [p.id for p in group.members]
        pref = [pid for pid in (group.preferred or []) if pid in member_ids]
        # Unless an optimised order is preferred, the ring follows the peers' hosts, not the order
        # they registered in (a race): the same members on the same hosts then sum in the same
        # order, so a rerun of a job gives bit-identical sums (peers of one host: registration order).
        ring = pref + sorted((pid for pid in member_ids if pid not in pref), key=self._host_order)
        voters = [(pid, rid) for pid, (rid, _) in op.votes.items() if pid in self.peers]
        addrs = [self.peers[i].ring_addr for i in ring]
        if ring == group.ring and not group.stale:
            group.major = None
            for pid, rid in voters:
                self._reply(pid, rid, ok=True, changed=False, epoch=group.epoch, ring=addrs,
                            rank=ring.index(pid))
            return
        group.epoch += 1
        group.ring = ring
        group.stale = True
        op.phase = OpPhase.RUN
        op.participants = set(ring)
        log.info("group %d: installing ring epoch %d: %s", group.id, group.epoch, ring)
        for pid, rid in voters + newcomers:
            self._reply(pid, rid, ok=True, changed=True, op=op.id, epoch=group.epoch, ring=addrs,
                        rank=ring.index(pid))
        if not ring:
            group.major = None

    def _on_topo_done(self, peer: Peer, group: Group, rid: int, msg: dict) -> None:
        op = self._running_major(group, OpKind.TOPOLOGY, msg["op"])
        if op is None:
            self._error(peer.id, rid, f"topology update {msg['op']} is not running (it failed or finished)",
                        ErrorKind.ABORTED)
        elif not msg.get("ok", False):
            # the abort push goes out before this refusal, so it cannot hit the peer's next ring
            self._fail_major(group, f"{peer!r} could not connect the ring: {msg.get('reason')}", abort=True)
            self._error(peer.id, rid, "ring connection failed", ErrorKind.ABORTED)
        else:
            op.done[peer.id] = rid
            self._check_topology_done(group)

    def _check_topology_done(self, group: Group) -> None:
        if self._close_major(group, epoch=group.epoch):
            group.stale = False

    # --- collectives ------------------------------------------------------------------------

    def _on_open(self, peer: Peer, group: Group, rid: int, msg: dict) -> None:
        tag = msg["tag"]
        if group.major is not None:
            # during a topology vote the right move for this peer is to join it (retry path)
            kind = ErrorKind.STALE if group.major.kind is OpKind.TOPOLOGY or group.stale else ErrorKind.BUSY
            self._error(peer.id, rid, f"group {group.id}: collective tag {tag} requested while "
                                      f"{group.major.kind} {group.major.id} runs", kind)
            return
        if group.stale or peer.id not in group.ring:
            self._error(peer.id, rid, f"group {group.id}: ring is stale (a peer left or a collective "
                                      f"was aborted); call update_topology", ErrorKind.STALE)
            return
        if msg["epoch"] != group.epoch:
            self._error(peer.id, rid, f"{peer!r} is on ring epoch {msg['epoch']}, group {group.id} on "
                                      f"{group.epoch}; call update_topology", ErrorKind.STALE)
            return
        c = group.colls.get(tag)
        if c is None:
            c = group.colls[tag] = Collective(tag, next(self._op_ids))
        elif c.phase is not OpPhase.VOTE or peer.id in c.votes:
            self._error(peer.id, rid, f"collective tag {tag} already in flight for {peer!r}", ErrorKind.BUSY)
            return
        c.votes[peer.id] = rid
        if self._unanimous(group, c.votes):
            c.phase = OpPhase.RUN
            c.participants = set(c.votes)
            for pid, r in c.votes.items():
                self._reply(pid, r, ok=True, op=c.id, world=len(group.ring))

    def _on_close(self, peer: Peer, group: Group, rid: int, msg: dict) -> None:
        tag, op_id = msg["tag"], msg["op"]
        c = group.colls.get(tag)
        if c is None or c.id != op_id:
            reason = group.finished.get((tag, op_id), f"collective tag {tag} op {op_id} is unknown")
            self._error(peer.id, rid, reason or "already closed", ErrorKind.ABORTED)
            return
        if not msg.get("ok", False):
            self._error(peer.id, rid, "aborted", ErrorKind.ABORTED)
            self._abort_collectives(group, f"{peer!r} failed collective tag {tag}: {msg.get('reason')}")
            return
        c.done[peer.id] = rid
        if self._close_votes_complete(c):
            del group.colls[tag]
            group.finished[(tag, op_id)] = None
            for pid, r in c.done.items():
                self._reply(pid, r, ok=True)

    # --- shared state -----------------------------------------------------------------------

    def _on_sync(self, peer: Peer, group: Group, rid: int, msg: dict) -> None:
        if msg.get("strategy") not in tuple(Strategy):
            self._error(peer.id, rid, f"unknown shared-state strategy {msg.get('strategy')!r}")
            return
        if not all(isinstance(k, str) and isinstance(h, int) and 0 <= h < 1 << 64
                   for k, h in msg["hashes"].items()):
            raise P.ProtocolError(f"{peer!r}: sync hashes must map str -> uint64")
        self._vote_major(peer, group, rid, OpKind.SYNC, msg)

    def _start_sync(self, group: Group) -> None:
        """Pick the popular state and tell every voter which keys to fetch from whom."""
        op = group.major
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
            elif expected is not None and r < expected and m["strategy"] != Strategy.RECEIVE_ONLY:
                log.info("%r is outdated: revision %d, expected %d", self.peers[pid], r, expected)

        def eligible(pid, m, strict):
            return (m["strategy"] != Strategy.RECEIVE_ONLY and pid not in rejected
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
            key = (m["revision"], tuple(sorted(m["hashes"].items())))
            buckets.setdefault(key, []).append(pid)
        # most holders wins; ties go to the state held by the longest-accepted peer
        (pop_rev, pop_items), holders = min(
            buckets.items(), key=lambda kv: (-len(kv[1]), min(order.get(p, 1 << 30) for p in kv[1])))
        popular = dict(pop_items)
        holders = sorted(holders, key=lambda p: order.get(p, 1 << 30))
        sources = [self.peers[h].ss_addr for h in holders]
        op.revision = pop_rev
        op.phase = OpPhase.RUN
        op.participants = set(votes)
        for pid, m in votes.items():
            mine = m["hashes"]
            differing = sorted(k for k, h in popular.items() if mine.get(k) != h)
            extra = sorted(set(mine) - set(popular))
            fetch = {}
            if m["strategy"] != Strategy.SEND_ONLY and pid not in holders:
                for n, k in enumerate(differing):  # spread keys over the holders
                    s = n % len(sources)
                    fetch[k] = sources[s:] + sources[:s]
            elif differing:
                log.warning("%r (send_only) differs from the popular state in %d keys; not updated",
                            self.peers[pid], len(differing))
            self._reply(pid, op.votes[pid][0], ok=True, op=op.id, revision=pop_rev,
                        expected={k: popular[k] for k in differing}, fetch=fetch, extra=extra,
                        rejected=rejected.get(pid), popular=list(popular.items()),
                        adopt=m["strategy"] != Strategy.SEND_ONLY)

    def _on_sync_done(self, peer: Peer, group: Group, rid: int, msg: dict) -> None:
        op = self._running_major(group, OpKind.SYNC, msg["op"])
        if op is None:
            self._error(peer.id, rid, f"shared-state sync {msg['op']} is not running", ErrorKind.ABORTED)
        elif not msg.get("ok", False):
            self._error(peer.id, rid, "sync failed", ErrorKind.ABORTED)
            self._fail_major(group, f"{peer!r} could not fetch shared state: {msg.get('reason')}")
        else:
            op.done[peer.id] = rid
            self._check_sync_done(group)

    def _check_sync_done(self, group: Group) -> None:
        revision = group.major.revision
        if self._close_major(group, revision=revision):
            group.last_revision = revision

    # --- topology optimisation --------------------------------------------------------------

    def _on_optimize(self, peer: Peer, group: Group, rid: int, msg: dict) -> None:
        nbytes = msg.get("nbytes")
        if nbytes is not None and (not isinstance(nbytes, int) or not 0 < nbytes <= 1 << 30):
            raise P.ProtocolError(f"{peer!r}: optimize nbytes must be a positive int up to 1 GiB, "
                                  f"got {nbytes!r}")
        self._vote_major(peer, group, rid, OpKind.OPTIMIZE, msg)

    def _start_optimize(self, group: Group) -> None:
        op = group.major
        op.phase = OpPhase.RUN
        op.participants = set(op.votes)
        ids = [p.id for p in group.members]
        n = len(ids)
        op.measurement = Measurement(
            ids, max(m.get("nbytes") or self.measure_bytes for _, m in op.votes.values()),
            np.zeros((n, n)), [(i, j) for i in range(n) for j in range(n) if i != j])
        self._next_probe(group, op)

    def _next_probe(self, group: Group, op: MajorOp) -> None:
        """Send the next bandwidth probe, or hand the full matrix to the ring solver."""
        m = op.measurement
        if not m.pairs:
            m.probe = None
            self._out.append(SolveRing(group.id, op.id, m.bandwidth.copy()))
            return
        i, j = m.pairs.pop(0)
        m.probe = (next(self._op_ids), i, j)
        m.deadline = self._now + self.measure_timeout_s
        self._send(m.ids[i], {"t": Msg.MEASURE, "mid": m.probe[0], "peer": self.peers[m.ids[j]].ring_addr,
                              "nbytes": m.nbytes})

    def _on_measured(self, peer: Peer, msg: dict) -> None:
        group = self.groups[peer.group]
        m = self._measuring(group)
        if m is None or m.probe is None or m.probe[0] != msg["mid"] or m.ids[m.probe[1]] != peer.id:
            return  # the answer to a probe of an operation that failed meanwhile
        if not msg.get("ok", False):
            self._fail_optimize(group, f"{peer!r} could not measure: {msg.get('reason')}")
            return
        bw = msg.get("bw")
        if not isinstance(bw, (int, float)):
            raise P.ProtocolError(f"{peer!r}: measured frame lacks a numeric 'bw'")
        _, i, j = m.probe
        m.bandwidth[i, j] = bw
        self._next_probe(group, group.major)

    def _fail_optimize(self, group: Group, reason: str) -> None:
        self._fail_major(group, f"topology optimisation failed: {reason}")

    @staticmethod
    def _measuring(group: Group) -> Measurement | None:
        op = group.major
        return op.measurement if op is not None and op.kind is OpKind.OPTIMIZE else None
