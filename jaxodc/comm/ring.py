"""Abortable, pipelined ring all-reduce over TCP (the data path of the communicator).

Each peer owns one :class:`RingEndpoint`. After :meth:`RingEndpoint.connect_ring` every peer holds
``pool_size`` authenticated connections to the next peer of the ring and ``pool_size`` from the
previous one; all-reduces stream chunk pieces around the ring (reduce-scatter, then all-gather) and
every peer ends with bit-identical results. Operations are native (C++, GIL released) and may run
concurrently: each takes one pooled connection, granted in call order, so peers must issue
concurrent operations in the same order (the communicator's per-collective consensus does).

Quantised transfer (``quantize="uint8"|"uint16"``, float dtypes): every piece is sent as min-max
codes plus (lo, scale); the owner of a reduced chunk quantises it once and keeps exactly the values
everyone else dequantises, so peers stay bit-identical. Error: at most half a step (range/levels/2)
per hop, W hops in all.

Failure model: :meth:`abort` or any I/O failure ends in-flight operations with the caller's input
restored (it is never modified before the operation completes), raising :class:`RingAborted`,
``TimeoutError`` or ``ConnectionError`` naming the peer and tag; the endpoint then needs a
``connect_ring`` with a larger epoch.
"""
from __future__ import annotations

import numpy as np

import jaxodc._C as _C

try:  # bfloat16 comes with jax
    from ml_dtypes import bfloat16 as _bf16
except ImportError:  # pragma: no cover
    _bf16 = None

__all__ = ["RingAborted", "RingEndpoint", "RingHandle", "OPS", "QUANTIZE"]

_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2,
           np.dtype(np.int32): 4, np.dtype(np.int64): 5}
if _bf16 is not None:
    _DTYPES[np.dtype(_bf16)] = 3
OPS = {"sum": 0, "avg": 1, "min": 2, "max": 3, "prod": 4}
QUANTIZE = {None: 0, "none": 0, "uint8": 1, "uint16": 2}


class RingAborted(RuntimeError):
    """The all-reduce was aborted; the caller's input buffer holds its original values."""


def _raise(status: int, message: str):
    if status == 1:
        raise RingAborted(message)
    if status == 2:
        raise TimeoutError(message)
    if status == 3:
        raise ConnectionError(message)
    raise ValueError(message)


def _codes(x: np.ndarray, op: str, quantize):
    if x.dtype not in _DTYPES:
        raise TypeError(f"all_reduce: unsupported dtype {x.dtype}; supported: "
                        f"{sorted(str(d) for d in _DTYPES)}")
    if op not in OPS:
        raise ValueError(f"all_reduce: unknown op {op!r}; expected one of {sorted(OPS)}")
    if quantize not in QUANTIZE:
        raise ValueError(f"all_reduce: unknown quantize {quantize!r}; expected None, 'uint8' or 'uint16'")
    if QUANTIZE[quantize] and x.dtype.kind not in "fV":
        raise ValueError(f"all_reduce: quantize={quantize!r} needs a floating dtype, got {x.dtype}")
    return _DTYPES[x.dtype], OPS[op], QUANTIZE[quantize]


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


class RingHandle:
    """An all-reduce in flight (from :meth:`RingEndpoint.all_reduce_async`)."""

    def __init__(self, native, out: np.ndarray, keep: tuple, tag: int):
        self._native = native
        self._out = out
        self._keep = keep  # arrays and endpoint the native op points into
        self._tag = tag
        self._result = None

    def done(self) -> bool:
        return self._native.done()

    def wait(self, timeout_s: float | None = None) -> np.ndarray:
        if self._result is None:
            if not self._native.wait(-1.0 if timeout_s is None else float(timeout_s)):
                raise TimeoutError(f"all_reduce tag {self._tag} still running after wait({timeout_s})")
            status, message = self._native.result()
            self._result = (status, message)
        status, message = self._result
        if status:
            _raise(status, message)
        return self._out


class RingEndpoint:
    """One peer's ring endpoint (see the module docstring).

    Every connection runs jaxodc-auth-v2 (jaxodc.auth) on `secret` with listener "ring", job id
    `group_id` (the communicator's peer group) and, as the claimed rank, the connecting peer's index
    in the ring (checked against the previous peer's); an empty secret only on a loopback host."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, pool_size: int = 2,
                 secret: bytes = b"", timeout_s: float = 30.0, group_id: str = ""):
        if isinstance(secret, str):
            secret = secret.encode()
        self._ep = _C.RingEndpoint(host, int(port), int(pool_size), bytes(secret), float(timeout_s), str(group_id))
        self.pool_size = int(pool_size)
        self.timeout_s = float(timeout_s)
        self._closed = False

    @property
    def address(self) -> str:
        return self._ep.address

    @property
    def handle(self) -> int:
        """Integer that names this endpoint inside jitted code (jaxodc.ops.all_reduce) until close."""
        return int(self._ep.handle)

    @property
    def world(self) -> int:
        return int(self._ep.world)

    def connect_ring(self, ring: list[str], my_index: int, epoch: int) -> None:
        """Connects to ring[my_index+1] and accepts from ring[my_index-1]; epochs must increase.

        Bounded by ``timeout_s`` (TimeoutError naming the peer waited for); :meth:`abort` or
        :meth:`close` from another thread ends it within ~50 ms with :class:`RingAborted`."""
        ring = [str(a) for a in ring]
        status, message = self._ep.connect_ring(ring, int(my_index), int(epoch))
        if status:
            _raise(status, message)

    def set_piece_bytes(self, nbytes: int) -> None:
        """Pipelining granularity (test knob; every peer of a ring must use the same value)."""
        self._ep.set_piece_bytes(int(nbytes))

    def _prepare(self, x, op, quantize, out):
        x = np.asarray(x)
        dt, opc, qc = _codes(x, op, quantize)
        if out is None:
            out = np.empty(x.shape, x.dtype)
        else:
            if not isinstance(out, np.ndarray) or out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError(f"all_reduce: out must be a numpy array of shape {x.shape} and dtype "
                                 f"{x.dtype}")
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError("all_reduce: out must be C-contiguous and writeable")
        xc = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        return xc, out, dt, opc, qc

    def all_reduce(self, x: np.ndarray, op: str = "sum", *, quantize: str | None = None, tag: int = 0,
                   out: np.ndarray | None = None) -> np.ndarray:
        xc, out, dt, opc, qc = self._prepare(x, op, quantize, out)
        status, message = self._ep.all_reduce(_bytes(xc), _bytes(out), xc.size, dt, opc, qc, int(tag))
        if status:
            _raise(status, message)
        return out

    def all_reduce_async(self, x, op: str = "sum", *, quantize=None, tag: int = 0, out=None) -> RingHandle:
        xc, out, dt, opc, qc = self._prepare(x, op, quantize, out)
        native = _C.ring_start(self._ep, _bytes(xc), _bytes(out), xc.size, dt, opc, qc, int(tag))
        return RingHandle(native, out, (xc, out, self), int(tag))

    def abort(self) -> None:
        """Aborts every in-flight operation and any connect_ring in progress; reconnect (new epoch)
        before the next operation."""
        self._ep.abort()

    def set_link(self, peer: str, bandwidth_bytes_per_s: float | None, latency_s: float = 0.0) -> None:
        """Emulates the outgoing link to `peer`: bandwidth cap (None = unlimited) and added latency."""
        self._ep.set_link(str(peer), float(bandwidth_bytes_per_s or 0.0), float(latency_s))

    def measure_bandwidth(self, peer: str, nbytes: int = 4 << 20) -> float:
        """Bytes/s to `peer`: time to stream nbytes to its endpoint until it acknowledges them."""
        try:
            return float(self._ep.measure_bandwidth(str(peer), int(nbytes)))
        except RuntimeError as err:
            raise ConnectionError(f"measure_bandwidth to {peer}: {err}") from None

    def stats(self) -> dict:
        return dict(self._ep.stats())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._ep.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
