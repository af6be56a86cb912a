"""GPU test modules start with `DEVICES = gpu_devices_or_skip()`."""
import jax
import pytest


def gpu_devices_or_skip(cuda_build: bool = True) -> list:
    """The GPU devices; skips the calling test module without a GPU or, if `cuda_build`, a CUDA
    build of jaxodc (the Pallas attention tests need only jax's GPU backend)."""
    from jaxodc import _C
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        gpus = []
    if not gpus or (cuda_build and not _C.with_cuda):
        pytest.skip("needs a CUDA GPU and a CUDA build of jaxodc", allow_module_level=True)
    return gpus
