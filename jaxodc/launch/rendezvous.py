"""Key-value rendezvous service used to bootstrap a job: rank 0 hosts a `RendezvousServer`, every
rank talks to it through a `RendezvousClient`.

Every connection starts with the job's challenge-response (`jaxodc.auth`, listener
``"rendezvous"``): the server learns the client's rank from it, and a request naming another rank
is refused. Then the framing of `jaxodc.coord.protocol` (a 4-byte big-endian length, then a msgpack
map), without its message type; a length above `MAX_FRAME` drops the connection, and a frame's
memory grows only as its bytes arrive, so an announced length costs nothing by itself. The server
holds at most ``max_connections`` connections; `close` wakes every blocked read and wait. One request is in flight per connection; the server answers every
request with one frame: ``{"ok": True, ...}`` or ``{"ok": False, "error": kind, "msg": text}``.

Requests:
  ``{"op": "hello", "rank": r}``                                  -> ok
  ``{"op": "set", "key": k, "value": b}``                          -> ok
  ``{"op": "get", "key": k, "timeout": s}``                        -> ``{"value": b}`` once k is set
  ``{"op": "collect", "name": n, "gen": g, "rank": r, "world": w, "value": b, "timeout": s}``
      -> ``{"values": [b_0, ..., b_{w-1}]}`` once all w ranks contributed to (n, g)

Blocking requests wait on a condition variable inside the server (no client polling); the wait
ends after the client's timeout and the client raises `TimeoutError`.

Name reuse: `allgather` / `barrier` may be called repeatedly with the same name. Each client counts
its calls per name (a generation), so the k-th call of a name on every rank meets the k-th call on
every other rank. Every rank must therefore make the same sequence of calls for a given name. A
finished round is deleted from the server once all ranks have received their answer, so repeated
barriers do not grow the server's memory.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from jaxodc import auth
from jaxodc.coord import protocol as P

__all__ = ["RendezvousServer", "RendezvousClient", "RendezvousError", "MAX_FRAME"]

log = logging.getLogger(__name__)

# The rendezvous carries small metadata (peer addresses, records); a longer frame is garbage.
MAX_FRAME = 64 << 20
MAX_WORLD = 1 << 16  # ranks a server admits when not told its world
LISTENER = "rendezvous"
# Extra seconds the client waits on the socket beyond a server-side wait, so the server's
# timeout reply (which names the key) arrives before the socket gives up.
_REPLY_MARGIN_S = 5.0


class RendezvousError(RuntimeError):
    """The server rejected a request (e.g. mismatched world size) or the connection was lost."""


class _Round:
    """One generation of an allgather: contributions by rank, and how many ranks were answered."""

    __slots__ = ("world", "values", "answered")

    def __init__(self, world: int):
        self.world = world
        self.values: dict[int, bytes] = {}
        self.answered = 0


class RendezvousServer:
    """Threaded TCP key-value server. Starts serving in a daemon thread on construction.

    Args:
        secret, job_id: what a client must prove (`jaxodc.auth`); an empty secret only on loopback.
        world: ranks admitted (0 .. world-1).
        max_connections: connections held at once; one more is closed on accept.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes = b"",
                 job_id: str = "", world: int = MAX_WORLD, max_connections: int = 256):
        auth.require_secret_for_bind(secret, host, "rendezvous server")
        self.secret, self.job_id, self.world = secret, job_id, int(world)
        # create_server sets SO_REUSEADDR, so a port just probed free by a launcher binds.
        self._sock = socket.create_server((host, port), backlog=128)
        bound_port = self._sock.getsockname()[1]
        self.host = host
        self.port = bound_port
        self.address = f"{host}:{bound_port}"
        self._cond = threading.Condition()
        self._kv: dict[str, bytes] = {}
        self._rounds: dict[tuple[str, int], _Round] = {}
        self._closed = False
        self._refusals = auth.Refusals(f"rendezvous {self.address}", self._cond, max_connections, log)
        self._ranks: set[socket.socket] = set()  # the authenticated connections
        self.requests = 0  # requests answered so far (lets tests see that waits are server-side)
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"rendezvous-accept-{bound_port}", daemon=True
        )
        self._thread.start()

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, drop every connection and wake every blocked request."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            conns = list(self._refusals.conns)
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5.0)

    @property
    def num_connections(self) -> int:
        with self._cond:
            return len(self._refusals.conns)

    @property
    def num_authenticated(self) -> int:
        """Connections past the handshake (what wait_for_disconnects waits on)."""
        with self._cond:
            return len(self._ranks)

    @property
    def refused(self) -> int:
        """Connections dropped: failed handshake, over the limit, broken frames."""
        return self._refusals.count

    def wait_for_disconnects(self, timeout_s: float) -> bool:
        """Wait until every authenticated client has hung up (True) or timeout_s passed (False);
        connections still in (or refused by) the handshake do not hold a rank's shutdown."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                if not self._ranks:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def __enter__(self) -> "RendezvousServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- serving ----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # listening socket closed
            if not self._refusals.admit(conn, peer, closing=lambda: self._closed):
                continue  # refused, or closed: the next accept fails
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve_conn, args=(conn, peer), name=f"rendezvous-conn-{peer}",
                daemon=True,
            ).start()

    def _serve_conn(self, conn: socket.socket, peer) -> None:
        try:
            try:
                rank = auth.server_handshake(conn, self.secret, LISTENER, self.job_id, self.world,
                                             what=f"rendezvous {self.address}")
            except auth.AuthError as e:
                self._refusals.refused(peer, e)
                return
            who = f"rank {rank} ({peer[0]}:{peer[1]})"
            with self._cond:
                self._ranks.add(conn)
            while True:
                try:
                    msg = P.recv_frame(conn, MAX_FRAME, typed=False)
                    claimed = msg.get("rank", rank)
                    if claimed != rank:
                        raise P.ProtocolError(f"request names rank {claimed!r}, authenticated as {rank}")
                    reply = self._handle(msg)
                except P.ProtocolError as e:
                    self._refusals.dropped(who, e)
                    return
                with self._cond:
                    self.requests += 1
                P.send_frame(conn, reply)
        except OSError:
            return  # peer hung up (P.ConnectionClosed) or server closed
        finally:
            with self._cond:
                self._refusals.conns.discard(conn)
                self._ranks.discard(conn)
            conn.close()

    def _handle(self, msg: dict) -> dict:
        op = msg.get("op")
        try:
            if op == "hello":
                return {"ok": True}
            if op == "set":
                key, value = msg["key"], msg["value"]
                if not isinstance(key, str) or not isinstance(value, bytes):
                    raise P.ProtocolError("set needs a str key and a bytes value")
                with self._cond:
                    self._kv[key] = value
                    self._cond.notify_all()
                return {"ok": True}
            if op == "get":
                key, timeout = msg["key"], float(msg["timeout"])
                if not isinstance(key, str):
                    raise P.ProtocolError("get needs a str key")
                return self._get(key, timeout)
            if op == "collect":
                return self._collect(
                    str(msg["name"]), int(msg["gen"]), int(msg["rank"]), int(msg["world"]),
                    msg["value"], float(msg["timeout"]),
                )
        except (KeyError, TypeError, ValueError) as e:
            raise P.ProtocolError(f"malformed {op!r} request: {e!r}") from None
        raise P.ProtocolError(f"unknown op {op!r}")

    def _wait(self, pred, timeout: float) -> bool:
        """Wait on the condition (held by the caller) until pred() or timeout or close."""
        deadline = time.monotonic() + max(0.0, timeout)
        while not pred():
            if self._closed:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)
        return True

    def _get(self, key: str, timeout: float) -> dict:
        with self._cond:
            if self._wait(lambda: key in self._kv, timeout):
                return {"ok": True, "value": self._kv[key]}
            return self._fail_wait(f"key {key!r} was not set within {timeout:g} s")

    def _fail_wait(self, what: str) -> dict:
        if self._closed:
            return {"ok": False, "error": "closed", "msg": "rendezvous server is shutting down"}
        return {"ok": False, "error": "timeout", "msg": what}

    def _collect(self, name: str, gen: int, rank: int, world: int, value, timeout: float) -> dict:
        if not isinstance(value, bytes):
            raise P.ProtocolError("collect needs a bytes value")
        if world < 1 or not 0 <= rank < world:
            return {"ok": False, "error": "invalid",
                    "msg": f"rank {rank} is outside world size {world} in {name!r}"}
        key = (name, gen)
        with self._cond:
            rnd = self._rounds.get(key)
            if rnd is None:
                rnd = self._rounds[key] = _Round(world)
            if rnd.world != world:
                return {"ok": False, "error": "invalid",
                        "msg": f"rank {rank} called {name!r} (round {gen}) with world size {world},"
                               f" another rank with {rnd.world}"}
            if rank in rnd.values:
                return {"ok": False, "error": "invalid",
                        "msg": f"rank {rank} contributed twice to {name!r} (round {gen})"}
            rnd.values[rank] = value
            self._cond.notify_all()
            if not self._wait(lambda: len(rnd.values) == world, timeout):
                missing = sorted(set(range(world)) - set(rnd.values))
                return self._fail_wait(
                    f"{name!r} (round {gen}) incomplete after {timeout:g} s: ranks {missing} of "
                    f"{world} have not arrived")
            values = [rnd.values[r] for r in range(world)]
            rnd.answered += 1
            if rnd.answered == world:
                del self._rounds[key]  # everyone has its answer: free the round
            return {"ok": True, "values": values}


class RendezvousClient:
    """Client of a `RendezvousServer`. Thread-safe (requests on one client are serialised)."""

    def __init__(self, address: str, rank: int, timeout_s: float = 60.0, *, secret: bytes = b"",
                 job_id: str = ""):
        self.address = address
        self.rank = int(rank)
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._gens: dict[str, int] = {}  # allgather/barrier rounds used per name
        self._gen_lock = threading.Lock()
        host, port = P.parse_address(address, "rendezvous address")
        deadline = time.monotonic() + self.timeout_s
        delay, last = 0.02, None
        # The server may not be up yet (rank 0 still starting): retry until the timeout.
        while True:
            try:
                self._sock = socket.create_connection(
                    (host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except OSError as e:
                last = e
            if time.monotonic() + delay > deadline:
                raise TimeoutError(
                    f"rendezvous: rank {self.rank} could not connect to {address} within "
                    f"{self.timeout_s:g} s (last error: {last})")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            auth.client_handshake(self._sock, secret, LISTENER, job_id, self.rank,
                                  timeout_s=max(1.0, deadline - time.monotonic()),
                                  what=f"rendezvous: rank {self.rank} at {address}")
        except auth.AuthError as e:
            self._sock.close()
            raise RendezvousError(f"{e}; every rank needs the job's secret (${auth.SECRET_ENV} "
                                  f"or ${auth.SECRET_FILE_ENV}, set by jaxodc launch)") from None
        self._request({"op": "hello", "rank": self.rank}, self.timeout_s, "hello")

    def _request(self, msg: dict, wait_s: float, what: str) -> dict:
        with self._lock:
            if self._sock is None:
                raise RendezvousError(f"rendezvous: rank {self.rank} client is closed ({what})")
            try:
                self._sock.settimeout(wait_s + _REPLY_MARGIN_S)
                P.send_frame(self._sock, msg)
                reply = P.recv_frame(self._sock, MAX_FRAME, typed=False)
            except socket.timeout:
                self._drop()  # a late reply would be read as the answer to the next request
                raise TimeoutError(
                    f"rendezvous: rank {self.rank} got no reply from {self.address} for {what} "
                    f"within {wait_s + _REPLY_MARGIN_S:g} s") from None
            except P.ConnectionClosed:
                self._drop()
                raise RendezvousError(
                    f"rendezvous: rank {self.rank}: server {self.address} closed the connection "
                    f"during {what}") from None
            except (OSError, P.ProtocolError) as e:
                self._drop()
                raise RendezvousError(
                    f"rendezvous: rank {self.rank} lost the connection to {self.address} during "
                    f"{what}: {e}") from None
        if not reply.get("ok"):
            text = f"rendezvous: rank {self.rank}: {what}: {reply.get('msg')}"
            if reply.get("error") == "timeout":
                raise TimeoutError(text)
            raise RendezvousError(text)
        return reply

    def _drop(self) -> None:
        """Close a connection whose request/reply pairing can no longer be trusted (lock held)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else float(timeout_s)

    def set(self, key: str, value: bytes) -> None:
        """Store value under key (overwrites) and wake every rank waiting on it."""
        self._request({"op": "set", "key": str(key), "value": bytes(value)}, self.timeout_s,
                      f"set {key!r}")

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """Value of key, waiting (server-side) until some rank sets it."""
        t = self._timeout(timeout_s)
        return self._request({"op": "get", "key": str(key), "timeout": t}, t,
                             f"get {key!r}")["value"]

    def allgather(self, name: str, value: bytes, world: int,
                  timeout_s: float | None = None) -> list[bytes]:
        """Every rank's value for this round of `name`, indexed by rank."""
        t = self._timeout(timeout_s)
        with self._gen_lock:
            gen = self._gens.get(name, 0)
            self._gens[name] = gen + 1
        reply = self._request(
            {"op": "collect", "name": str(name), "gen": gen, "rank": self.rank, "world": int(world),
             "value": bytes(value), "timeout": t},
            t, f"allgather {name!r} (round {gen}, world {world})")
        return list(reply["values"])

    def barrier(self, name: str, world: int, timeout_s: float | None = None) -> None:
        """Return once all `world` ranks reached this round of barrier `name`."""
        self.allgather("barrier/" + name, b"", world, timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> "RendezvousClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
