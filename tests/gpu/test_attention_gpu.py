"""segment_attention on CUDA: the Pallas flash kernel (impl "pallas", and "auto" where the choice
rule picks it) against the CPU kernel run on the CPU backend of the same process and the dense
reference on the GPU, every element, forward and gradient, in full fp32 and in the reduced dot
modes (TF32, bf16, bf16x3: test_attention's stated tolerances); and its cost following the samples
of a row, not the row (timings printed). All 12 passed on an NVIDIA H200 on 2026-11-28
(docs/gpu.md). Run on the device machine: pytest -m gpu tests/gpu/test_attention_gpu.py -s (not
collected in CI, which has no GPU)."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu import gpu_devices_or_skip
from jaxodc.ops import attention_policy
from jaxodc.ops.attention import _segment_attention
from test_attention import _data, assert_close_in_mode

pytestmark = pytest.mark.gpu
GPU = gpu_devices_or_skip(cuda_build=False)[0]  # Pallas + the CPU kernel: no CUDA handlers needed
CPU = jax.devices("cpu")[0]


def _fwd_bwd(impl, device, precision=None):
    def f(q, k, v, seg, do):
        o, vjp = jax.vjp(lambda q, k, v: _segment_attention(q, k, v, seg, impl=impl, precision=precision), q, k, v)
        return (o, *vjp(do))
    jitted = jax.jit(f)

    def run(*args):
        with jax.default_matmul_precision("highest"):  # fp32, not TF32, unless `precision` says otherwise
            return [np.asarray(x, np.float32) for x in jitted(*(jax.device_put(a, device) for a in args))]
    return run


@pytest.mark.parametrize("Dh,T,H,kinds", [(64, 1000, 4, ["mixed", "full", "padded", "mixed"]),
                                          (128, 700, 2, ["padded", "mixed"]), (24, 333, 3, ["full", "mixed"])])
def test_pallas_on_gpu_matches_cpu_kernel_and_dense(Dh, T, H, kinds):
    q, k, v, seg, do = _data(Dh + T, len(kinds), T, H, Dh, kinds)
    want = _fwd_bwd("kernel", CPU)(q, k, v, seg, do)
    assert (want[0] != 0).all() and all(np.abs(g).max() > 0.1 for g in want[1:])
    dense = _fwd_bwd("dense", GPU)(q, k, v, seg, do)
    for impl in ("pallas", "auto"):
        got = _fwd_bwd(impl, GPU)(q, k, v, seg, do)
        for name, g, w, d in zip(("o", "dq", "dk", "dv"), got, want, dense):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5, err_msg=f"{impl} {name} vs the CPU kernel")
            np.testing.assert_allclose(g, d, rtol=1e-4, atol=2e-5, err_msg=f"{impl} {name} vs dense on the GPU")


def test_auto_follows_the_choice_rule_on_gpu(monkeypatch):
    """Without a crossover entry "auto" is dense on the GPU (no Triton kernel, the [T, T] scores);
    with one that the row fits, the Pallas kernel (bit for bit, Triton in the lowered text)."""
    q, k, v, seg, do = _data(1, 2, 256, 2, 64, ["mixed", "padded"])
    args = [jax.device_put(x, GPU) for x in (q, k, v, seg)]

    def lowered():
        with jax.default_matmul_precision("highest"):
            return jax.jit(lambda *x: _segment_attention(*x, impl="auto")).lower(*args).as_text()

    text = lowered()
    assert "xla.gpu.triton" not in text and "256x256" in text, "auto without a crossover entry is not dense"
    a, d = _fwd_bwd("auto", GPU)(q, k, v, seg, do), _fwd_bwd("dense", GPU)(q, k, v, seg, do)
    for name, x, y in zip(("o", "dq", "dk", "dv"), a, d):  # the same dense maths, fused by XLA as it likes
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=f"auto vs dense: {name}")
    monkeypatch.setitem(attention_policy.CROSSOVER, (attention_policy.generation(GPU.device_kind), 64, "fp32"), 256)
    text = lowered()
    assert "xla.gpu.triton" in text and "256x256" not in text, "auto with a crossover entry is not the Pallas kernel"
    a, p = _fwd_bwd("auto", GPU)(q, k, v, seg, do), _fwd_bwd("pallas", GPU)(q, k, v, seg, do)
    for name, x, y in zip(("o", "dq", "dk", "dv"), a, p):
        np.testing.assert_array_equal(x, y, err_msg=f"auto vs pallas: {name}")


@pytest.mark.parametrize("mode,dtype", [("tf32", "float32"), ("bf16", "bfloat16"), ("bf16", "float32"),
                                        ("bf16x3", "float32")])
def test_dot_modes_on_gpu_match_cpu_kernel(mode, dtype):
    """The Pallas kernel and XLA's dense attention on the GPU, dots in `mode`, against the fp32
    CPU kernel on the same (dtype-rounded) values: within test_attention's 16 u of each tensor's
    largest element, and visibly rounded for TF32 / bf16 (a kernel left in fp32 fails)."""
    q, k, v, seg, do = _data(5, 2, 700, 4, 64, ["mixed", "full"])
    q, k, v, do = (np.asarray(jnp.asarray(x, dtype)) for x in (q, k, v, do))
    want = _fwd_bwd("kernel", CPU)(*(np.asarray(x, np.float32) for x in (q, k, v)), seg, np.asarray(do, np.float32))
    for impl in ("pallas", "dense"):
        got = _fwd_bwd(impl, GPU, precision=mode)(q, k, v, seg, do)
        # XLA's own TF32 need not show (it may round, or keep fp32): only the Pallas kernel's must.
        assert_close_in_mode(got, want, mode, names=[f"{impl} {n}" for n in ("o", "dq", "dk", "dv")],
                             visible=impl == "pallas" or mode == "bf16")


def test_bfloat16_on_gpu():
    q, k, v, seg, do = _data(7, 2, 300, 2, 64, ["mixed", "padded"])
    qb, kb, vb, dob = (np.asarray(jnp.asarray(x, jnp.bfloat16)) for x in (q, k, v, do))
    got = _fwd_bwd("pallas", GPU)(qb, kb, vb, seg, dob)
    want = _fwd_bwd("kernel", CPU)(qb, kb, vb, seg, dob)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-3, err_msg=name)


def _median_ms(step, args, reps=7):
    jax.block_until_ready(step(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def test_cost_follows_samples_on_gpu():
    """One row of T tokens, fwd + bwd: one sample filling it against T/128 samples of 128 tokens.
    The Pallas kernel's time must fall with the samples (ideal 1/64 here, blocks round it up);
    the dense reference's stays (printed for comparison)."""
    B, T, H, Dh = 1, 8192, 8, 64
    rng = np.random.default_rng(0)
    q, k, v, do = (jax.device_put(rng.standard_normal((B, T, H, Dh)).astype(np.float32), GPU) for _ in range(4))
    layouts = {"1 x 8192": np.ones((B, T), np.int32),
               "64 x 128": np.repeat(np.arange(1, 65, dtype=np.int32), 128)[None]}
    ms = {}
    for impl in ("pallas", "dense"):
        step = jax.jit(jax.grad(lambda q, k, v, seg, do, impl=impl: jnp.vdot(
            _segment_attention(q, k, v, seg, impl=impl), do), argnums=(0, 1, 2)))
        for name, seg in layouts.items():
            ms[(impl, name)] = _median_ms(step, (q, k, v, jax.device_put(seg, GPU), do))
    for (impl, name), t in ms.items():
        print(f"COST segment_attention fwd+bwd on {GPU.device_kind}: impl={impl} T={T} H={H} Dh={Dh} "
              f"samples {name}: {t:.2f} ms")
    ratio = ms[("pallas", "64 x 128")] / ms[("pallas", "1 x 8192")]
    print(f"COST pallas 64x128 / 1x8192 = {ratio:.3f} (ideal 1/64 = 0.016); dense: "
          f"{ms[('dense', '64 x 128')] / ms[('dense', '1 x 8192')]:.3f}")
    assert ratio < 0.25, ms


def test_long_packed_row_in_linear_memory():
    """T = 65536 (the dense reference's [H, T, T] scores alone would be 34 GB): 64 samples of 1024
    tokens. Every sample's output and gradient equal that sample run alone."""
    H, Dh, n, s = 2, 64, 64, 1024
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, n * s, H, Dh)).astype(np.float32) for _ in range(4))
    seg = np.repeat(np.arange(1, n + 1, dtype=np.int32), s)[None]
    whole = _fwd_bwd("pallas", GPU)(q, k, v, seg, do)
    for i in (0, 17, n - 1):
        rows = slice(i * s, (i + 1) * s)
        alone = _fwd_bwd("pallas", GPU)(*(x[:, rows] for x in (q, k, v)), seg[:, rows], do[:, rows])
        for name, w, a in zip(("o", "dq", "dk", "dv"), whole, alone):
            np.testing.assert_allclose(w[:, rows], a, rtol=1e-5, atol=1e-6, err_msg=f"{name} of sample {i}")


def test_lm_auto_equals_dense_on_gpu():
    """The LM (rematerialised unit stages) with "auto" attention on the GPU: token losses and
    gradients equal the dense reference's."""
    from jaxodc.balance.packing import pack
    from jaxodc.models.lm import LM, LMConfig
    rng = np.random.default_rng(9)
    samples = [rng.integers(1, 256, size=n).astype(np.int32) for n in (9, 40, 3, 17, 25, 60, 1, 20, 90, 7)]
    batch = jax.device_put(pack(samples, 128, rows=3).as_dict(), GPU)
    models = [LM(LMConfig(d_model=64, n_layers=2, n_heads=4, attention=a)) for a in ("dense", "auto")]
    params = jax.device_put(models[0].init(jax.random.PRNGKey(3)), GPU)
    with jax.default_matmul_precision("highest"):
        (tl_d, g_d), (tl_a, g_a) = (jax.jit(lambda p, b, m=m: (m.token_losses(p, b), jax.grad(m.loss_sum)(p, b)))(
            params, batch) for m in models)
    np.testing.assert_allclose(np.asarray(tl_a), np.asarray(tl_d), rtol=1e-5, atol=1e-5)
    for (path, a), d in zip(jax.tree_util.tree_leaves_with_path(g_a), jax.tree_util.tree_leaves(g_d)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(d), rtol=1e-4, atol=1e-5, err_msg=str(path))
