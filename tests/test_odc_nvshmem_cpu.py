"""The nvshmem transport on machines without a GPU: what CI can check of it (its data path is in
tests/gpu/test_odc_nvshmem.py). The plugin is built exactly when the build found nvcc and the
nvidia-nvshmem-cu13 wheel, jaxodc._C imports without it and loads it only on demand, load failures
and missing devices give errors naming the rank and its peers, the transport choice, the NVSHMEM job
membership, and a forced nvshmem without a GPU fails cleanly on every rank without leaks."""
import json
import os
import subprocess
import sys

import msgpack
import pytest

from harness import run_ranks
from jaxodc.odc.runtime import NVSHMEM_PLUGIN, PeerInfo, Runtime, choose_transport

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str) -> dict:
    """Runs `code` in a fresh interpreter (the plugin loads once per process); returns its JSON."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_found_nvshmem() -> bool:
    sys.path.insert(0, os.path.join(ROOT, "bazel"))
    try:
        import discover
        return bool(discover.find_cuda() and discover.find_nvshmem())
    finally:
        sys.path.pop(0)


LOAD = """
import json
from jaxodc._native import C
from jaxodc.odc.runtime import load_nvshmem_plugin
def mapped():
    return any("libnvshmem_host" in line for line in open("/proc/self/maps"))
before = mapped()
status = load_nvshmem_plugin()
print(json.dumps({"before": before, "after": mapped(), "status": status, "version": C.odc_nvshmem_version(),
                  "again": load_nvshmem_plugin()}))
"""


def test_plugin_is_built_with_nvshmem_and_loaded_only_on_demand():
    result = run_python(LOAD)
    assert result["before"] is False, result  # importing jaxodc._C never maps NVSHMEM
    if build_found_nvshmem():
        assert os.path.isfile(NVSHMEM_PLUGIN)
        assert result["status"] == "" and result["again"] == "", result  # dlopen works without a GPU
        assert result["after"] is True, result
        assert result["version"].startswith("NVSHMEM 3."), result
    else:
        assert not os.path.exists(NVSHMEM_PLUGIN)
        assert "does not exist" in result["status"] and "nvidia-nvshmem-cu13" in result["status"], result
        assert result["version"] == "" and result["after"] is False, result


BAD_LOADS = """
import json
from jaxodc._native import C
print(json.dumps({"missing": C.odc_nvshmem_load("/nonexistent/_nvshmem_plugin.so"),
                  "not_a_plugin": C.odc_nvshmem_load(C.__file__), "version": C.odc_nvshmem_version()}))
"""


def test_plugin_load_failures_say_why():
    result = run_python(BAD_LOADS)
    assert result["missing"].startswith("dlopen(/nonexistent/_nvshmem_plugin.so): "), result
    assert "No such file" in result["missing"], result
    assert result["not_a_plugin"].endswith("does not export jaxodc_nvshmem_api"), result
    assert result["version"] == "", result


NO_DEVICE = """
import json
from jaxodc._native import C
from jaxodc.odc.runtime import load_nvshmem_plugin
out = {}
rt = C.OdcRuntime(0, 3, "nvcpu%d", [10, 7], 5.0, "127.0.0.1")
def attempt(name, fn):
    try:
        fn()
        out[name] = "no error"
    except C.OdcError as e:
        out[name] = str(e)
attempt("uid_unloaded", rt.nvshmem_uniqueid)
out["load"] = load_nvshmem_plugin()
attempt("uid", rt.nvshmem_uniqueid)
attempt("init", lambda: rt.init_nvshmem(bytes(128), [0, 1, -1]))
attempt("pe", lambda: rt.init_nvshmem(bytes(128), [0, 1]))
out["active"] = rt.nvshmem_active
out["device_bytes"] = rt.stats()["device_bytes"]
rt.close(collective=False)
print(json.dumps(out))
"""


def test_nvshmem_without_a_device_is_a_clear_error():
    out = run_python(NO_DEVICE % os.getpid())
    assert out["uid_unloaded"].startswith("rank 0: nvshmem_uniqueid: "), out
    assert "plugin is not loaded" in out["uid_unloaded"] or "without CUDA" in out["uid_unloaded"], out
    if out["load"] == "":
        assert out["uid"] == "rank 0: nvshmem_uniqueid: this rank has no device (enable_device first)", out
        assert out["init"].startswith("rank 0: nvshmem transport (NVSHMEM job with rank(s) 1): "), out
        assert "no CUDA device block" in out["init"], out
        assert "expected a PE for each of the 3 ranks, got 2" in out["pe"], out
    else:  # no plugin (build without NVSHMEM) or no CUDA build: the same calls still fail clearly
        assert out["uid"].startswith("rank 0: nvshmem_uniqueid: "), out
        assert out["init"].startswith("rank 0: "), out
    assert out["active"] is False and out["device_bytes"] == 0, out


def info(rank, host="h1", device="", nvshmem_error=""):
    return PeerInfo(rank, host, "127.0.0.1", 1000 + rank, 100 + rank, f"/jaxodc_x_{rank}", (10,), device,
                    nvshmem_error)


@pytest.mark.parametrize("me,peer,expect", [
    (info(0, device="GPU-a"), info(1, "h2", "GPU-b"), "nvshmem"),               # other host, both able
    (info(0, device="GPU-a"), info(1, "h2", "GPU-b", "dlopen(x): no"), "tcp"),  # peer lacks the plugin
    (info(0, device="GPU-a", nvshmem_error="no"), info(1, "h2", "GPU-b"), "tcp"),
    (info(0, device="GPU-a"), info(1, "h2"), "tcp"),                            # peer without a device
    (info(0), info(1, "h2", "GPU-b"), "tcp"),
    (info(0, device="GPU-a"), info(1, device="GPU-b"), "cuda_ipc"),             # same host: never nvshmem
    (info(0, device="GPU-a"), info(0, device="GPU-a"), "self"),
])
def test_auto_choice(me, peer, expect):
    assert choose_transport(me, peer, "auto") == expect


def test_forced_nvshmem():
    a, near, far = info(0, device="GPU-a"), info(1, device="GPU-b"), info(2, "h2", "GPU-c")
    assert choose_transport(a, near, "nvshmem") == "nvshmem"  # NVSHMEM also works within a node
    assert choose_transport(a, far, {2: "nvshmem"}) == "nvshmem"
    assert choose_transport(a, far, {1: "nvshmem"}) == "nvshmem"  # rank 2 not named: auto
    assert choose_transport(a, far, {2: "tcp"}) == "tcp"
    with pytest.raises(ValueError, match=r"nvshmem between ranks 0 and 1: rank 1 keeps its server memory on the "
                                         r"host"):
        choose_transport(a, info(1, "h2"), "nvshmem")
    with pytest.raises(ValueError, match=r"nvshmem between ranks 0 and 2: rank 0 keeps its server memory"):
        choose_transport(info(0), far, "nvshmem")
    broken = info(2, "h2", "GPU-c", "dlopen(/x/_nvshmem_plugin.so): libnvshmem_host.so.3: cannot open")
    with pytest.raises(ValueError, match=r"nvshmem between ranks 0 and 2: rank 2 cannot use the nvshmem plugin: "
                                         r"dlopen\(/x/_nvshmem_plugin.so\): libnvshmem_host"):
        choose_transport(a, broken, "nvshmem")
    with pytest.raises(ValueError, match="use auto, shm, tcp, cuda_ipc or nvshmem"):
        choose_transport(a, far, "nccl")


class FakeNative:
    def __init__(self):
        self.calls = []

    def nvshmem_uniqueid(self):
        self.calls.append("uid")
        return b"U" * 128

    def init_nvshmem(self, uid, pe_of_rank):
        self.calls.append(("init", uid, list(pe_of_rank)))


class FakeRendezvous:
    def __init__(self, values):
        self.values = values  # key suffix -> every rank's value

    def allgather(self, key, value, world):
        got = self.values[key.rsplit("/", 1)[1]]
        assert len(got) == world
        return got


def join(infos, transports, rank):
    """What rank `rank` does in Runtime._join_nvshmem, given every rank's transport choices."""
    rt = object.__new__(Runtime)
    rt.rank, rt.world, rt.job_id, rt.transports = rank, len(infos), "j", transports[rank]
    rt._native = FakeNative()
    members = [i.rank for i in infos if i.device_uuid and not i.nvshmem_error]
    uids = [b"U" * 128 if members and r == members[0] else b"" for r in range(len(infos))]
    rdv = FakeRendezvous({"transports": [msgpack.packb(t) for t in transports], "nvshmem_uid": uids})
    return rt._join_nvshmem(infos, rdv), rt._native.calls


def test_nvshmem_job_membership():
    # Ranks 0, 2, 3 can use nvshmem; rank 1 has no device. Rank 0 talks to rank 3 over nvshmem.
    infos = [info(0, "h1", "GPU-a"), info(1, "h1"), info(2, "h2", "GPU-c"), info(3, "h2", "GPU-d")]
    transports = [["self", "shm", "tcp", "nvshmem"], ["shm", "self", "tcp", "tcp"],
                  ["tcp", "tcp", "self", "cuda_ipc"], ["nvshmem", "tcp", "cuda_ipc", "self"]]
    pes = [0, -1, 1, 2]
    for rank in range(4):
        joined, calls = join(infos, transports, rank)
        if rank == 1:  # outside the job: takes part in the exchanges only
            assert (joined, calls) == (False, [])
        else:
            assert joined
            assert calls == (["uid"] if rank == 0 else []) + [("init", b"U" * 128, pes)], (rank, calls)
    # Nobody chose nvshmem: no NVSHMEM job at all.
    plain = [["self", "shm", "tcp", "tcp"], ["shm", "self", "tcp", "tcp"], ["tcp", "tcp", "self", "cuda_ipc"],
             ["tcp", "tcp", "cuda_ipc", "self"]]
    for rank in range(4):
        assert join(infos, plain, rank) == (False, [])
    # Fewer than two able ranks: not even the transport exchange happens (the fake would be asked).
    lonely = [info(0, "h1", "GPU-a"), info(1, "h2")]
    assert join(lonely, [["self", "tcp"], ["tcp", "self"]], 0) == (False, [])


def forced_body(ctx):
    from jaxodc.odc import Runtime
    try:
        Runtime.create([10, 7], ctx, transport="nvshmem", device="auto", timeout_s=10.0)
        error = "none"
    except ValueError as e:
        error = str(e)
    ctx.barrier("tried")
    return error, sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"jaxodc_{ctx.job_id}_"))


def test_forced_nvshmem_without_a_gpu_fails_cleanly_on_every_rank():
    results = run_ranks(forced_body, 2, timeout_s=60)
    for rank, (error, leftover) in enumerate(results):
        assert error.startswith(f"nvshmem between ranks {rank} and {1 - rank}: rank {rank} keeps its server "
                                "memory on the host"), error
        assert leftover == [], leftover  # the segments of both ranks are gone
