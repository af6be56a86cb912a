"""The job secret and the challenge-response every jaxodc listener runs before it trusts a peer.

One binary handshake (``jaxodc-auth-v2``) serves every socket of a job; the C++ listeners
(`csrc/common/auth.*`) implement the same bytes and are checked against the same test vectors
(`tests/support/auth_vectors.json`)::

    server -> client   b"JXA2" + nonce_s                         (4 + 32 bytes)
    client -> server   nonce_c + rank (u32 little endian) + tag_c  (32 + 4 + 32 bytes)
    server -> client   tag_s                                      (32 bytes), only if tag_c is right

    tag_<role> = HMAC-SHA256(secret, b"jaxodc-auth-v2|" + role + b"|" + listener + b"|" + job_id
                             + b"|" + str(rank) + b"|" + nonce_s + nonce_c)

``role`` is ``client`` or ``server``; ``listener`` names the kind of socket (`LISTENERS`), so a
transcript recorded at one listener cannot be replayed at another, and the claimed rank and the
job id are bound into both tags. Fresh nonces on both sides defeat replays; the secret never
travels. A server that rejects a tag closes the connection without an answer.

The secret is made by the launcher per job (`new_secret`) and reaches ranks through the
environment (`SECRET_ENV`, hex) or a file (`SECRET_FILE_ENV`, `--secret-file`), never argv.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import struct
import time

__all__ = [
    "AuthError", "MAGIC", "NONCE_BYTES", "TAG_BYTES", "LISTENERS", "SECRET_ENV", "SECRET_FILE_ENV",
    "new_secret", "read_secret_file", "secret_from_env", "tag", "client_handshake",
    "server_handshake", "is_loopback", "require_secret_for_bind", "Refusals",
]

MAGIC = b"JXA2"
NONCE_BYTES = 32
TAG_BYTES = 32
SECRET_BYTES = 32
SECRET_ENV = "JAXODC_JOB_SECRET"
SECRET_FILE_ENV = "JAXODC_SECRET_FILE"
LISTENERS = ("odc_tcp", "lockstep_tcp", "ring", "shared_state", "coord", "rendezvous")
_MAX_RANK = 1 << 20


class AuthError(ConnectionError):
    """A peer failed (or refused) the challenge-response."""


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def read_secret_file(path: str) -> bytes:
    """The secret in `path`: its bytes with surrounding whitespace stripped; empty is refused."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16).strip()
    except OSError as e:
        raise AuthError(f"cannot read secret file {path}: {e.strerror}") from None
    if not data:
        raise AuthError(f"secret file {path} is empty; put at least 16 random bytes in it")
    return data


def secret_from_env(environ=None) -> bytes:
    """The job secret the launcher handed this process (b"" when none was given)."""
    env = os.environ if environ is None else environ
    if env.get(SECRET_ENV):
        try:
            return bytes.fromhex(env[SECRET_ENV])
        except ValueError:
            raise AuthError(f"{SECRET_ENV} is not hex") from None
    if env.get(SECRET_FILE_ENV):
        return read_secret_file(env[SECRET_FILE_ENV])
    return b""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_secret_for_bind(secret: bytes, host: str, what: str) -> None:
    """An empty secret is allowed only on loopback binds."""
    if not secret and not is_loopback(host):
        raise AuthError(f"{what}: refusing to listen on {host or 'every interface'} without a secret; "
                        f"give one (--secret-file, or ${SECRET_ENV}) or bind 127.0.0.1")


def _check(listener: str, job_id: str, rank: int) -> None:
    if listener not in LISTENERS:
        raise ValueError(f"unknown listener {listener!r}; one of {LISTENERS}")
    if not 0 <= rank < _MAX_RANK:
        raise ValueError(f"rank {rank} out of range")
    if "|" in job_id:
        raise ValueError(f"job id {job_id!r} may not contain '|'")


def tag(secret: bytes, role: str, listener: str, job_id: str, rank: int, nonce_s: bytes,
        nonce_c: bytes) -> bytes:
    if role not in ("client", "server"):
        raise ValueError(f"role {role!r}")
    _check(listener, job_id, rank)
    msg = b"|".join([b"jaxodc-auth-v2", role.encode(), listener.encode(), job_id.encode(),
                     str(rank).encode(), nonce_s + nonce_c])
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuthError(f"{what}: timed out waiting for {n - len(buf)} more handshake bytes")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            continue
        if not chunk:
            raise AuthError(f"{what}: connection closed during the handshake")
        buf += chunk
    return bytes(buf)


def client_handshake(sock: socket.socket, secret: bytes, listener: str, job_id: str, rank: int,
                     timeout_s: float = 10.0, what: str = "handshake") -> None:
    """Prove the secret to the server as `rank`, and check the server's proof."""
    _check(listener, job_id, rank)
    deadline = time.monotonic() + timeout_s
    old = sock.gettimeout()
    try:
        hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline, what)
        if hello[:4] != MAGIC:
            raise AuthError(f"{what}: peer is not a jaxodc-auth-v2 listener")
        ns, nc = hello[4:], os.urandom(NONCE_BYTES)
        sock.sendall(nc + struct.pack("<I", rank) + tag(secret, "client", listener, job_id, rank, ns, nc))
        try:
            proof = _recv_exact(sock, TAG_BYTES, deadline, what)
        except AuthError as e:
            raise AuthError(f"{what}: refused by the server (wrong secret or job?): {e}") from None
        if not hmac.compare_digest(proof, tag(secret, "server", listener, job_id, rank, ns, nc)):
            raise AuthError(f"{what}: the server failed to prove the job secret")
    finally:
        sock.settimeout(old)


def server_handshake(sock: socket.socket, secret: bytes, listener: str, job_id: str, world: int,
                     timeout_s: float = 10.0, what: str = "handshake") -> int:
    """Challenge a connected client; returns its authenticated rank (< world).

    Raises AuthError (the caller closes the socket and logs the peer's address)."""
    deadline = time.monotonic() + timeout_s
    old = sock.gettimeout()
    try:
        ns = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + ns)
        reply = _recv_exact(sock, NONCE_BYTES + 4 + TAG_BYTES, deadline, what)
        nc = reply[:NONCE_BYTES]
        (rank,) = struct.unpack("<I", reply[NONCE_BYTES:NONCE_BYTES + 4])
        if rank >= world:
            raise AuthError(f"{what}: claimed rank {rank} outside a world of {world}")
        if not hmac.compare_digest(reply[NONCE_BYTES + 4:], tag(secret, "client", listener, job_id, rank, ns, nc)):
            raise AuthError(f"{what}: wrong secret for claimed rank {rank}")
        sock.sendall(tag(secret, "server", listener, job_id, rank, ns, nc))
        return rank
    finally:
        sock.settimeout(old)


class Refusals:
    """The bounded connections of a Python listener and what it refuses (over the limit, a failed
    handshake, a broken frame): each refusal counted and logged with the peer's address, as the
    C++ listeners' RefusalLog does.

    Args:
        what: the listener, as its log lines name it (e.g. "rendezvous 127.0.0.1:5555").
        lock: the listener's lock over `conns` (held inside these methods, never by their caller).
        max_connections: connections held at once.
        logger: where the refusals are logged.
    """

    def __init__(self, what: str, lock, max_connections: int, logger: logging.Logger):
        self.what, self.lock, self.max_connections, self.log = what, lock, int(max_connections), logger
        self.conns: set[socket.socket] = set()
        self.count = 0

    @staticmethod
    def _peer(peer) -> str:
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    def admit(self, conn: socket.socket, peer, closing=lambda: False) -> bool:
        """Holds a just-accepted `conn`, or closes it: refused (counted) when the listener is full,
        silently once `closing()` (evaluated under the lock)."""
        with self.lock:
            if closing():
                full = None
            elif len(self.conns) >= self.max_connections:
                full = True
                self.count += 1
            else:
                full = False
                self.conns.add(conn)
        if full:
            self.log.warning("%s: refused %s: already %d connections", self.what, self._peer(peer),
                             self.max_connections)
        if full is not False:
            conn.close()
        return full is False

    def release(self, conn: socket.socket) -> None:
        with self.lock:
            self.conns.discard(conn)

    def refused(self, peer, why) -> None:
        """`peer` failed the handshake."""
        with self.lock:
            self.count += 1
        self.log.warning("%s: refused %s: %s", self.what, self._peer(peer), why)

    def dropped(self, peer, why) -> None:
        """An authenticated `peer` broke the protocol: its connection is closed."""
        with self.lock:
            self.count += 1
        self.log.warning("%s: closing connection from %s: %s", self.what, self._peer(peer), why)
