"""Shared state: per-key hashes, the sync result record, and the peer-to-peer key server.

Outdated peers fetch only the keys whose hash differs from the popular one, directly from a peer
that holds them (this server), never through the coordination service. Every connection starts
with the job's challenge-response (`jaxodc.auth`, listener ``"shared_state"``, the group as job id,
the fetcher's peer id as rank); request frames are bounded by `protocol.MAX_FRAME`, connections by
``max_connections``, and the server serves only while a sync is open.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import socket
import threading

import numpy as np

from jaxodc import auth
from jaxodc.coord import protocol as P
from jaxodc.coord.protocol import Msg

log = logging.getLogger("jaxodc.comm.shared_state")

STRATEGIES = tuple(s.value for s in P.Strategy)
LISTENER = "shared_state"
MAX_PEER_ID = 1 << 20  # peer ids a server admits (the service numbers peers from 0 as they join)


def job_of(group: int) -> str:
    """The job id a group's shared-state connections authenticate under."""
    return f"group{int(group)}"


@dataclasses.dataclass
class SyncInfo:
    """What one sync_shared_state call did on this peer."""
    bytes_sent: int          # bytes this peer served to outdated peers during the sync
    bytes_received: int      # bytes this peer fetched
    keys_fetched: list[str]  # keys replaced by the popular content
    hash: int                # combined hash of the state after the sync (the popular one)
    revision: int = 0        # revision this peer holds after the sync
    rejected: str | None = None  # why this peer's submission was not eligible, if it was not


def _dtype_name(dt: np.dtype) -> str:
    return dt.name if dt.name in ("bfloat16",) else dt.str


def _dtype_from(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # shipped with jax
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def as_array(v) -> np.ndarray:
    a = np.asarray(v)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def state_hashes(state: dict) -> dict[str, int]:
    """Deterministic per-key content hash (the native parallel hash)."""
    from jaxodc.comm.hashing import hash_state
    if not all(isinstance(k, str) for k in state):
        raise TypeError("shared-state keys must be strings")
    arrs = {k: as_array(v) for k, v in state.items()}
    return {k: int(h) for k, h in hash_state(arrs).items()}


def combined_hash(hashes: dict[str, int]) -> int:
    """One 64-bit value for a whole state: blake2b over the sorted (key, hash) pairs."""
    h = hashlib.blake2b(digest_size=8)
    for k in sorted(hashes):
        h.update(k.encode())
        h.update(b"\0")
        h.update(int(hashes[k]).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


class SharedStateServer:
    """Threaded TCP server that hands out arrays of the state published for the open sync."""

    def __init__(self, host: str, secret: bytes, timeout_s: float = 30.0, job_id: str = "",
                 max_connections: int = 256):
        auth.require_secret_for_bind(secret, host, "shared-state server")
        self.secret = secret
        self.job_id = job_id
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._state: dict[str, np.ndarray] | None = None
        self._sync_id = None
        self.bytes_sent = 0
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._closed = threading.Event()
        self._refusals = auth.Refusals(f"shared-state server {self.address}", self._lock, max_connections, log)
        self._thread = threading.Thread(target=self._accept_loop, name="jaxodc-ss-server", daemon=True)
        self._thread.start()

    def publish(self, sync_id, state: dict) -> None:
        with self._lock:
            self._state = {k: as_array(v) for k, v in state.items()}
            self._sync_id = sync_id
            self.bytes_sent = 0

    def retract(self) -> int:
        """Stop serving; returns the bytes served since publish."""
        with self._lock:
            self._state, self._sync_id = None, None
            return self.bytes_sent

    @property
    def refused(self) -> int:
        """Connections dropped: failed handshake, over the limit, broken frames."""
        return self._refusals.count

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._refusals.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            conn.settimeout(self.timeout_s)
            if not self._refusals.admit(conn, addr):
                continue
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name="jaxodc-ss-conn").start()

    def _serve(self, conn: socket.socket, addr) -> None:
        try:
            try:
                peer = auth.server_handshake(conn, self.secret, LISTENER, self.job_id, MAX_PEER_ID,
                                             timeout_s=min(10.0, self.timeout_s),
                                             what=f"shared-state server {self.address}")
            except auth.AuthError as e:
                self._refusals.refused(addr, e)
                return
            addr = f"peer {peer} ({addr[0]}:{addr[1]})"
            while not self._closed.is_set():
                req = P.recv_frame(conn)
                if req.get("t") != Msg.GET or not isinstance(req.get("keys"), list):
                    log.warning("shared-state server %s: dropped frame of type %r from %s",
                                self.address, req.get("t"), addr)
                    continue
                self._send_keys(conn, req)
        except P.ProtocolError as e:
            self._refusals.dropped(addr, e)
        except (ConnectionError, OSError):
            pass
        finally:
            self._refusals.release(conn)
            conn.close()

    def _send_keys(self, conn: socket.socket, req: dict) -> None:
        with self._lock:
            state = self._state
        # The sync id is only known after the service's answer, and a fast fetcher may ask before
        # this peer has read it: serve whatever is published; the fetcher checks every hash.
        if state is None:
            P.send_frame(conn, P.refusal(f"no shared state published (sync {req.get('sync')!r})"))
            return
        missing = [k for k in req["keys"] if k not in state]
        if missing:
            P.send_frame(conn, P.refusal(f"keys not held here: {missing[:5]}"))
            return
        for k in req["keys"]:
            a = state[k]
            P.send_frame(conn, {"t": Msg.ARRAY, "key": k, "dtype": _dtype_name(a.dtype),
                                "shape": list(a.shape), "nbytes": a.nbytes})
            if a.nbytes:
                conn.sendall(memoryview(a.reshape(-1).view(np.uint8)))
            with self._lock:
                self.bytes_sent += a.nbytes


def fetch_keys(address: str, secret: bytes, sync_id, keys: list[str], timeout_s: float, job_id: str = "",
               peer_id: int = 0) -> tuple[dict, int]:
    """Fetch arrays from a peer's SharedStateServer, authenticating as `peer_id` of `job_id`;
    returns ({key: array}, bytes received)."""
    host, port = P.parse_address(address)
    out, nbytes = {}, 0
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        auth.client_handshake(s, secret, LISTENER, job_id, peer_id, timeout_s=timeout_s,
                              what=f"shared-state fetch from {address}")
        P.send_frame(s, {"t": Msg.GET, "sync": sync_id, "keys": list(keys)})
        for k in keys:
            head = P.recv_frame(s)
            if head.get("t") == Msg.ERROR:
                raise ConnectionError(f"peer {address} refused key {k!r}: {head.get('reason')}")
            if head.get("t") != Msg.ARRAY or head.get("key") != k:
                raise P.ProtocolError(f"peer {address} answered {head.get('t')!r}/{head.get('key')!r} for key {k!r}")
            a = np.empty(tuple(head["shape"]), dtype=_dtype_from(head["dtype"]))
            if a.nbytes != head["nbytes"]:
                raise P.ProtocolError(f"peer {address}: key {k!r} announces {head['nbytes']} bytes, "
                                      f"shape {head['shape']} {head['dtype']} holds {a.nbytes}")
            if a.nbytes:
                P.recv_exact(s, a.nbytes, memoryview(a.reshape(-1).view(np.uint8)))
            out[k] = a
            nbytes += a.nbytes
    return out, nbytes
