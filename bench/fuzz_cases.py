"""The cases of `jaxodc bench fuzz` (bench/fuzz.py describes them): one listener as a `Target`, one
case against it in its dialect (`run_case`: jaxodc-auth-v2; `run_coord_case`: the coordination
service's jaxodc-coord-v2), and `fuzz`, which spreads many cases over many targets at once."""
from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack

from jaxodc import auth
from jaxodc.coord import protocol as P

SECRET = bytes.fromhex("6a61786f64632d66757a7a2d7365637265742d30303031")
MAGIC_LEN = len(auth.MAGIC) + auth.NONCE_BYTES
REPLY_LEN = auth.NONCE_BYTES + 4 + auth.TAG_BYTES
RANK_EDGES = (0, 1, 2, 3, 127, 128, 255, 256, (1 << 15) - 1, 1 << 15, (1 << 20) - 1, 1 << 20,
              (1 << 31) - 1, 1 << 31, (1 << 32) - 1)
LEN_EDGES = (0, 1, 3, 4, 35, 36, 37, 67, 68, 69, 100, 4095, 4096, 65536)
KINDS = ("random", "truncated", "oversized", "rank_edge", "wrong_secret", "no_secret", "stale_nonce",
         "replay", "other_listener", "other_job", "bad_magic_echo", "idle")


# -- one case ---------------------------------------------------------------------------------------

class Target:
    """One listener of the job: where it listens, its dialect ("v2": jaxodc-auth-v2, "coord":
    jaxodc-coord-v2), what a rank of the job would prove to it and the process that owns it."""

    def __init__(self, listener: str, host: str, port: int, job_id: str, world: int, secret: bytes,
                 dialect: str = "v2", pid: int | None = None):
        self.listener, self.host, self.port = listener, host, port
        self.job_id, self.world, self.secret = job_id, world, secret
        self.dialect, self.pid = dialect, pid
        self.kinds = COORD_KINDS if dialect == "coord" else KINDS
        self.cases = self.rejected = 0
        self.admitted: list[str] = []  # kinds of case a listener let in (must stay empty)
        self.silent_at: float | None = None  # monotonic time it was first found not answering
        self.gone_at: float | None = None    # monotonic time its process was found ended
        self.lock = threading.Lock()

    def count(self, kind: str, rejected: bool) -> None:
        with self.lock:
            self.cases += 1
            self.rejected += bool(rejected)
            if not rejected:
                self.admitted.append(kind)

    def alive(self, timeout_s: float = 5.0) -> bool:
        """The listener still answers a connection with its challenge."""
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout_s) as s:
                s.settimeout(timeout_s)
                if self.dialect == "coord":
                    return _coord_challenge(s) is not None
                return _recv_exact(s, MAGIC_LEN)[:4] == auth.MAGIC
        except OSError:
            return False


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def _reply(t: Target, nonce_s: bytes, rank: int, secret: bytes, listener: str | None = None,
           job_id: str | None = None) -> bytes:
    nc = os.urandom(auth.NONCE_BYTES)
    tag = auth.tag(secret, "client", listener or t.listener, t.job_id if job_id is None else job_id,
                   rank, nonce_s, nc)
    return nc + struct.pack("<I", rank) + tag


def _proved(t: Target, s: socket.socket, nonce_s: bytes, reply: bytes) -> bool:
    """Whether the listener answered `reply` with a valid proof of the secret (it must not)."""
    try:
        s.settimeout(10)
        proof = _recv_exact(s, auth.TAG_BYTES)
    except OSError:
        return False
    if len(proof) < auth.TAG_BYTES:
        return False
    rank = struct.unpack("<I", reply[auth.NONCE_BYTES:auth.NONCE_BYTES + 4])[0]
    try:
        return proof == auth.tag(t.secret, "server", t.listener, t.job_id, rank, nonce_s, reply[:auth.NONCE_BYTES])
    except ValueError:
        return True  # any answer to a rank no listener may admit


def _connect(t: Target) -> socket.socket | bool | None:
    """A connection to `t` with the cases' 10 s timeout; None when nothing listens any more, True
    when the connection was refused otherwise (a rejection)."""
    try:
        s = socket.create_connection((t.host, t.port), timeout=10)
    except ConnectionRefusedError:
        return None
    except OSError:
        return True
    s.settimeout(10)
    return s


def run_case(t: Target, kind: str, rng: random.Random, stale: list) -> bool | None:
    """Runs one case against `t`; True when it was rejected, None when nothing listens any more."""
    s = _connect(t)
    if not isinstance(s, socket.socket):
        return s
    with s:
        try:
            hello = _recv_exact(s, MAGIC_LEN)
            if len(hello) < MAGIC_LEN or hello[:4] != auth.MAGIC:
                return True
            ns = hello[4:]
            rank = rng.randrange(t.world)
            if kind == "random":
                s.sendall(os.urandom(rng.choice(LEN_EDGES + (rng.randrange(1, 2048),))))
                s.shutdown(socket.SHUT_WR)
                return not _answered_with_proof(s)
            if kind == "truncated":
                s.sendall(_reply(t, ns, rank, t.secret)[:rng.randrange(REPLY_LEN)])
                s.shutdown(socket.SHUT_WR)
                return not _answered_with_proof(s)
            if kind == "oversized":  # a garbage reply followed by far more bytes than any frame
                s.sendall(os.urandom(REPLY_LEN))
                try:
                    s.sendall(os.urandom(rng.choice((4096, 1 << 16, 1 << 20))))
                except OSError:
                    return True
                s.shutdown(socket.SHUT_WR)
                return not _answered_with_proof(s)
            if kind == "rank_edge":  # a claimed rank at an integer edge, tag from a wrong secret
                r = rng.choice(RANK_EDGES)
                nc = os.urandom(auth.NONCE_BYTES)
                reply = nc + struct.pack("<I", r) + os.urandom(auth.TAG_BYTES)
                s.sendall(reply)
                return not _proved(t, s, ns, reply)
            if kind in ("wrong_secret", "no_secret"):
                secret = b"" if kind == "no_secret" else os.urandom(rng.choice((1, 16, 32, 100)))
                reply = _reply(t, ns, rank, secret)
                s.sendall(reply)
                return not _proved(t, s, ns, reply)
            if kind in ("stale_nonce", "replay"):
                # A reply the job secret made for an earlier challenge: replayed byte for byte, or
                # re-tagged over that earlier (stale) nonce.
                old_ns = stale[0] if stale else os.urandom(auth.NONCE_BYTES)
                stale[:] = [ns]
                reply = _reply(t, old_ns, rank, t.secret)
                s.sendall(reply)
                return not _proved(t, s, ns, reply)
            if kind == "other_listener":
                other = rng.choice([x for x in auth.LISTENERS if x != t.listener])
                reply = _reply(t, ns, rank, t.secret, listener=other)
                s.sendall(reply)
                return not _proved(t, s, ns, reply)
            if kind == "other_job":
                reply = _reply(t, ns, rank, t.secret, job_id=t.job_id + "x")
                s.sendall(reply)
                return not _proved(t, s, ns, reply)
            if kind == "bad_magic_echo":  # the server's own challenge sent back
                s.sendall(hello + hello[:REPLY_LEN - MAGIC_LEN])
                s.shutdown(socket.SHUT_WR)
                return not _answered_with_proof(s)
            if kind == "idle":  # held open without a word, then dropped
                time.sleep(rng.uniform(0.2, 1.0))
                return True
            raise ValueError(kind)
        except OSError:
            return True  # the listener ended the connection


def _answered_with_proof(s: socket.socket) -> bool:
    """After garbage: anything but the end of the connection is an answer it must not give."""
    try:
        s.settimeout(10)
        return len(_recv_exact(s, auth.TAG_BYTES)) == auth.TAG_BYTES
    except OSError:
        return False


# -- the coordination service's dialect --------------------------------------------------------------

COORD_KINDS = ("random", "truncated", "oversized", "len_edge", "wrong_secret", "no_mac", "stale_nonce", "replay",
               "wrong_type", "bad_claims", "not_a_map", "idle")
# Length prefixes at the edges of the auth frame's limit and of the u32 prefix itself.
COORD_LEN_EDGES = (P.AUTH_FRAME_MAX + 1, P.MAX_FRAME, P.MAX_FRAME + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1)


def _coord_challenge(s: socket.socket) -> dict | None:
    """The service's challenge frame on a fresh connection (None when it sent none)."""
    try:
        chal = P.recv_frame(s, P.AUTH_FRAME_MAX)
    except (P.ProtocolError, ConnectionError, OSError):
        return None
    ok = chal.get("t") == P.Msg.CHALLENGE and isinstance(chal.get("nonce"), bytes)
    return chal if ok else None


def _coord_hello(rng: random.Random) -> dict:
    return {"group": rng.randrange(2), "ring_addr": f"127.0.0.1:{rng.randrange(1, 65536)}",
            "ss_addr": f"127.0.0.1:{rng.randrange(1, 65536)}"}


def _coord_auth(secret: bytes, server_nonce: bytes, hello: dict, **fields) -> dict:
    """An auth frame for `hello`, mac'd with `secret` over `server_nonce`; `fields` replace any of it."""
    cn = os.urandom(P.NONCE_BYTES)
    frame = dict(hello, t=P.Msg.AUTH, nonce=cn,
                 mac=P._mac(secret, b"client", server_nonce, cn, hello))  # noqa: SLF001 - the wire's own mac
    frame.update(fields)
    return frame


def _coord_welcomed(s: socket.socket) -> bool:
    """Reads what the service answers until it ends the connection: True on a welcome (an error
    frame, a timeout or the end of the connection are refusals)."""
    s.settimeout(10)
    for _ in range(4):  # a refusal is one error frame, then the end
        try:
            frame = P.recv_frame(s)
        except (P.ProtocolError, ConnectionError, OSError):
            return False
        if frame.get("t") == P.Msg.WELCOME:
            return True
    return True  # a stream of frames to an unauthenticated peer is an answer it must not give


def run_coord_case(t: Target, kind: str, rng: random.Random, stale: list) -> bool | None:
    """One case against the coordination service; True when it was rejected, None when nothing
    listens any more. `stale` carries the previous case's challenge and a valid auth frame for it."""
    s = _connect(t)
    if not isinstance(s, socket.socket):
        return s
    with s:
        try:
            chal = _coord_challenge(s)
            if chal is None:
                return True
            ns, hello = chal["nonce"], _coord_hello(rng)
            old = stale[:] or [os.urandom(P.NONCE_BYTES), P.pack(_coord_auth(t.secret, os.urandom(P.NONCE_BYTES),
                                                                             hello))]
            stale[:] = [ns, P.pack(_coord_auth(t.secret, ns, hello))]  # what a peer would have sent here
            if kind == "random":
                s.sendall(os.urandom(rng.choice(LEN_EDGES + (rng.randrange(1, 2048),))))
            elif kind == "truncated":  # a frame cut anywhere, the length prefix included
                frame = P.pack(_coord_auth(os.urandom(32), ns, hello))
                s.sendall(frame[:rng.randrange(len(frame))])
            elif kind == "oversized":  # a prefix beyond the auth frame's limit, then that many bytes begun
                s.sendall(P.HEADER.pack(rng.choice(COORD_LEN_EDGES)))
                try:
                    s.sendall(os.urandom(rng.choice((0, 4096, 1 << 16))))
                except OSError:
                    return True
            elif kind == "len_edge":  # a whole frame of garbage at the smallest and largest legal lengths
                n = rng.choice((0, 1, 2, P.AUTH_FRAME_MAX - 1, P.AUTH_FRAME_MAX))
                s.sendall(P.HEADER.pack(n) + os.urandom(n))
            elif kind == "wrong_secret":
                secret = os.urandom(rng.choice((1, 16, 32, 100))) if rng.random() < 0.8 else b""
                s.sendall(P.pack(_coord_auth(secret, ns, hello)))
            elif kind == "no_mac":  # the mac or nonce missing, empty, of another type or length
                field, value = rng.choice((("mac", None), ("mac", b""), ("mac", "0" * 64), ("mac", 0),
                                           ("nonce", None), ("nonce", b""), ("nonce", os.urandom(31)),
                                           ("nonce", os.urandom(33)), ("nonce", "x" * 32)))
                frame = _coord_auth(t.secret, ns, hello)
                if value is None:
                    del frame[field]
                else:
                    frame[field] = value
                s.sendall(P.pack(frame))
            elif kind == "stale_nonce":  # the job secret's mac over the previous challenge's nonce
                s.sendall(P.pack(_coord_auth(t.secret, old[0], hello)))
            elif kind == "replay":  # the valid auth frame of the previous challenge, byte for byte
                s.sendall(old[1])
            elif kind == "wrong_type":  # a right mac over this challenge, under another message type
                typ = rng.choice((P.Msg.WELCOME, P.Msg.CHALLENGE, P.Msg.HEARTBEAT, P.Msg.TOPO, P.Msg.ERROR, "AUTH",
                                  "", b"auth", 1, None))
                frame = _coord_auth(t.secret, ns, hello)
                if typ is None:
                    del frame["t"]
                else:
                    frame["t"] = typ
                s.sendall(P.pack(frame))
            elif kind == "bad_claims":  # a right mac over claims of the wrong types or names
                bad = rng.choice(({"group": "0", "ring_addr": hello["ring_addr"], "ss_addr": hello["ss_addr"]},
                                  {"group": 0, "ring_addr": 1, "ss_addr": hello["ss_addr"]},
                                  {"group": 0, "ring_addr": hello["ring_addr"]},
                                  {1: 0, "group": 0, "ring_addr": hello["ring_addr"], "ss_addr": hello["ss_addr"]},
                                  {}))
                s.sendall(P.pack(_coord_auth(t.secret, ns, bad)))
            elif kind == "not_a_map":
                body = rng.choice((msgpack.packb([P.Msg.AUTH, ns]), msgpack.packb(P.Msg.AUTH), msgpack.packb(None),
                                   msgpack.packb(1 << 63), b"\x91" * 2000 + b"\xc0", b"\xdf\xff\xff\xff\xff",
                                   b"\xc6\xff\xff\xff\xff"))
                s.sendall(P.HEADER.pack(len(body)) + body)
            elif kind == "idle":  # held open without a word, then dropped
                time.sleep(rng.uniform(0.2, 1.0))
                return True
            else:
                raise ValueError(kind)
            s.shutdown(socket.SHUT_WR)
            return not _coord_welcomed(s)
        except OSError:
            return True  # the service ended the connection


def fuzz(targets: list[Target], cases, seed: int = 0, threads: int = 8,
         stop: threading.Event | None = None) -> None:
    """Runs `cases` cases (or {listener: cases}) against every target, spread over the kinds of case,
    all targets at once. Cases that find the listener gone (the job ended) are not counted."""
    work = []
    for i, t in enumerate(targets):
        rng = random.Random(seed * 1000 + i)
        n = cases if isinstance(cases, int) else cases[t.listener]
        work += [(t, t.kinds[k % len(t.kinds)], random.Random(rng.random())) for k in range(n)]
    random.Random(seed).shuffle(work)
    stale: dict[str, list] = {t.listener + str(t.port): [] for t in targets}

    def one(item):
        t, kind, rng = item
        if stop is not None and stop.is_set():
            return
        case = run_coord_case if t.dialect == "coord" else run_case
        rejected = case(t, kind, rng, stale[t.listener + str(t.port)])
        if rejected is not None:
            t.count(kind, rejected)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, work))
