"""jaxodc.ops.attention_policy: the dot modes' names and rounding (against numpy), the block table's
lookup, the implementation choice rule and the bench's FLOP count. Pure functions: no kernels."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from jaxodc.ops import attention_policy as ap
from jaxodc.ops.attention_policy import Blocks, choose_impl, dot_mode


def test_dot_mode_follows_default_matmul_precision():
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert (dot_mode(f32), dot_mode(bf16)) == ("tf32", "bf16")  # XLA's GPU default for fp32: TF32
    for name in ("highest", "float32", "F32_F32_F32", lax.Precision.HIGHEST):
        assert dot_mode(f32, name) == dot_mode(bf16, name) == "fp32", name
    for name in ("default", "high", "tensorfloat32", "bfloat16", lax.Precision.HIGH, lax.Precision.DEFAULT):
        assert (dot_mode(f32, name), dot_mode(bf16, name)) == ("tf32", "bf16"), name
    assert dot_mode(f32, "BF16_BF16_F32_X3") == dot_mode(f32, "bf16x3") == "bf16x3"
    assert dot_mode(f32, "BF16_BF16_F32") == dot_mode(f32, "bf16") == "bf16"
    with jax.default_matmul_precision("highest"):
        assert (dot_mode(f32), dot_mode(bf16)) == ("fp32", "fp32")
        assert dot_mode(f32, "tf32") == "tf32"  # an explicit argument wins
    with jax.default_matmul_precision("BF16_BF16_F32_X3"):
        assert dot_mode(f32) == "bf16x3"
    with pytest.raises(ValueError, match="precision 'F16_F16_F32' is not one of"):
        dot_mode(f32, "F16_F16_F32")


def _numpy_product(a, b):
    return a.astype(np.float64) @ b.astype(np.float64).T


def _tf32_truncated(x):
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("pallas,interpret", [(True, True), (False, False)])
def test_mixed_dot_rounds_operands_as_the_mode_says(pallas, interpret):
    """Against float64 numpy products of the operands rounded independently (ml_dtypes' bf16, a
    mask for TF32): equal up to fp32 summation (1e-6 of the row's |a||b|)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((8, 64)).astype(np.float32) * 3 for _ in range(2))
    product = lambda x, y, precision: jnp.einsum("ik,jk->ij", x, y, precision=precision,  # noqa: E731
                                                 preferred_element_type=jnp.float32)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64).T
    exact = _numpy_product(a, b)
    bf = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    want = {"fp32": exact, "bf16": _numpy_product(bf(a), bf(b)),
            # TF32 is emulated only in interpret mode; XLA on CPU computes it in fp32.
            "tf32": _numpy_product(_tf32_truncated(a), _tf32_truncated(b)) if interpret else exact}
    for mode, w in want.items():
        got = np.asarray(ap.mixed_dot(product, jnp.asarray(a), jnp.asarray(b), mode, pallas=pallas, interpret=interpret))
        assert got.dtype == np.float32
        assert (np.abs(got - w) <= 1e-6 * scale).all(), mode
        if mode != "fp32" and (mode == "bf16" or interpret):
            assert np.abs(got - exact).max() > 1e-4 * scale.max(), f"{mode}: operands not rounded"
    # bf16x3: hi*hi + hi*lo + lo*hi leaves lo*lo (~2^-16 relative) and the lo parts' own rounding.
    got = np.asarray(ap.mixed_dot(product, jnp.asarray(a), jnp.asarray(b), "bf16x3", pallas=pallas, interpret=interpret))
    assert (np.abs(got - exact) <= 2.0 ** -14 * scale).all()
    with pytest.raises(ValueError, match="dot mode 'fp16'"):
        ap.mixed_dot(product, jnp.asarray(a), jnp.asarray(b), "fp16", pallas=pallas)


def test_generation_and_blocks_lookup(monkeypatch):
    assert [ap.generation(k) for k in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA B200",
                                       "Tesla V100", None)] == ["hopper", "hopper", "ampere", "blackwell", "*", "*"]
    assert [ap.padded_head(d) for d in (1, 16, 24, 64, 65, 128)] == [16, 16, 32, 64, 128, 128]
    # Today's table: the H200 sweep's entries on Hopper, the kernels' old defaults elsewhere (64-token
    # forward blocks, 32 above head size 64).
    assert ap.blocks_for(64, "bf16", "NVIDIA H200") == Blocks(64, 64, 64, 4, 3)
    assert ap.blocks_for(128, "bf16", "NVIDIA H100 80GB HBM3") == Blocks(64, 32, 32, 4, 3)
    assert ap.blocks_for(64, "fp32", "NVIDIA H200") == Blocks(64, 64, 32)  # not swept
    assert ap.blocks_for(64, "bf16", "NVIDIA A100-SXM4-80GB") == Blocks(64, 64, 32)
    assert ap.blocks_for(128, "tf32", None) == Blocks(32, 32, 32)
    # A sweep's entry wins for its generation / head / mode only; a generation-wide one beats "*".
    monkeypatch.setattr(ap, "BLOCKS", {k: v for k, v in ap.BLOCKS.items() if k[0] == "*"})
    monkeypatch.setitem(ap.BLOCKS, ("hopper", 64, "bf16"), Blocks(128, 64, 64, 8, 3))
    monkeypatch.setitem(ap.BLOCKS, ("hopper", "*", "*"), Blocks(64, 32, 32))
    assert ap.blocks_for(64, "bf16", "NVIDIA H100 80GB HBM3") == Blocks(128, 64, 64, 8, 3)
    assert ap.blocks_for(64, "tf32", "NVIDIA H200") == Blocks(64, 32, 32)  # hopper, any head / mode
    assert ap.blocks_for(128, "bf16", "NVIDIA H200") == Blocks(32, 32, 32)  # ("*", 128) is more specific
    assert ap.blocks_for(64, "bf16", "NVIDIA A100-SXM4-80GB") == Blocks(64, 64, 32)


def test_choose_impl_rule(monkeypatch):
    monkeypatch.setattr(ap, "CROSSOVER", {})
    h200 = "NVIDIA H200"
    # No sweep entry: dense (it cannot be slower than itself) unless its scores outgrow the budget.
    assert choose_impl(8192, 64, "bf16", h200, longest=128) == "dense"
    assert choose_impl(8192, 64, "bf16", h200, B=3, H=8) == "pallas"  # 3*8*8192^2*4 B = 6 GiB > 4 GiB
    assert choose_impl(8192, 64, "bf16", h200, B=2, H=8) == "dense"  # exactly 4 GiB
    assert choose_impl(1024, 64, "bf16", h200, B=1, H=8, dense_score_bytes=1 << 20) == "pallas"
    # With an entry: Pallas iff the longest sample (unknown: T) is at most the crossover.
    ap.CROSSOVER[("hopper", 64, "bf16")] = 2048
    assert choose_impl(8192, 64, "bf16", h200, longest=2048) == "pallas"
    assert choose_impl(8192, 64, "bf16", h200, longest=2049) == "dense"
    assert choose_impl(8192, 64, "bf16", h200) == "dense"
    assert choose_impl(2048, 64, "bf16", h200) == "pallas"
    assert choose_impl(2048, 48, "bf16", "NVIDIA H100 80GB HBM3") == "pallas"  # head 48 runs as 64, H100 = H200
    assert choose_impl(2048, 64, "tf32", h200) == "dense"  # per mode
    assert choose_impl(2048, 64, "bf16", "NVIDIA A100-SXM4-80GB") == "dense"  # per generation
    assert choose_impl(2048, 64, "bf16", None) == "dense"
    ap.CROSSOVER[("hopper", 64, "tf32")] = float("inf")  # never slower
    assert choose_impl(8192, 64, "tf32", h200) == "pallas"


def test_useful_flops_and_peak():
    # One sample of s: q k^T and p v over s(s+1)/2 pairs, 2 FLOPs per multiply-add, per head.
    assert ap.useful_flops([4], H=2, Dh=8, backward=False) == 2 * 2 * 2 * 8 * 10
    assert ap.useful_flops([4, 4], H=1, Dh=8, backward=True) == 3.5 * 2 * (2 * 2 * 8 * 10)
    assert ap.bf16_peak_tflops("NVIDIA H200") == ap.bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert ap.bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0 and ap.bf16_peak_tflops("Tesla V100") is None
