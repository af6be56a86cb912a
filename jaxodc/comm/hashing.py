"""Deterministic parallel hash of arrays and of a shared-state dict ("jaxodc hash v1").

The value depends only on an array's raw bytes (C order) and their length, never on the thread
count or the device: host arrays hash with the native multi-threaded CPU path, arrays on a GPU with
the CUDA kernel; both follow the fixed layout documented in csrc/hash/hash.h.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

import jaxodc._C as _C

__all__ = ["hash_array", "hash_state", "hash_bytes"]


def hash_bytes(data: bytes | bytearray | memoryview | np.ndarray, threads: int = 0) -> int:
    buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    return int(_C.hash_bytes(np.ascontiguousarray(buf).reshape(-1).view(np.uint8), int(threads)))


def _on_gpu(x) -> bool:
    try:
        import jax
    except ImportError:  # pragma: no cover
        return False
    if not isinstance(x, jax.Array):
        return False
    try:
        return any(d.platform == "gpu" for d in x.devices())
    except Exception:  # noqa: BLE001 - deleted or abstract arrays fall back to the host path
        return False


def hash_array(x, *, threads: int = 0) -> int:
    """uint64 hash of the array's bytes; identical for the same bytes on CPU and GPU."""
    if _on_gpu(x) and _C.with_cuda and len(x.devices()) == 1:
        x.block_until_ready()
        if x.size == 0:
            return hash_bytes(b"")
        return int(_C.hash_cuda(x))
    a = np.ascontiguousarray(np.asarray(x))
    if a.dtype == object:
        raise TypeError("hash_array: object arrays have no stable bytes")
    return int(_C.hash_bytes(a.reshape(-1).view(np.uint8), int(threads)))


def hash_state(tree: Mapping, *, threads: int = 0) -> dict[str, int]:
    """{key: hash} for a dict of arrays; nested dicts flatten to 'outer/inner' keys."""
    out: dict[str, int] = {}

    def walk(prefix: str, node):
        if isinstance(node, Mapping):
            for k in sorted(node):
                walk(f"{prefix}/{k}" if prefix else str(k), node[k])
        else:
            out[prefix] = hash_array(node, threads=threads)

    walk("", tree)
    return out
