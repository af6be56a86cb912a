"""Loads the native extension and registers every FFI target it exports with JAX.

Targets come from one `_C.registrations()` dict ({name: {platform: capsule}}). CUDA handlers exist
only when the extension was built with CUDA; JAX keeps registrations for a platform it has no
backend for, so registering never touches (or initialises) a backend — which keeps
`jax.distributed.initialize()` possible after importing jaxodc.
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


@functools.cache
def register_targets() -> tuple[str, ...]:
    """Registers all targets once per process; returns the registered names."""
    names = []
    for name, per_platform in _C.registrations().items():
        for platform, capsule in per_platform.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        names.append(name)
    return tuple(sorted(names))


C = _C
