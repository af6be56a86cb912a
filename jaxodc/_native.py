"""Loads the native extension and registers every FFI target it exports with JAX.

Targets come from one `_C.registrations()` dict ({name: {platform: capsule}}). CUDA handlers are
registered only when the extension was built with CUDA and JAX has a CUDA backend.
"""
from __future__ import annotations

import functools

import jax

try:
    from jaxodc import _C  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "jaxodc's native extension `jaxodc._C` is not built. Run `pip install -e .` (or "
        "`python setup.py build_ext --inplace`) in the jaxodc checkout.") from err


def _has_cuda_backend() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@functools.cache
def register_targets() -> tuple[str, ...]:
    """Registers all targets once per process; returns the registered names."""
    names = []
    cuda = _C.with_cuda and _has_cuda_backend()
    for name, per_platform in _C.registrations().items():
        for platform, capsule in per_platform.items():
            if platform == "CUDA" and not cuda:
                continue
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        names.append(name)
    return tuple(sorted(names))


C = _C
