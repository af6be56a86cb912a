"""Wire format of the coordination service, its peers, the shared-state server and the launch
rendezvous: a 4-byte big-endian length, then a msgpack map. Coordination frames carry their type
`Msg` in the field ``"t"``; both ends of a coordination connection authenticate by HMAC-SHA256
challenge-response over fresh nonces and every field the client claims (its group and addresses)
and the server assigns (the peer id), so the shared secret never travels and no claim can be
swapped under a valid answer. docs/coord.md describes the exchanges.
"""
from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import os
import socket
import struct

import msgpack

HEADER = struct.Struct(">I")
# Control frames are small; shared-state payloads travel as raw bytes after a header frame, so
# a frame above this is a broken or hostile peer.
MAX_FRAME = 1 << 20
AUTH_FRAME_MAX = 4096  # an auth frame: two nonces, a mac and a few short claims
PROTOCOL_VERSION = 2  # 2: the MACs cover the claimed and assigned fields
NONCE_BYTES = 32


class Msg(enum.StrEnum):
    """Message types: the ``"t"`` field of every coordination and shared-state frame."""
    # handshake, on every authenticated connection
    CHALLENGE = "challenge"  # server -> client: protocol version and a fresh nonce
    AUTH = "auth"            # client -> server: HMAC over both nonces, plus the client's hello fields
    WELCOME = "welcome"      # server -> client: the server's HMAC (mutual authentication), plus fields
    ERROR = "error"          # server -> client: a refusal with a reason
    # peer -> service; a request carries "rid", answered by exactly one REPLY with that rid
    HEARTBEAT = "hb"         # liveness, no rid; the service echoes it so the peer sees the service alive
    PENDING = "pending"      # request: are registered peers waiting? (same answer at every peer)
    TOPO = "topo"            # request: vote on newcomers, get the group's ring (installing a new one)
    TOPO_DONE = "topo_done"  # request: this peer connected (ok) or failed to connect the new ring
    OPEN = "open"            # request: vote to start the collective of a tag on a ring epoch
    CLOSE = "close"          # request: vote that the collective completed (ok) or failed here
    SYNC = "sync"            # request: vote to sync shared state, with this peer's revision and hashes
    SYNC_DONE = "sync_done"  # request: this peer fetched (ok) or failed to fetch its differing keys
    OPTIMIZE = "optimize"    # request: vote to measure every link and solve for a faster ring
    MEASURED = "measured"    # result of a MEASURE push, matched by its "mid"; no rid
    # service -> peer
    REPLY = "reply"          # the answer to request "rid": ok=True with results, or kind + reason
    ABORT = "abort"          # a peer failed: abort the listed collective tags now
    MEASURE = "measure"      # probe the bandwidth to another peer's ring endpoint
    # shared-state server, peer to peer
    GET = "get"              # fetch these keys
    ARRAY = "array"          # header of one key; its raw bytes follow the frame


class ErrorKind(enum.StrEnum):
    """Why a request failed: the ``"kind"`` of a REPLY with ok=False."""
    ERROR = "error"                # the request is invalid
    ABORTED = "aborted"            # the operation failed at some peer; retry after update_topology
    STALE = "stale"                # the ring no longer matches the group; call update_topology
    BUSY = "busy"                  # another operation of the group runs
    NOT_ACCEPTED = "not_accepted"  # the peer is registered but not yet voted into its group


class Strategy(enum.StrEnum):
    """Shared-state sync strategies (the ``"strategy"`` of a SYNC request)."""
    ENFORCE_POPULAR = "enforce_popular"  # offer this state, adopt the popular one
    SEND_ONLY = "send_only"              # offer this state, never change it
    RECEIVE_ONLY = "receive_only"        # offer nothing, adopt the popular state


# What a peer tells the service in its auth frame: its group and where its servers listen.
HELLO_FIELDS = {"group": int, "ring_addr": str, "ss_addr": str}
# Fields every message from a peer to the service must carry, checked before it acts on one.
PEER_MESSAGE_FIELDS: dict[Msg, dict[str, type]] = {
    Msg.HEARTBEAT: {},
    Msg.MEASURED: {"mid": int},
    Msg.PENDING: {"rid": int},
    Msg.TOPO: {"rid": int},
    Msg.TOPO_DONE: {"rid": int, "op": int},
    Msg.OPEN: {"rid": int, "tag": int, "epoch": int},
    Msg.CLOSE: {"rid": int, "tag": int, "op": int},
    Msg.SYNC: {"rid": int, "revision": int, "hashes": dict},
    Msg.SYNC_DONE: {"rid": int, "op": int},
    Msg.OPTIMIZE: {"rid": int},
}


class ProtocolError(Exception):
    """A frame that cannot be decoded or does not follow the protocol."""


class AuthError(ProtocolError):
    """The other side failed the challenge-response (wrong secret or not a jaxodc peer)."""


class FrameTooLarge(ProtocolError):
    """The length prefix announces more than the limit: the stream cannot be resynced."""


class ConnectionClosed(ConnectionError):
    """The other side closed the connection before all expected bytes arrived."""


def pack(obj: dict) -> bytes:
    """Encode one frame.

    Args:
        obj: the msgpack map to send.
    Returns:
        The length prefix and the body.
    """
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode(body: bytes, typed: bool = True) -> dict:
    """Decode one frame body.

    Args:
        body: the bytes after the length prefix.
        typed: require a string message type ``"t"`` (coordination frames; the rendezvous has none).
    Returns:
        The map.
    Raises:
        ProtocolError: naming what is malformed.
    """
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"undecodable msgpack body ({len(body)} bytes): {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame is a {type(obj).__name__}, expected a map")
    if typed and not isinstance(obj.get("t"), str):
        raise ProtocolError("frame has no string message type 't'")
    return obj


def check_length(n: int, max_frame: int = MAX_FRAME) -> None:
    """Raise FrameTooLarge if a length prefix announces more than max_frame bytes."""
    if n > max_frame:
        raise FrameTooLarge(f"frame length {n} exceeds the limit of {max_frame} bytes")


def check_fields(frame: dict, fields: dict[str, type]) -> None:
    """Raise ProtocolError naming the first of ``fields`` (name -> type) the frame lacks."""
    for name, typ in fields.items():
        if not isinstance(frame.get(name), typ):
            raise ProtocolError(f"{frame.get('t')!r} frame lacks {name!r} of type {typ.__name__}")


# --- asyncio side (service) --------------------------------------------------------------------

async def read_body(reader: asyncio.StreamReader, max_frame: int = MAX_FRAME) -> bytes:
    """Read one frame body from a stream.

    Returns:
        The undecoded body (the caller decodes it, so a bad body need not end the stream).
    Raises:
        FrameTooLarge: the prefix announces more than max_frame bytes.
        asyncio.IncompleteReadError: the stream ended inside a frame.
    """
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    check_length(n, max_frame)
    return await reader.readexactly(n)


# --- blocking socket side (clients, shared-state server, rendezvous) ---------------------------

def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> bytes | memoryview:
    """Receive exactly n bytes.

    Args:
        into: a writable buffer of n bytes to fill instead of allocating one.
    Returns:
        The bytes, or ``into``.
    Raises:
        ConnectionClosed: the connection ended first.
    """
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionClosed(f"connection closed after {got} of {n} bytes")
        got += k
    return buf if into is not None else bytes(buf)


# A body above this is read into memory that grows with the bytes received, not allocated from the
# announced length: a peer announcing a large frame and sending nothing costs nothing.
_GROW_CHUNK = 1 << 20


def _recv_growing(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(_GROW_CHUNK, n - len(buf)))
        if not chunk:
            raise ConnectionClosed(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, max_frame: int = MAX_FRAME, typed: bool = True) -> dict:
    """Receive and decode one frame.

    Args:
        max_frame: the largest body accepted.
        typed: see `decode`.
    Returns:
        The map.
    Raises:
        ConnectionClosed: the other side hung up between frames.
        ProtocolError: an oversized, truncated or undecodable frame (the stream is unusable).
    """
    (n,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    check_length(n, max_frame)
    try:
        body = recv_exact(sock, n) if n <= _GROW_CHUNK else _recv_growing(sock, n)
    except ConnectionClosed as e:
        raise ProtocolError(f"connection closed inside a {n}-byte frame ({e})") from None
    return decode(body, typed)


def send_frame(sock: socket.socket, obj: dict) -> None:
    """Send one frame (see `pack`)."""
    sock.sendall(pack(obj))


# --- authentication ----------------------------------------------------------------------------

_UNBOUND = ("t", "nonce", "mac")  # the handshake's own fields; every other one is bound


def _mac(secret: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes, frame: dict) -> bytes:
    """HMAC over both nonces and the frame's claims (its fields but `_UNBOUND`, sorted by name)."""
    claims = msgpack.packb(sorted(((k, v) for k, v in frame.items() if k not in _UNBOUND),
                                  key=lambda kv: str(kv[0])), use_bin_type=True)
    return hmac.new(secret, b"jaxodc-coord-v2|" + role + b"|" + server_nonce + b"|" + client_nonce
                    + b"|" + claims, hashlib.sha256).digest()


def challenge() -> dict:
    """Server side: a fresh challenge frame."""
    return {"t": Msg.CHALLENGE, "v": PROTOCOL_VERSION, "nonce": os.urandom(NONCE_BYTES)}


def answer(secret: bytes, chal: dict, hello: dict) -> tuple[dict, bytes]:
    """Client side: the auth frame for a challenge.

    Args:
        hello: fields the server learns about the client (see HELLO_FIELDS for the service).
    Returns:
        (auth frame, client nonce for `verify_welcome`).
    """
    if chal.get("t") != Msg.CHALLENGE or not isinstance(chal.get("nonce"), bytes):
        raise AuthError(f"expected a challenge frame, got type {chal.get('t')!r}")
    if chal.get("v") != PROTOCOL_VERSION:
        raise AuthError(f"protocol version {chal.get('v')!r} != {PROTOCOL_VERSION}")
    cn = os.urandom(NONCE_BYTES)
    frame = dict(hello)
    frame.update(t=Msg.AUTH, nonce=cn, mac=_mac(secret, b"client", chal["nonce"], cn, hello))
    return frame, cn


def verify_answer(secret: bytes, chal: dict, frame: dict) -> bytes:
    """Server side: check the client's auth frame.

    Returns:
        The client nonce (for `welcome`).
    Raises:
        AuthError: wrong secret or not an auth frame.
    """
    if frame.get("t") != Msg.AUTH:
        raise AuthError(f"expected an auth frame, got type {frame.get('t')!r}")
    if not all(isinstance(k, str) for k in frame):
        raise AuthError("auth frame has a field name that is not a string")
    cn, mac = frame.get("nonce"), frame.get("mac")
    if not isinstance(cn, bytes) or len(cn) != NONCE_BYTES or not isinstance(mac, bytes):
        raise AuthError("auth frame lacks a nonce or mac")
    if not hmac.compare_digest(mac, _mac(secret, b"client", chal["nonce"], cn, frame)):
        raise AuthError("wrong shared secret (HMAC mismatch)")
    return cn


def welcome(secret: bytes, chal: dict, client_nonce: bytes, extra: dict) -> dict:
    """Server side: the welcome frame proving the server knows the secret, with ``extra`` fields."""
    frame = dict(extra)
    frame.update(t=Msg.WELCOME, mac=_mac(secret, b"server", chal["nonce"], client_nonce, extra))
    return frame


def refusal(reason: str) -> dict:
    """Server side: the frame that tells a client why it is refused."""
    return {"t": Msg.ERROR, "reason": reason}


def verify_welcome(secret: bytes, chal: dict, client_nonce: bytes, frame: dict) -> None:
    """Client side: check that the server proved the secret too (mutual authentication).

    Raises:
        AuthError: the server refused or failed to prove the secret.
    """
    if frame.get("t") == Msg.ERROR:
        raise AuthError(f"server refused: {frame.get('reason')}")
    if frame.get("t") != Msg.WELCOME or not isinstance(frame.get("mac"), bytes):
        raise AuthError(f"expected a welcome frame, got type {frame.get('t')!r}")
    if not hmac.compare_digest(frame["mac"], _mac(secret, b"server", chal["nonce"], client_nonce, frame)):
        raise AuthError("server failed to prove the shared secret (HMAC mismatch)")


def client_handshake(sock: socket.socket, secret: bytes, hello: dict) -> dict:
    """Blocking client side of the handshake on a connected socket.

    Returns:
        The welcome frame.
    """
    chal = recv_frame(sock)
    frame, cn = answer(secret, chal, hello)
    send_frame(sock, frame)
    w = recv_frame(sock)
    verify_welcome(secret, chal, cn, w)
    return w


def server_handshake(sock: socket.socket, secret: bytes, extra: dict | None = None) -> dict:
    """Blocking server side of the handshake on an accepted socket.

    Returns:
        The client's auth frame (its hello fields).
    """
    chal = challenge()
    send_frame(sock, chal)
    frame = recv_frame(sock)
    try:
        cn = verify_answer(secret, chal, frame)
    except AuthError:
        send_frame(sock, refusal("authentication failed"))
        raise
    send_frame(sock, welcome(secret, chal, cn, extra or {}))
    return frame


def parse_address(address: str, what: str = "address") -> tuple[str, int]:
    """Split "host:port" (an IPv6 host may stand in brackets).

    Args:
      address: the text to split.
      what: what the address is, for the error message.

    Returns:
      (host, port).
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{what} must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)
