"""The nvshmem transport of the ODC runtime on CUDA: 2 processes on one node forcing transport
"nvshmem" (NVSHMEM works within a node too; across nodes `auto` picks it). The bodies are those of
the cuda_ipc tests: gather of every unit exact (fp32, bf16, odc_gather_into), scatter-accumulate with
a random number of pushes per rank (rank 1 none) plus bf16 device and host pushes against numpy, a
second minibatch that overwrites the masters, jax.grad through odc_gather; a peer SIGKILLed before
publishing or after pushing raises an error naming it within the timeout, with no /dev/shm leak.
Run on the device machine: pytest -m gpu tests/gpu/test_odc_nvshmem.py (needs the plugin, i.e. a
build that found the nvidia-nvshmem-cu13 wheel)."""
import json
import os

import pytest

from harness import RankFailure, run_ranks
from test_odc_cuda_ipc import GPU_ENV, SIZES, dying_body, exchange_body

pytestmark = pytest.mark.gpu

# One node: NVSHMEM's bootstrap over loopback, no network transport needed between its PEs.
NVSHMEM_ENV = {**GPU_ENV, "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo", "NVSHMEM_REMOTE_TRANSPORT": "none"}


def test_plugin_is_present():
    from jaxodc.odc.runtime import NVSHMEM_PLUGIN, load_nvshmem_plugin
    assert os.path.isfile(NVSHMEM_PLUGIN), "build jaxodc with the nvidia-nvshmem-cu13 wheel installed"
    assert load_nvshmem_plugin() == ""


def test_exchange_over_nvshmem():
    results = run_ranks(exchange_body, 2, args=("nvshmem", "auto"), timeout_s=300, env=NVSHMEM_ENV)
    padded_max = max(-(-n // 2) * 2 for n in SIZES) * 4
    for rank, out in enumerate(results):
        assert out["transports"][rank] == "self"
        assert out["transports"][1 - rank] == "nvshmem", out
        assert out["device"] is not None, out
        assert out["device_bytes"] > 0, out
        assert out["slot_bytes"] <= padded_max, out
        assert out["pushes"] > 0, out


@pytest.mark.parametrize("mode", ["gather", "push"])
def test_peer_killed_over_nvshmem_raises_naming_it(tmp_path, mode):
    report = tmp_path / "rank0.json"
    with pytest.raises(RankFailure) as failure:
        run_ranks(dying_body, 2, args=(mode, str(report), "nvshmem", "nvshmem"), timeout_s=150, env=NVSHMEM_ENV)
    assert "rank 1" in str(failure.value)
    result = json.loads(report.read_text())
    assert result["error"] != "none", result
    # The control path is tcp: a dead owner closes the connection, a dead client never says done.
    assert "rank 1" in result["message"], result
    assert result["seconds"] < 25, result  # within the runtime's 20 s timeout, never a hang
    assert result.get("leftover", []) == [], result
