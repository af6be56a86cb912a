"""Fault-tolerant communicator client (PCCL-style).

A ``Communicator`` holds one connection to the coordination service (control only), one native
``RingEndpoint`` (the all-reduce data path, peer to peer) and one ``SharedStateServer`` (peer to
peer shared-state transfers). Every major operation and every collective is opened and closed by
a micro-consensus at the service; when any peer fails, the service pushes an abort, this client
aborts its endpoint (in-flight all-reduces raise with the caller's buffers untouched), and the
next ``update_topology`` reconnects the ring at a new epoch without the dead peer.

Typical loop (every peer runs the same sequence of calls)::

    comm = Communicator("host:port", secret=b"...")
    comm.connect()
    comm.update_topology()                 # newcomers block here until the group votes them in
    first = True
    while True:
        if not first and comm.are_peers_pending():
            comm.update_topology()         # accept newcomers
        first = False
        info = comm.sync_shared_state(state, revision)   # no-op (0 bytes) when all agree
        revision = info.revision
        g = comm.run_with_retry(comm.all_reduce, grads, op="avg")
        ...advance state deterministically...; revision += 1
"""
from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
import time

import numpy as np

from jaxodc.comm import shared_state as ss
from jaxodc.coord import protocol as P
from jaxodc.coord.protocol import ErrorKind, Msg

log = logging.getLogger("jaxodc.comm")


class CommError(RuntimeError):
    """A communicator operation failed."""


class CollectiveAborted(CommError):
    """An operation was aborted because a peer failed; retry after update_topology()."""


class TopologyStale(CommError):
    """The ring no longer matches the group (a peer left); call update_topology() and retry."""


class NotAccepted(CommError):
    """This peer is registered but not yet accepted into its group."""


class MasterUnavailable(CommError):
    """The connection to the coordination service is lost."""


RETRYABLE = (CollectiveAborted, TopologyStale)

_ERROR_KINDS = {ErrorKind.ABORTED: CollectiveAborted, ErrorKind.STALE: TopologyStale,
                ErrorKind.NOT_ACCEPTED: NotAccepted}


class _Waiter:
    __slots__ = ("event", "value")

    def __init__(self):
        self.event = threading.Event()
        self.value = None


class AllReduceHandle:
    """Result of all_reduce_async: ``wait()`` returns the reduced array or raises."""

    def __init__(self, comm: "Communicator", tag: int):
        self._comm, self.tag = comm, tag
        self._done = threading.Event()
        self._result = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> np.ndarray:
        t = self._comm.timeout_s * 4 if timeout_s is None else timeout_s
        if not self._done.wait(t):
            raise TimeoutError(f"peer {self._comm.peer_id}: all-reduce tag {self.tag} did not finish within {t} s")
        if self._error is not None:
            raise self._error
        return self._result


def _master_hint(host: str) -> str:
    """What to check when the coordination service at `host` cannot be reached."""
    from jaxodc.launch.address import is_loopback_host
    hint = "is `jaxodc master` (or the process hosting the service) running there?"
    if not is_loopback_host(host):
        hint += (f" From other hosts it must listen on an address they reach: start it with --host 0.0.0.0 or "
                 f"--host {host} (it listens on loopback unless --host)")
    return hint


def _bound_sends(sock: socket.socket, seconds: float) -> None:
    """A send to a service that stopped reading (SIGSTOPped, or a half-open connection whose
    buffers filled) fails after `seconds` instead of blocking every thread that sends."""
    sec = max(seconds, 0.001)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(sec), int(sec % 1 * 1e6)))
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: unacknowledged data fails the connection too
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(sec * 1000))


class Communicator:
    """One peer of a fault-tolerant group (see the module docstring for the loop every peer runs).

    Args:
      address: "host:port" of the coordination service. With host_master=True this peer runs the
        service itself (embedded, in a background thread) at that address ("host:0" picks a free
        port; None means "127.0.0.1:0"); the service then lives as long as this peer.
      peer_group: peers of one group share rings and shared state.
      secret: the group's shared secret (HMAC authentication of every connection).
      pool_size: connections per ring neighbour (concurrent all-reduces).
      heartbeat_s: interval of heartbeats to the service (a silent peer is declared dead).
      master_timeout_s: silence of the service after which this peer gives its connection up
        (MasterUnavailable; reconnect() registers again); also bounds a send to a service that
        stopped reading (SO_SNDTIMEO) and unacknowledged data (TCP_USER_TIMEOUT). Default
        max(10 * heartbeat_s, 2 s); match it to the service's heartbeat timeout.
      timeout_s: how long a request to the service may take.
      host: the address this peer listens on for ring and shared-state connections (default:
        $JAXODC_LOCAL_ADDR, else the address of this host that routes to the coordination service,
        loopback when the service is; jaxodc.launch.address).
      ring_timeout_s: how long a ring transfer may stall before it is aborted.
      host_master: run the coordination service in this process.
      master_heartbeat_timeout_s: the embedded service's dead-peer timeout.
      link: an emulated network (`jaxodc.odc.Link(mbps, ms)`) for this peer's outgoing ring
        links, set on every neighbour of each ring installed: how one machine stands in for sites
        joined by a slow WAN. Shared-state transfers are not shaped.
    """

    def __init__(self, address: str | None, peer_group: int = 0, secret: bytes = b"", pool_size: int = 2,
                 heartbeat_s: float = 0.5, timeout_s: float = 60.0, host: str | None = None,
                 ring_timeout_s: float = 10.0, host_master: bool = False,
                 master_heartbeat_timeout_s: float | None = None, link=None,
                 master_timeout_s: float | None = None):
        if isinstance(secret, str):
            secret = secret.encode()
        self.peer_group = int(peer_group)
        self.secret = secret
        self.pool_size = pool_size
        self.heartbeat_s = heartbeat_s
        self.master_timeout_s = float(master_timeout_s or max(10 * heartbeat_s, 2.0))
        self.timeout_s = timeout_s
        self.host = host
        self.ring_timeout_s = ring_timeout_s
        self.link = link
        self.master = None
        if host_master:
            from jaxodc.coord.service import CoordinatorService
            mh, mp = P.parse_address(address or f"{host or '127.0.0.1'}:0")
            self.master = CoordinatorService(mh, mp, secret, heartbeat_timeout_s=master_heartbeat_timeout_s
                                             or max(10 * heartbeat_s, 2.0)).start()
            address = self.master.address
        if address is None:
            raise ValueError("Communicator needs the service address (or host_master=True)")
        self.address = address
        if self.host is None:
            from jaxodc.launch.address import default_listen_host
            self.host = default_listen_host(address)
        self._send_lock = threading.Lock()
        self._rids = itertools.count(1)
        self._inflight_lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        """The state of a peer not yet connected."""
        self.peer_id: int | None = None
        self.ep = None
        self.ss_server: ss.SharedStateServer | None = None
        self._sock: socket.socket | None = None
        self._waiters: dict[int, _Waiter] = {}
        self._dead: str | None = None
        self._closed = threading.Event()
        self._last_recv = time.monotonic()
        self._threads: list[threading.Thread] = []
        self._inflight: dict[int, AllReduceHandle] = {}
        self._abort_count = 0
        self._abort_reason = ""
        self.accepted = False
        self._ring: list[str] = []
        self._rank = -1
        self._epoch = 0

    # --- properties -----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self._ring)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def ring(self) -> list[str]:
        return list(self._ring)

    def _who(self) -> str:
        return f"peer {self.peer_id} (group {self.peer_group}, rank {self._rank}/{len(self._ring)})"

    # --- connection -----------------------------------------------------------------------------

    def connect(self) -> "Communicator":
        from jaxodc.comm.ring import RingEndpoint
        self.ep = RingEndpoint(host=self.host, port=0, pool_size=self.pool_size, secret=self.secret,
                               timeout_s=self.ring_timeout_s, group_id=ss.job_of(self.peer_group))
        self.ss_server = ss.SharedStateServer(self.host, self.secret, timeout_s=self.timeout_s,
                                              job_id=ss.job_of(self.peer_group))
        host, port = P.parse_address(self.address)
        try:
            # bounded by master_timeout_s too: a peer registering again after a partition retries
            # soon after the heal instead of sitting out SYN backoff (up to timeout_s)
            sock = socket.create_connection((host, port), timeout=min(self.timeout_s, self.master_timeout_s))
        except OSError as e:
            self.close()
            raise MasterUnavailable(f"cannot reach the coordination service at {self.address}: {e}; "
                                    f"{_master_hint(host)}") from e
        try:
            w = P.client_handshake(sock, self.secret, {"group": self.peer_group, "ring_addr": self.ep.address,
                                                        "ss_addr": self.ss_server.address})
        except (P.ProtocolError, OSError) as e:
            sock.close()
            self.close()
            raise CommError(f"handshake with the coordination service at {self.address} failed: {e}") from e
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _bound_sends(sock, self.master_timeout_s)
        self._sock = sock
        self.peer_id = int(w["peer_id"])
        self._last_recv = time.monotonic()
        for target, name in ((self._reader, "reader"), (self._heartbeat, "heartbeat")):
            t = threading.Thread(target=target, name=f"jaxodc-comm-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("%s registered at %s (ring endpoint %s)", self._who(), self.address, self.ep.address)
        return self

    def close(self) -> None:
        self._closed.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []
        if self.ep is not None:
            self.ep.close()
            self.ep = None
        if self.ss_server is not None:
            self.ss_server.close()
            self.ss_server = None
        if self.master is not None:
            self.master.stop()
            self.master = None

    def reconnect(self) -> "Communicator":
        """Leaves the group, as if this peer had died, and registers again as a newcomer with a
        new peer id (an embedded service keeps running): how a peer backs out of an admission
        its partners did not share (jaxodc.optim.sites)."""
        master, self.master = self.master, None
        self.close()
        self.master = master
        self._reset()
        return self.connect()

    def __enter__(self):
        return self.connect() if self._sock is None else self

    def __exit__(self, *exc):
        self.close()

    def _send(self, obj: dict) -> None:
        if self._sock is None:
            raise CommError("Communicator is not connected: call connect() first")
        if self._dead:
            raise MasterUnavailable(f"{self._who()}: coordination service lost: {self._dead}")
        data = P.pack(obj)
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as e:
                self._mark_dead(f"send failed: {e}")
                raise MasterUnavailable(f"{self._who()}: coordination service lost: {e}") from e

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            if not self._closed.is_set():
                log.warning("%s: coordination service connection lost: %s", self._who(), reason)
        for w in list(self._waiters.values()):
            w.event.set()

    def _reader(self) -> None:
        try:
            while not self._closed.is_set():
                msg = P.recv_frame(self._sock)
                self._last_recv = time.monotonic()
                t = msg["t"]
                if t == Msg.REPLY:
                    w = self._waiters.pop(msg.get("rid"), None)
                    if w is not None:
                        w.value = msg
                        w.event.set()
                elif t == Msg.ABORT:
                    self._abort_reason = str(msg.get("reason"))
                    self._abort_count += 1
                    log.info("%s: abort from the service: %s", self._who(), msg.get("reason"))
                    if self.ep is not None:
                        self.ep.abort()
                elif t == Msg.MEASURE:
                    threading.Thread(target=self._measure, args=(msg,), daemon=True).start()
        except (OSError, ConnectionError, P.ProtocolError) as e:
            self._mark_dead(str(e) or type(e).__name__)
        finally:
            self._mark_dead("reader stopped")

    def _heartbeat(self) -> None:
        limit = self.master_timeout_s
        while not self._closed.wait(self.heartbeat_s):
            if self._dead:
                return
            try:
                self._send({"t": Msg.HEARTBEAT})
            except MasterUnavailable:
                return
            if time.monotonic() - self._last_recv > limit:
                self._mark_dead(f"no frame from the service for {limit:.1f} s")
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return

    def _measure(self, msg: dict) -> None:
        try:
            bw = float(self.ep.measure_bandwidth(msg["peer"], int(msg["nbytes"])))
            reply = {"t": Msg.MEASURED, "mid": msg["mid"], "ok": True, "bw": bw}
        except Exception as e:
            reply = {"t": Msg.MEASURED, "mid": msg["mid"], "ok": False, "reason": f"{type(e).__name__}: {e}"}
        try:
            self._send(reply)
        except MasterUnavailable:
            pass

    def _request(self, what: str, t: Msg, timeout_s: float | None = None, **fields) -> dict:
        rid = next(self._rids)
        w = _Waiter()
        self._waiters[rid] = w
        self._send({"t": t, "rid": rid, **fields})
        limit = self.timeout_s if timeout_s is None else timeout_s
        if not w.event.wait(limit):
            self._waiters.pop(rid, None)
            raise TimeoutError(f"{self._who()}: the service did not answer {what} within {limit} s "
                               f"(are all peers of group {self.peer_group} calling it?)")
        if w.value is None:
            raise MasterUnavailable(f"{self._who()}: coordination service lost during {what}: {self._dead}")
        r = w.value
        if not r.get("ok", False):
            cls = _ERROR_KINDS.get(r.get("kind"), CommError)
            raise cls(f"{self._who()}: {what} failed: {r.get('reason')}")
        return r

    def _await_inflight(self) -> None:
        """Major operations never overlap collectives: finish this peer's async ones first."""
        with self._inflight_lock:
            handles = list(self._inflight.values())
        for h in handles:
            if not h._done.wait(self.timeout_s * 4):
                raise TimeoutError(f"{self._who()}: all-reduce tag {h.tag} still in flight after "
                                   f"{self.timeout_s * 4:.0f} s; a membership or topology operation waits for it")

    # --- membership and topology ----------------------------------------------------------------

    def are_peers_pending(self) -> bool:
        """Consensus: the same answer at every accepted peer of the group; may overlap collectives."""
        return bool(self._request("are_peers_pending", Msg.PENDING)["pending"])

    def update_topology(self, accept_new: bool = True, timeout_s: float | None = None, found: bool = True) -> None:
        """Vote (accept_new) on pending peers and install the group's ring when it changed.

        A registered (new) peer blocks here until the accepted peers vote it in; with found=False
        it never founds an empty group itself (it waits for a founder: a peer joining a running
        job). A failure while the ring connects is retried at a new epoch; newcomers admitted by
        then stay admitted."""
        self._await_inflight()
        attempts = 0
        while True:
            attempts += 1
            try:
                r = self._request("update_topology", Msg.TOPO, timeout_s=timeout_s, accept_new=accept_new,
                                  found=found)
                self.accepted = True
                if r["changed"]:
                    self._install_ring(r)
                else:
                    self._ring, self._rank, self._epoch = list(r["ring"]), int(r["rank"]), int(r["epoch"])
                return
            except RETRYABLE as e:
                if attempts >= 20:
                    raise
                log.info("%s: update_topology retry %d after: %s", self._who(), attempts, e)
                accept_new = False  # anyone admitted in the failed round already is

    def _install_ring(self, r: dict) -> None:
        ring, rank, epoch = list(r["ring"]), int(r["rank"]), int(r["epoch"])
        ok, reason = True, None
        try:
            if self.link is not None:
                for peer in ring:
                    if peer != self.ep.address:
                        self.ep.set_link(peer, self.link.mbps * 1e6 / 8 or None, self.link.ms / 1e3)
            if len(ring) > 1:
                self.ep.connect_ring(ring, rank, epoch)
        except Exception as e:
            ok, reason = False, f"{type(e).__name__}: {e}"
            log.info("%s: connecting ring epoch %d failed: %s", self._who(), epoch, reason)
        self._request(f"ring connect (epoch {epoch})", Msg.TOPO_DONE, op=r["op"], ok=ok, reason=reason)
        self._ring, self._rank, self._epoch = ring, rank, epoch

    def optimize_topology(self, nbytes: int | None = None) -> dict:
        """Measure every directed link of the group (one at a time), solve the ring ATSP at the
        service, and return {improved, ring, bottleneck, previous_bottleneck, peers, bandwidth}.
        An improved ring is installed at the next update_topology."""
        self._await_inflight()
        r = self._request("optimize_topology", Msg.OPTIMIZE, timeout_s=self.timeout_s * 4, nbytes=nbytes)
        return {k: r[k] for k in ("improved", "ring", "bottleneck", "previous_bottleneck", "peers", "bandwidth")}

    # --- collectives ----------------------------------------------------------------------------

    def all_reduce(self, x, op: str = "sum", quantize: str | None = None, tag: int = 0, out=None) -> np.ndarray:
        """`all_reduce_async(...).wait()`: the reduced array, or CollectiveAborted."""
        return self.all_reduce_async(x, op=op, quantize=quantize, tag=tag, out=out).wait()

    def all_reduce_async(self, x, op: str = "sum", quantize: str | None = None, tag: int = 0,
                         out=None) -> AllReduceHandle:
        """All-reduce x over the group, in a background thread.

        x is never modified; the result goes to a fresh array, or to ``out`` (which may be x
        itself) only after every peer closed the operation, so a failure at any point leaves the
        caller's buffers as they were.

        Args:
          x: a numpy array, the same shape and dtype on every peer.
          op: "sum", "avg", "min" or "max".
          quantize: None, "uint8" or "uint16" (the owner of each chunk quantises once; every peer ends
            bit-identical).
          tag: concurrent operations need distinct tags, issued in the same order on every peer.
          out: an optional destination array.

        Returns:
          An AllReduceHandle; `wait()` gives the result or raises CollectiveAborted.
        """
        tag = int(tag)
        x = np.asarray(x)
        if out is not None and (not isinstance(out, np.ndarray) or out.shape != x.shape or out.dtype != x.dtype):
            raise ValueError(f"{self._who()}: out must be an ndarray of shape {x.shape} and dtype {x.dtype}")
        h = AllReduceHandle(self, tag)
        with self._inflight_lock:
            if tag in self._inflight:
                raise CommError(f"{self._who()}: all-reduce tag {tag} is already in flight")
            self._inflight[tag] = h

        def run():
            try:
                h._result = self._all_reduce(x, op, quantize, tag, out)
            except BaseException as e:
                h._error = e
            finally:
                with self._inflight_lock:
                    self._inflight.pop(tag, None)
                h._done.set()

        h._thread = threading.Thread(target=run, name=f"jaxodc-allreduce-{tag}", daemon=True)
        h._thread.start()
        return h

    def _all_reduce(self, x: np.ndarray, op: str, quantize, tag: int, out) -> np.ndarray:
        from jaxodc.comm.ring import RingAborted
        what = f"all-reduce tag {tag} ({x.dtype}{list(x.shape)}, {op})"
        r = self._request(f"open {what}", Msg.OPEN, tag=tag, epoch=self._epoch, nbytes=int(x.nbytes))
        aborts = self._abort_count
        src = np.ascontiguousarray(x)
        res = np.empty_like(src)
        try:
            if len(self._ring) > 1:
                self.ep.all_reduce(src, op=op, quantize=quantize, tag=tag, out=res)
            else:
                np.copyto(res, src)
            err = None
        except RingAborted as e:
            err = e
        except Exception as e:  # connection errors, timeouts: a local failure the group must hear of
            err = e
        if err is not None:
            if self._abort_count == aborts:  # local failure: tell the service so everyone aborts
                try:
                    self._request(f"close {what}", Msg.CLOSE, tag=tag, op=r["op"], ok=False,
                                  reason=f"{type(err).__name__}: {err}")
                except (CommError, TimeoutError):
                    pass
            why = (f"aborted by the service ({self._abort_reason})" if self._abort_count != aborts
                   else f"{type(err).__name__}: {err}")
            raise CollectiveAborted(f"{self._who()}: {what} failed: {why}") from err
        self._request(f"close {what}", Msg.CLOSE, tag=tag, op=r["op"], ok=True)
        if out is not None:
            np.copyto(out, res)
            return out
        return res

    def run_with_retry(self, fn, *args, max_attempts: int = 20, **kwargs):
        """Run fn(*args, **kwargs); after an abort (peer failure, stale ring) re-form the ring
        without the failed peers (update_topology, no new admissions) and run it again."""
        for attempt in range(1, max_attempts + 1):
            try:
                return fn(*args, **kwargs)
            except RETRYABLE as e:
                if attempt == max_attempts:
                    raise
                log.info("%s: attempt %d failed (%s); re-forming the ring", self._who(), attempt, e)
                self.update_topology(accept_new=False)

    # --- shared state ---------------------------------------------------------------------------

    def sync_shared_state(self, state: dict, revision: int, strategy: str = "enforce_popular") -> ss.SyncInfo:
        """Make this peer's state bit-identical to the group's popular state.

        ``revision`` must be exactly one ahead of the group's last synced revision (a peer that
        is behind, e.g. a newcomer, receives the popular state and revision; one that skips ahead
        is rejected: its content does not count and the reason is logged and returned). Only
        keys whose hash differs are fetched, directly from peers that hold the popular content.
        Arrays are updated in place where shape and dtype match, else the dict entry is replaced."""
        if strategy not in ss.STRATEGIES:
            raise ValueError(f"strategy must be one of {ss.STRATEGIES}, got {strategy!r}")
        self._await_inflight()
        hashes = ss.state_hashes(state)
        self.ss_server.publish(None, state)
        fetched: dict[str, np.ndarray] = {}
        nrecv = 0
        try:
            r = self._request(f"shared-state sync (revision {revision})", Msg.SYNC, revision=int(revision),
                              hashes=hashes, strategy=strategy)
            if r.get("rejected"):
                log.warning("%s: shared-state sync: %s", self._who(), r["rejected"])
            if r.get("extra"):
                log.warning("%s: keys not in the popular state (left as they are): %s", self._who(), r["extra"][:8])
            ok, reason = True, None
            try:
                fetched, nrecv = self._fetch(r["fetch"], {k: int(h) for k, h in r["expected"].items()}, r["op"])
            except Exception as e:
                ok, reason = False, f"{type(e).__name__}: {e}"
            self._request(f"shared-state sync completion (revision {revision})", Msg.SYNC_DONE,
                          op=r["op"], ok=ok, reason=reason)
            if not ok:
                raise CollectiveAborted(f"{self._who()}: shared-state fetch failed: {reason}")
        finally:
            nsent = self.ss_server.retract()
        for k, a in fetched.items():
            cur = state.get(k)
            if isinstance(cur, np.ndarray) and cur.flags.writeable and cur.shape == a.shape and cur.dtype == a.dtype:
                np.copyto(cur, a)
            else:
                state[k] = a
        popular = {k: int(h) for k, h in r["popular"]}
        adopt = r["adopt"]
        return ss.SyncInfo(bytes_sent=nsent, bytes_received=nrecv, keys_fetched=sorted(fetched),
                           hash=ss.combined_hash(popular if adopt else hashes),
                           revision=int(r["revision"]) if adopt else int(revision),
                           rejected=r.get("rejected"))

    def _fetch(self, plan: dict, expected: dict, op_id) -> tuple[dict, int]:
        """Fetch keys grouped by their first source; on a failed source try the next one."""
        from jaxodc.comm.hashing import hash_array
        out, total = {}, 0
        todo = {k: list(srcs) for k, srcs in plan.items()}
        while todo:
            by_src: dict[str, list[str]] = {}
            for k, srcs in todo.items():
                if not srcs:
                    raise ConnectionError(f"no live source left for key {k!r}")
                by_src.setdefault(srcs[0], []).append(k)
            for src, keys in by_src.items():
                try:
                    got, n = ss.fetch_keys(src, self.secret, op_id, keys, self.timeout_s,
                                           ss.job_of(self.peer_group), self.peer_id)
                except (OSError, ConnectionError, P.ProtocolError) as e:
                    log.info("%s: fetching %d keys from %s failed (%s); trying another holder",
                             self._who(), len(keys), src, e)
                    for k in keys:
                        todo[k].pop(0)
                    continue
                for k, a in got.items():
                    h = int(hash_array(a))
                    if h != expected[k]:
                        raise CommError(f"{self._who()}: key {k!r} from {src} hashes to {h:#x}, "
                                        f"the popular hash is {expected[k]:#x}")
                    out[k] = a
                    del todo[k]
                total += n
        return out, total
