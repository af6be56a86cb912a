"""segment_attention: the variable-length CPU kernel (every instruction set this CPU runs) against
the dense masked reference, the dense reference against a float64 numpy loop, and the GPU's Pallas
flash kernel (in Pallas interpret mode here) against the CPU kernel, in full fp32 and in each
reduced-precision dot mode (tests/test_attention_policy.py: the modes, blocks and choice rule)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxodc import _C
from jaxodc.ops import segment_attention
from jaxodc.ops import attention_pallas, attention_policy
from jaxodc.ops.attention import ISAS, _segment_attention
from jaxodc.ops.attention_policy import Blocks
from jaxodc.balance.packing import pack
from jaxodc.models.lm import LM, LMConfig

AVAILABLE = [ISAS.index(name) + 1 for name in _C.attention_isas()]


def _layout(rng, kinds, T):
    """[len(kinds), T] segment ids, one row per kind."""
    rows = []
    for kind in kinds:
        if kind == "full":  # one sample fills the row
            rows.append(np.full(T, 3, np.int32))
            continue
        lens, left = [], T - (rng.integers(1, T // 4) if kind == "padded" else 0)
        while left > 0:
            s = int(min(left, rng.choice([1, 2, rng.integers(3, 24), rng.integers(24, 90)])))
            lens.append(s)
            left -= s
        ids = np.concatenate([np.full(s, n + 1, np.int32) for n, s in enumerate(lens)])
        rows.append(np.pad(ids, (0, T - len(ids))))  # padding (0) at the end
    return np.stack(rows)


def _data(seed, B, T, H, Dh, kinds):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((B, T, H, Dh)).astype(np.float32) for _ in range(4))
    return q, k, v, _layout(rng, kinds, T), do


def _fwd_bwd(impl, isa=0, precision=None, **kw):
    def f(q, k, v, seg, do):
        o, vjp = jax.vjp(lambda q, k, v: _segment_attention(q, k, v, seg, impl=impl, isa=isa, precision=precision,
                                                            **kw), q, k, v)
        return (o, *vjp(do))
    return jax.jit(f)


# Unit roundoff of the dots' operands per dot mode: bf16 keeps 8 significant bits (round to
# nearest: 2^-9), TF32 11 bits (truncated, the worse of the ways a tensor core may read fp32:
# 2^-10), bf16x3 about 16 (hi + lo; the dropped lo * lo term is ~2^-18), fp32 24.
UNIT = {"bf16": 2.0 ** -9, "tf32": 2.0 ** -10, "bf16x3": 2.0 ** -16, "fp32": 2.0 ** -24}


def assert_close_in_mode(got, want, mode, names=("o", "dq", "dk", "dv"), visible=True):
    """Every element within 16 u of the tensor's largest element of the fp32 reference, u = the
    mode's unit roundoff. Why 16: the longest chain, dq = (p * (do v^T - delta)) k, passes three
    rounded products after exp2 has scaled the score's error by |s| (a few units here); the errors
    measured on these shapes are 1-4 u. And the error must be visible (> u / 16 for reduced modes):
    a kernel that silently kept fp32 dots would fail."""
    for name, g, w in zip(names, got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale, u = np.abs(w).max(), UNIT[mode]
        err = np.abs(g - w)
        assert err.max() <= 16 * u * scale, f"{name} ({mode}): max error {err.max() / scale:.2e} x max|ref| > 16 u"
        if visible and mode in ("bf16", "tf32"):
            assert err.max() > u / 16 * scale, f"{name} ({mode}): error {err.max() / scale:.1e} too small: not rounded?"


def _numpy_reference(q, k, v, seg):
    """float64 loop: token i attends to j <= i of its own contiguous run; padding only to itself."""
    B, T, H, Dh = q.shape
    out = np.zeros((B, T, H, Dh))
    for b in range(B):
        for i in range(T):
            if seg[b, i] == 0:
                keys = [i]
            else:
                j = i
                while j > 0 and seg[b, j - 1] == seg[b, i]:
                    j -= 1
                keys = list(range(j, i + 1))
            for h in range(H):
                s = np.array([q[b, i, h] @ k[b, j, h] for j in keys], np.float64) / np.sqrt(Dh)
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ v[b, keys, h].astype(np.float64)
    return out


def test_dense_reference_matches_numpy():
    q, k, v, seg, _ = _data(0, 2, 23, 2, 8, ["padded", "mixed"])
    seg[1, 5:9] = 1  # an id reused by a later run is a separate sample
    seg[1, 9:12] = 0  # padding between samples
    ref = _numpy_reference(q, k, v, seg)
    for impl in ("dense", "kernel"):
        got = np.asarray(jax.jit(lambda *a: segment_attention(*a, impl=impl))(q, k, v, seg))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=impl)


@pytest.mark.parametrize("Dh,T,H", [(16, 173, 3), (32, 131, 2), (64, 150, 2)])
def test_kernel_matches_dense(Dh, T, H):
    q, k, v, seg, do = _data(Dh, 4, T, H, Dh, ["mixed", "full", "padded", "mixed"])
    want = [np.asarray(x) for x in _fwd_bwd("dense")(q, k, v, seg, do)]
    assert (want[0] != 0).all() and all(np.abs(g).max() > 0.1 for g in want[1:])
    for isa in AVAILABLE:
        got = _fwd_bwd("kernel", isa)(q, k, v, seg, do)
        for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
            tol = dict(rtol=1e-5, atol=1e-6) if name == "o" else dict(rtol=2e-5, atol=5e-6)
            np.testing.assert_allclose(np.asarray(g), w, **tol, err_msg=f"{name} isa={ISAS[isa - 1]}")


def test_run_layout_matches_numpy():
    rng = np.random.default_rng(11)
    seg = _layout(rng, ["mixed", "padded", "full"], 45)
    seg[0, 3:6] = seg[0, 0]  # an id reused after another run: a run of its own
    r, start, end = (np.asarray(x) for x in attention_pallas.layout(seg, 64))
    for b in range(seg.shape[0]):
        row = np.pad(seg[b], (0, 64 - 45))
        for t in range(64):
            lo = t
            while row[t] != 0 and lo > 0 and row[lo - 1] == row[t]:
                lo -= 1
            hi = t + 1
            while row[t] != 0 and hi < 64 and row[hi] == row[t]:
                hi += 1
            assert (start[b, t], end[b, t]) == (lo, hi), (b, t)
            assert (r[b, lo:hi] == r[b, t]).all() and (lo == 0 or r[b, lo - 1] < r[b, t])


# Interpret mode is slow: small rows, but long enough for samples to cross several blocks (the
# kernels skip the blocks a sample does not reach), and head sizes that need padding.
@pytest.mark.parametrize("Dh,T,H,kinds", [(16, 150, 2, ["mixed", "full", "padded"]), (24, 70, 1, ["padded", "mixed"]),
                                          (80, 40, 1, ["mixed"])])
def test_pallas_kernel_in_interpret_mode_matches_cpu_kernel(Dh, T, H, kinds):
    q, k, v, seg, do = _data(Dh + T, len(kinds), T, H, Dh, kinds)
    if len(kinds) == 3:
        seg[0, 20:120] = 99  # one sample across three forward and four backward blocks
    want = [np.asarray(x) for x in _fwd_bwd("kernel")(q, k, v, seg, do)]
    assert (want[0] != 0).all() and all(np.abs(g).max() > 0.1 for g in want[1:])
    got = _fwd_bwd("pallas", precision="highest")(q, k, v, seg, do)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=5e-6, err_msg=name)
    # The log-sum-exp it saves for the backward is the dense reference's.
    from jaxodc.ops.attention import _dense
    blocks = attention_policy.blocks_for(attention_policy.padded_head(Dh), "fp32", None)
    lse = jax.jit(lambda *a: attention_pallas.forward(*a, interpret=True, mode="fp32", blocks=blocks)[1])(q, k, v, seg)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(_dense(q, k, v, seg)[1]), rtol=1e-5, atol=1e-5)


# The reduced-precision dot modes, interpreted (TF32's rounding emulated), against the fp32 CPU
# kernel: one row with a sample across several blocks, one with padding; one case with unequal,
# non-default blocks (what a sweep entry may hold).
@pytest.mark.parametrize("mode,dtype,blocks", [("tf32", "float32", None), ("bf16", "float32", None),
                                               ("bf16", "bfloat16", None), ("bf16x3", "float32", Blocks(32, 16, 16))])
def test_pallas_dot_modes_in_interpret_mode_match_cpu_kernel(mode, dtype, blocks):
    q, k, v, seg, do = _data(21, 2, 100, 2, 16, ["mixed", "padded"])
    seg[0, 10:80] = 77  # one sample across two forward blocks (three with 32-token ones)
    if dtype == "bfloat16":  # the reference computes in fp32 from the same bf16 values
        q, k, v, do = (np.asarray(jnp.asarray(x, jnp.bfloat16)) for x in (q, k, v, do))
    want = _fwd_bwd("kernel")(*(np.asarray(x, np.float32) for x in (q, k, v)), seg, np.asarray(do, np.float32))
    assert all(np.abs(np.asarray(w)).max() > 0.1 for w in want)
    # precision None is the dtype's default mode: TF32 for fp32 inputs, bf16 for bf16 inputs.
    default = {"float32": "tf32", "bfloat16": "bf16"}[dtype]
    got = _fwd_bwd("pallas", precision=None if mode == default else mode, blocks=blocks)(q, k, v, seg, do)
    assert all(g.dtype == jnp.dtype(dtype) for g in got)
    assert_close_in_mode(got, want, mode)


def test_pallas_kernel_bfloat16_padding_sees_itself():
    q, k, v, seg, do = _data(12, 1, 40, 2, 16, ["padded"])
    seg[0, 30:] = 0
    qb, kb, vb, dob = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
    o = np.asarray(_fwd_bwd("pallas")(qb, kb, vb, seg, dob)[0], np.float32)  # bf16 dots
    np.testing.assert_array_equal(o[0, 30:], np.asarray(vb, np.float32)[0, 30:])  # padding sees itself only


def test_dense_follows_the_dot_mode():
    """XLA's dense path with bf16 dots (operands rounded) against the fp32 CPU kernel; in fp32
    ("highest") equal to it up to summation order."""
    q, k, v, seg, do = _data(22, 2, 60, 2, 16, ["mixed", "padded"])
    want = _fwd_bwd("kernel")(q, k, v, seg, do)
    assert_close_in_mode(_fwd_bwd("dense", precision="bf16")(q, k, v, seg, do), want, "bf16")
    for g, w in zip(_fwd_bwd("dense", precision="highest")(q, k, v, seg, do), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=5e-6)


_H200 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="gpu"))


def _lowered_for_h200(impl, q, k, v, seg, do, **kw):
    with jax.sharding.use_abstract_mesh(_H200):
        return _fwd_bwd(impl, **kw).trace(q, k, v, seg, do).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("precision", attention_policy.MODES)
def test_pallas_lowers_to_triton_in_every_dot_mode(precision):
    """Lowered for an H200 from this CPU-only machine (Pallas lowers to Triton here; PTX is made on
    the GPU): two Triton kernels, for fp32 and bf16 inputs, no [T, T] score matrix."""
    q, k, v, seg, do = _data(13, 2, 333, 2, 24, ["mixed", "padded"])
    for dt in (jnp.float32, jnp.bfloat16):
        text = _lowered_for_h200("pallas", *(jnp.asarray(x, dt) for x in (q, k, v)), seg, jnp.asarray(do, dt),
                                 precision=precision)
        assert text.count("custom_call @__gpu$xla.gpu.triton") == 2, (precision, dt)
        assert "jaxodc_varlen_attention" not in text and "333x333" not in text


def test_auto_on_cuda_follows_the_choice_rule(monkeypatch):
    """"auto" lowered for an H200: dense while the crossover table has no entry for it; the two
    Triton kernels once it has one that the row's longest sample fits (the hint or, unknown, T)."""
    q, k, v, seg, do = _data(13, 2, 333, 2, 24, ["mixed", "padded"])
    triton = lambda text: text.count("custom_call @__gpu$xla.gpu.triton")  # noqa: E731
    text = _lowered_for_h200("auto", q, k, v, seg, do)
    assert triton(text) == 0 and "333x333" in text and "jaxodc_varlen_attention" not in text
    monkeypatch.setitem(attention_policy.CROSSOVER, ("hopper", 32, "tf32"), 100)
    assert triton(_lowered_for_h200("auto", q, k, v, seg, do, longest=90)) == 2
    assert triton(_lowered_for_h200("auto", q, k, v, seg, do)) == 0  # longest unknown: maybe 333 > 100
    assert triton(_lowered_for_h200("auto", q, k, v, seg, do, precision="highest", longest=90)) == 0  # no fp32 entry


def test_padding_attends_to_itself_only():
    q, k, v, seg, do = _data(5, 1, 40, 2, 16, ["padded"])
    seg[0, 30:] = 0
    o, dq, dk, dv = (np.asarray(x) for x in _fwd_bwd("kernel")(q, k, v, seg, do))
    pad = seg[0] == 0
    np.testing.assert_array_equal(o[0, pad], v[0, pad])
    np.testing.assert_array_equal(dv[0, pad], do[0, pad])
    assert not dq[0, pad].any() and not dk[0, pad].any()
    # Real tokens neither see the padding's q/k/v nor send it gradient.
    q2, k2, v2 = (x.copy() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[0, pad] = 7.0
    o2, dq2, dk2, dv2 = (np.asarray(x) for x in _fwd_bwd("kernel")(q2, k2, v2, seg, do))
    for a, b in ((o, o2), (dq, dq2), (dk, dk2), (dv, dv2)):
        np.testing.assert_array_equal(a[0, ~pad], b[0, ~pad])


def test_auto_is_the_kernel_on_cpu():
    q, k, v, seg, do = _data(6, 2, 50, 2, 16, ["mixed", "padded"])
    for a, b in zip(_fwd_bwd("auto")(q, k, v, seg, do), _fwd_bwd("kernel")(q, k, v, seg, do)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_inputs():
    q, k, v, seg, do = _data(7, 2, 70, 2, 32, ["mixed", "padded"])
    qb, kb, vb, dob = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
    got = _fwd_bwd("kernel")(qb, kb, vb, seg, dob)
    # Both compute in float32 from the same bf16 values: they differ by float32 rounding, which the
    # final cast to bfloat16 may turn into one bf16 ulp.
    want = _fwd_bwd("dense", precision="highest")(qb, kb, vb, seg, dob)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.dtype == jnp.bfloat16, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-3,
                                   err_msg=name)
    ref32 = _fwd_bwd("dense", precision="highest")(*(np.asarray(x, np.float32) for x in (qb, kb, vb)), seg, np.asarray(dob, np.float32))
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(ref32[0]), rtol=1e-2, atol=1e-2)


def test_vmap_runs_the_kernel_per_element():
    q, k, v, seg, _ = _data(8, 3, 33, 2, 16, ["mixed", "padded", "full"])
    want = segment_attention(q, k, v, seg, impl="dense")
    for impl in ("kernel", "auto"):
        f = lambda q, k, v, s: segment_attention(q[None], k[None], v[None], s[None], impl=impl)[0]  # noqa: E731
        got = jax.jit(jax.vmap(f))(q, k, v, seg)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=impl)


def test_lm_kernel_equals_dense_on_a_packed_batch():
    rng = np.random.default_rng(9)
    samples = [rng.integers(1, 256, size=n).astype(np.int32) for n in (9, 40, 3, 17, 25, 60, 1, 20)]
    batch = pack(samples, 64, rows=3).as_dict()
    assert (batch["segment_ids"] == 0).any() and (batch["segment_ids"].max(axis=1) > 1).any()
    dense, kernel = LM(LMConfig(d_model=32, n_layers=1, n_heads=2, attention="dense")), LM(
        LMConfig(d_model=32, n_layers=1, n_heads=2, attention="kernel"))
    params = dense.init(jax.random.PRNGKey(3))
    (tld, gd), (tlk, gk) = (jax.jit(lambda p, b, m=m: (m.token_losses(p, b), jax.grad(m.loss_sum)(p, b)))(params, batch)
                            for m in (dense, kernel))  # one compile per model: the machine is shared
    np.testing.assert_allclose(np.asarray(tlk), np.asarray(tld), rtol=1e-5, atol=1e-6)
    assert np.asarray(tld)[batch["loss_mask"] > 0].min() > 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(gd), jax.tree_util.tree_leaves(gk)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6, err_msg=str(path))
    with pytest.raises(ValueError, match="attention='flash'"):
        LM(LMConfig(attention="flash"))


def test_bad_inputs_name_the_argument():
    q = jnp.zeros((2, 8, 2, 16))
    seg = jnp.ones((2, 8), jnp.int32)
    cases = [
        ((q[0], q[0], q[0], seg), ValueError, r"q must be \[B, T, H, Dh\], got \[8, 2, 16\]"),
        ((q, q[:, :7], q, seg), ValueError, r"k must be \[B, T, H, Dh\] like q \[2, 8, 2, 16\], got \[2, 7, 2, 16\]"),
        ((q, q, q.astype(jnp.float16), seg), TypeError, r"v must be float32 or bfloat16, got float16\[2, 8, 2, 16\]"),
        ((q, q, q.astype(jnp.bfloat16), seg), TypeError, r"v is bfloat16 but q is float32"),
        ((q, q, q, seg[:, :5]), ValueError, r"segment_ids must be integer \[B, T\] = \[2, 8\], got int32\[2, 5\]"),
        ((q, q, q, seg.astype(jnp.float32)), ValueError, r"segment_ids must be integer"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            segment_attention(*args)
    with pytest.raises(ValueError, match="impl must be one of"):
        segment_attention(q, q, q, seg, impl="flash")
    # The handlers check too (named argument and shape), for callers that reach them directly.
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((2, 2, 8), jnp.float32))
    call = jax.ffi.ffi_call("jaxodc_varlen_attention_fwd", out)
    bad = [((q, q, q[:, :, :1], seg), r"v must be float32 \[B, T, H, Dh\] like q = \[2, 8, 2, 16\], got float32\[2, 8, 1, 16\]"),
           ((q, q, q, seg.astype(jnp.float32)), r"segment_ids must be int32 \[B, T\] = \[2, 8\], got float32\[2, 8\]"),
           ((q.astype(jnp.bfloat16), q, q, seg), r"q must be float32 \[B, T, H, Dh\], got bfloat16\[2, 8, 2, 16\]")]
    for args, msg in bad:
        with pytest.raises(Exception, match=msg):
            jax.block_until_ready(call(*args, isa=np.int64(0)))
    with pytest.raises(Exception, match="instruction set id 9 is not available"):
        jax.block_until_ready(call(q, q, q, seg, isa=np.int64(9)))
