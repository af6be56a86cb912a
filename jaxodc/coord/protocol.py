"""Wire format of the coordination service and the peer-to-peer shared-state server.

Every frame is a 4-byte big-endian length followed by a msgpack map with a string field ``"t"``
(the message type). Both ends authenticate each other with a shared secret by HMAC-SHA256
challenge-response over fresh nonces: the secret itself never travels.
"""
from __future__ import annotations

import asyncio
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
PROTOCOL_VERSION = 1
NONCE_BYTES = 32


class ProtocolError(Exception):
    """A frame that cannot be decoded or does not follow the protocol."""


class AuthError(ProtocolError):
    """The other side failed the challenge-response (wrong secret or not a jaxodc peer)."""


class FrameTooLarge(ProtocolError):
    """The length prefix announces more than MAX_FRAME bytes: the stream cannot be resynced."""


def pack(obj: dict) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict:
    """Decode one frame body; raises ProtocolError with the reason for anything malformed."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"undecodable msgpack body ({len(body)} bytes): {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame is a {type(obj).__name__}, expected a map")
    if not isinstance(obj.get("t"), str):
        raise ProtocolError("frame has no string message type 't'")
    return obj


def check_length(n: int, max_frame: int = MAX_FRAME) -> None:
    if n > max_frame:
        raise FrameTooLarge(f"frame length {n} exceeds the limit of {max_frame} bytes")


# --- asyncio side (service) --------------------------------------------------------------------

async def read_body(reader: asyncio.StreamReader, max_frame: int = MAX_FRAME) -> bytes:
    head = await reader.readexactly(HEADER.size)
    (n,) = HEADER.unpack(head)
    check_length(n, max_frame)
    return await reader.readexactly(n)


# --- blocking socket side (clients, shared-state server) ---------------------------------------

def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> bytes | memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf if into is not None else bytes(buf)


def recv_frame(sock: socket.socket, max_frame: int = MAX_FRAME) -> dict:
    (n,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    check_length(n, max_frame)
    return decode(recv_exact(sock, n))


def send_frame(sock: socket.socket, obj: dict) -> None:
    sock.sendall(pack(obj))


# --- authentication ----------------------------------------------------------------------------

def _mac(secret: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"jaxodc-auth-v1|" + role + b"|" + server_nonce + b"|" + client_nonce,
                    hashlib.sha256).digest()


def challenge() -> dict:
    return {"t": "challenge", "v": PROTOCOL_VERSION, "nonce": os.urandom(NONCE_BYTES)}


def answer(secret: bytes, chal: dict, hello: dict) -> tuple[dict, bytes]:
    """Client side: build the auth frame for a challenge; returns (frame, client_nonce)."""
    if chal.get("t") != "challenge" or not isinstance(chal.get("nonce"), bytes):
        raise AuthError(f"expected a challenge frame, got type {chal.get('t')!r}")
    if chal.get("v") != PROTOCOL_VERSION:
        raise AuthError(f"protocol version {chal.get('v')!r} != {PROTOCOL_VERSION}")
    cn = os.urandom(NONCE_BYTES)
    frame = dict(hello)
    frame.update(t="auth", nonce=cn, mac=_mac(secret, b"client", chal["nonce"], cn))
    return frame, cn


def verify_answer(secret: bytes, chal: dict, frame: dict) -> bytes:
    """Server side: check the client's auth frame; returns the client nonce."""
    if frame.get("t") != "auth":
        raise AuthError(f"expected an auth frame, got type {frame.get('t')!r}")
    cn, mac = frame.get("nonce"), frame.get("mac")
    if not isinstance(cn, bytes) or len(cn) != NONCE_BYTES or not isinstance(mac, bytes):
        raise AuthError("auth frame lacks a nonce or mac")
    if not hmac.compare_digest(mac, _mac(secret, b"client", chal["nonce"], cn)):
        raise AuthError("wrong shared secret (HMAC mismatch)")
    return cn


def welcome(secret: bytes, chal: dict, client_nonce: bytes, extra: dict) -> dict:
    frame = dict(extra)
    frame.update(t="welcome", mac=_mac(secret, b"server", chal["nonce"], client_nonce))
    return frame


def verify_welcome(secret: bytes, chal: dict, client_nonce: bytes, frame: dict) -> None:
    """Client side: the server proves it knows the secret too (mutual authentication)."""
    if frame.get("t") == "error":
        raise AuthError(f"server refused: {frame.get('reason')}")
    if frame.get("t") != "welcome" or not isinstance(frame.get("mac"), bytes):
        raise AuthError(f"expected a welcome frame, got type {frame.get('t')!r}")
    if not hmac.compare_digest(frame["mac"], _mac(secret, b"server", chal["nonce"], client_nonce)):
        raise AuthError("server failed to prove the shared secret (HMAC mismatch)")


def client_handshake(sock: socket.socket, secret: bytes, hello: dict) -> dict:
    """Blocking mutual challenge-response on a connected socket; returns the welcome frame."""
    chal = recv_frame(sock)
    frame, cn = answer(secret, chal, hello)
    send_frame(sock, frame)
    w = recv_frame(sock)
    verify_welcome(secret, chal, cn, w)
    return w


def server_handshake(sock: socket.socket, secret: bytes, extra: dict | None = None) -> dict:
    """Blocking server side of the handshake; returns the client's auth frame."""
    chal = challenge()
    send_frame(sock, chal)
    frame = recv_frame(sock)
    try:
        cn = verify_answer(secret, chal, frame)
    except AuthError:
        send_frame(sock, {"t": "error", "reason": "authentication failed"})
        raise
    send_frame(sock, welcome(secret, chal, cn, extra or {}))
    return frame


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not of the form host:port")
    return host, int(port)
