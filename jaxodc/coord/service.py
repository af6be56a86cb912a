"""The coordination service's transport (PCCL's ``ccoip_master_handler``): asyncio accept,
authentication, heartbeats and frame I/O around the synchronous `CoordState`, whose actions it
delivers. ``jaxodc master`` runs it standalone; ``Communicator(..., host_master=True)`` embeds it.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
import threading
import time

from jaxodc import auth
from jaxodc.coord import topology
from jaxodc.coord import protocol as P
from jaxodc.coord.state import CoordState, SolveRing

log = logging.getLogger("jaxodc.coord")

# The exact ring solver has no time limit of its own; this bounds it beyond the heuristic's.
_SOLVE_MARGIN_S = 60.0
_START_STOP_TIMEOUT_S = 30.0


@dataclasses.dataclass(eq=False)
class _Connection:
    writer: asyncio.StreamWriter
    last_seen: float  # monotonic time of the last frame read


class CoordinatorService:
    """The coordination service; ``start()`` runs it embedded in a background thread.

    Args:
        host, port: where to listen (port 0 picks a free one; see ``address``).
        secret: shared secret peers must prove (HMAC challenge-response); empty only on loopback.
        heartbeat_timeout_s: silence after which a peer counts as failed.
        auth_timeout_s: time a new connection has to authenticate.
        measure_bytes: default bytes per bandwidth probe of optimize_topology.
        tsp_time_limit_s: time limit of the heuristic ring solver.
        max_connections: connections held at once (authenticating or registered); more are closed
            on accept.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: bytes = b"",
                 heartbeat_timeout_s: float = 10.0, auth_timeout_s: float = 5.0,
                 measure_bytes: int = 1 << 20, tsp_time_limit_s: float = 1.0,
                 max_connections: int = 1024):
        auth.require_secret_for_bind(secret, host, "coordination service")
        self.host, self.port = host, port
        self.max_connections = max_connections
        self._writers: set[asyncio.StreamWriter] = set()  # every open connection, authenticated or not
        self.secret = secret
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.auth_timeout_s = auth_timeout_s
        self.tsp_time_limit_s = tsp_time_limit_s
        self.state = CoordState(measure_bytes)
        self._conns: dict[int, _Connection] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._monitor = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self.address: str | None = None

    # --- lifecycle --------------------------------------------------------------------------

    async def serve_start(self) -> None:
        """Listen on the running loop and set ``address``."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.host}:{port}"
        self._monitor = asyncio.ensure_future(self._watch_heartbeats())
        log.info("coordination service listening on %s", self.address)

    async def serve_stop(self) -> None:
        """Stop listening and close every peer connection."""
        self._monitor.cancel()
        self._server.close()
        for writer in list(self._writers):  # wakes reads still inside the handshake too
            writer.close()
        await self._server.wait_closed()

    def start(self) -> "CoordinatorService":
        """Run the service on its own loop in a daemon thread.

        Returns:
            self, listening at ``address``.
        """
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
        if not ready.wait(_START_STOP_TIMEOUT_S):
            raise TimeoutError(f"coordination service did not start listening on {self.host}:{self.port} "
                               f"within {_START_STOP_TIMEOUT_S} s")
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        """Stop a service started with ``start()``."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout=_START_STOP_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("coordination service at %s did not stop within %s s", self.address,
                            _START_STOP_TIMEOUT_S)

    def call(self, fn, timeout: float = 10.0):
        """Run fn() on the service loop from another thread.

        Returns:
            fn's result.
        """
        async def wrap():
            return fn()
        try:
            return asyncio.run_coroutine_threadsafe(wrap(), self._loop).result(timeout)
        except TimeoutError:
            raise TimeoutError(f"the coordination service loop did not run {fn.__qualname__} "
                               f"within {timeout} s") from None

    def snapshot(self) -> dict:
        """Thread-safe `CoordState.snapshot`."""
        return self.call(self.state.snapshot)

    # --- connections ------------------------------------------------------------------------

    def _deliver(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, SolveRing):
                asyncio.ensure_future(self._solve_ring(action))
                continue
            conn = self._conns.get(action.to)
            if conn is None:
                continue
            try:
                conn.writer.write(P.pack(action.msg))
            except Exception as e:  # a transport closing under us: its reader reports the loss
                log.debug("write to peer %d failed: %s", action.to, e)

    def _disconnect(self, pid: int, reason: str) -> _Connection | None:
        conn = self._conns.pop(pid, None)
        if conn is not None:
            self._deliver(self.state.disconnect(pid, reason, time.monotonic()))
        return conn

    async def _authenticate(self, reader, writer) -> tuple[dict, dict, bytes]:
        chal = P.challenge()
        writer.write(P.pack(chal))
        hello = P.decode(await P.read_body(reader, P.AUTH_FRAME_MAX))
        cn = P.verify_answer(self.secret, chal, hello)
        P.check_fields(hello, P.HELLO_FIELDS)
        return hello, chal, cn

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = writer.get_extra_info("peername")
        if len(self._writers) >= self.max_connections:
            self.state.counters["auth_failures"] += 1
            log.warning("refused connection from %s: already %d connections", remote, self.max_connections)
            writer.close()
            return
        self._writers.add(writer)
        try:
            await self._serve(reader, writer, remote)
        finally:
            self._writers.discard(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, remote) -> None:
        try:
            hello, chal, cn = await asyncio.wait_for(self._authenticate(reader, writer), self.auth_timeout_s)
        except (P.ProtocolError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            self.state.counters["auth_failures"] += 1
            reason = (f"no valid answer to the challenge within {self.auth_timeout_s} s"
                      if isinstance(e, asyncio.TimeoutError) else str(e) or type(e).__name__)
            log.warning("dropped unauthenticated connection from %s: %s", remote, reason)
            if isinstance(e, P.AuthError):  # tell an honest client with the wrong secret why
                writer.write(P.pack(P.refusal("authentication failed")))
            writer.close()
            return
        pid = self.state.register(hello["group"], hello["ring_addr"], hello["ss_addr"])
        conn = self._conns[pid] = _Connection(writer, time.monotonic())
        writer.write(P.pack(P.welcome(self.secret, chal, cn, {"peer_id": pid})))
        log.info("registered %r from %s", self.state.peers[pid], remote)
        reason = "connection closed"
        try:
            while True:
                try:
                    body = await P.read_body(reader)
                except P.FrameTooLarge as e:
                    self.state.malformed(pid, e)
                    reason = f"unrecoverable frame: {e}"
                    break
                conn.last_seen = time.monotonic()
                try:
                    msg = P.decode(body)
                except P.ProtocolError as e:
                    self.state.malformed(pid, e)
                    continue
                self._deliver(self.state.receive(pid, msg, conn.last_seen))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            reason = "service stopping"
        finally:
            self._disconnect(pid, reason)
            writer.close()

    async def _watch_heartbeats(self) -> None:
        """Drop silent peers (a hung process keeps its socket open) and tick the state's clock."""
        period = max(0.05, min(0.5, self.heartbeat_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for pid, conn in list(self._conns.items()):
                if now - conn.last_seen > self.heartbeat_timeout_s:
                    self._disconnect(pid, f"no heartbeat for {now - conn.last_seen:.1f} s "
                                          f"(timeout {self.heartbeat_timeout_s} s)")
                    conn.writer.transport.abort()
            self._deliver(self.state.tick(now))

    async def _solve_ring(self, job: SolveRing) -> None:
        limit = self.tsp_time_limit_s + _SOLVE_MARGIN_S
        try:
            order, cost = await asyncio.wait_for(self._loop.run_in_executor(
                None, topology.solve_ring, job.bandwidth, self.tsp_time_limit_s), limit)
        except asyncio.TimeoutError:
            actions = self.state.ring_solve_failed(
                job.group, job.op, f"the ring solver did not finish within {limit:g} s")
        except Exception as e:
            actions = self.state.ring_solve_failed(job.group, job.op, f"{type(e).__name__}: {e}")
        else:
            actions = self.state.ring_solved(job.group, job.op, order, cost)
        self._deliver(actions)


def main(argv: list[str] | None = None) -> int:
    """``jaxodc master``: run the coordination service standalone until SIGINT/SIGTERM.

    Returns:
        The exit status.
    """
    ap = argparse.ArgumentParser(prog="jaxodc master", description="run the coordination service standalone")
    ap.add_argument("--host", default="127.0.0.1",
                    help="interface to listen on (default loopback; 0.0.0.0 for every interface, which needs a secret)")
    ap.add_argument("--port", type=int, default=48148)
    ap.add_argument("--secret-file", help=f"file whose bytes are the shared secret (default: ${auth.SECRET_ENV} or "
                                          f"${auth.SECRET_FILE_ENV}; none only on loopback)")
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds of silence before a peer is dropped")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    from jaxodc.launch.address import is_loopback_host
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        secret = auth.read_secret_file(args.secret_file) if args.secret_file else auth.secret_from_env()
        svc = CoordinatorService(args.host, args.port, secret, heartbeat_timeout_s=args.heartbeat_timeout)
    except auth.AuthError as e:
        print(f"jaxodc master: {e}", file=sys.stderr)
        return 2

    async def run():
        await svc.serve_start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, svc._stopped.set)
        print(f"jaxodc master listening on {svc.address}", flush=True)  # and stoppable from here on
        if is_loopback_host(args.host):
            print("jaxodc master: on loopback only; sites on other hosts need --host 0.0.0.0 (or this host's "
                  "address)", file=sys.stderr, flush=True)
        await svc._stopped.wait()
        await svc.serve_stop()

    try:
        asyncio.run(run())
    except OSError as e:  # e.g. the port is taken
        print(f"jaxodc master: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0
