"""ODC transport selection (shm / tcp / cuda_ipc per peer pair) and the device option on machines
without a GPU: what CI can check of the cuda_ipc transport (its data path is in tests/gpu/)."""
import os

import pytest

from jaxodc.odc.runtime import PeerInfo, choose_transport, resolve_device


def info(rank, host="h1", device=""):
    return PeerInfo(rank, host, "127.0.0.1", 1000 + rank, 100 + rank, f"/jaxodc_x_{rank}", (10,), device)


@pytest.mark.parametrize("me,peer,expect", [
    (info(0, device="GPU-a"), info(1, device="GPU-b"), "cuda_ipc"),  # both on GPUs, same host
    (info(0, device="GPU-a"), info(1, device="GPU-a"), "cuda_ipc"),  # two ranks sharing one GPU
    (info(0, device="GPU-a"), info(1), "shm"),                        # peer keeps host memory only
    (info(0), info(1, device="GPU-b"), "shm"),
    (info(0), info(1), "shm"),
    (info(0, device="GPU-a"), info(1, host="h2", device="GPU-b"), "tcp"),  # other host
    (info(0), info(0), "self"),
])
def test_auto_choice(me, peer, expect):
    assert choose_transport(me, peer, "auto") == expect


def test_overrides():
    a, b, far = info(0, device="GPU-a"), info(1, device="GPU-b"), info(2, host="h2", device="GPU-c")
    assert choose_transport(a, b, "shm") == "shm"
    assert choose_transport(a, b, "tcp") == "tcp"
    assert choose_transport(a, b, {1: "tcp"}) == "tcp"
    assert choose_transport(a, b, {2: "tcp"}) == "cuda_ipc"  # not named: auto
    with pytest.raises(ValueError, match="rank 2 runs on another host"):
        choose_transport(a, far, "cuda_ipc")
    with pytest.raises(ValueError, match="rank 1 keeps its server memory on the host"):
        choose_transport(a, info(1), "cuda_ipc")
    with pytest.raises(ValueError, match="unknown ODC transport 'nvlink' for rank 1"):
        choose_transport(a, b, "nvlink")


def test_resolve_device(monkeypatch):
    assert resolve_device(None, 3) is None
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert resolve_device("auto", 3) is None  # never touches jax's backends on CPU platforms
    with pytest.raises(ValueError, match="rank 3: device must be"):
        resolve_device("gpu0", 3)
    with pytest.raises(TypeError, match="rank 3: device must be"):
        resolve_device(True, 3)


def test_unusable_device_is_a_clear_error():
    from jaxodc._native import C
    rt = C.OdcRuntime(0, 1, f"t{os.getpid()}", [10], 5.0, "127.0.0.1")
    try:
        # No GPU (CI), no CUDA build, or a GPU machine: ordinal 999 is unusable on all of them.
        with pytest.raises(C.OdcError, match=r"rank 0: .*(no usable CUDA device|without CUDA|sees \d+ CUDA device)"):
            rt.enable_device(999)
        assert rt.device == -1 and rt.device_uuid == "" and rt.stats()["device_bytes"] == 0
    finally:
        rt.close()
