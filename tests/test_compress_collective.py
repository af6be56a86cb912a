"""TAGC over jax collectives (jaxodc.compress.collective and CollectiveTrainer(compress=...)).

The compressed reduce-scatter runs on host devices of one subprocess (2, 3, 4 ranks) and is checked
element by element against a numpy model of the whole algorithm built on the sketch reference;
the trainer runs on 2 processes (gloo)."""
import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

import sketch_reference as ref
from harness import error_text, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, world, numel, pieces, fraction, ratio, seed, calls)
CASES = [
    # pieces cross the owner boundary, n_d not a multiple of 32 or of the sketch width
    ("cross", 2, 301, ((5, 100), (140, 90)), 0.3, 2.0, 7, 2),
    # everything selected: no dense part at all
    ("all", 3, 999, ((0, 999),), 0.1, 4.0, 1, 2),
    # one owner slice holds every selected element, the other three none
    ("one_owner", 4, 517, ((200, 37),), 0.5, 1.5, 3, 2),
    # no selected piece: the dense psum_scatter alone
    ("none", 3, 100, (), 0.5, 2.0, 0, 1),
    # everything kept, a sketch wide enough to peel it all
    ("wide", 4, 403, ((0, 50), (60, 300)), 1.0, 0.3, 11, 2),
]
EF_CASE = ("ef", 3, 250, ((3, 240),), 0.25, 0.3, 5, 4)  # error feedback over several calls
# the ratio's sketch alone (UnitExchange.union off), too narrow for the summed supports: the median
# estimate runs too
NARROW = ("cross", "all")


def _spec(name, world, numel):
    from jaxodc.modeling.units import UnitSpec
    return UnitSpec(name, 0, ("w",), ((numel,),), ("float32",), None, numel, -(-numel // world) * world, world)


def _plan(name, pieces, fraction, ratio, seed):
    from jaxodc.compress.policy import CompressionPlan
    return CompressionPlan(fraction, ratio, seed, {name: tuple(pieces)} if pieces else {})


def _exchange(case):
    from jaxodc.compress.collective import unit_exchange
    name, world, numel, pieces, fraction, ratio, seed, _ = case
    return unit_exchange(_spec(name, world, numel), _plan(name, pieces, fraction, ratio, seed), union=name not in NARROW)


def _inputs(case):
    name, world, numel, pieces, *_, calls = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    kp = -(-numel // world) * world
    cts = rng.normal(size=(calls, world, kp)).astype(np.float32)
    cts[..., numel:] = 0.0  # padding: the model never produces a gradient there
    nsel = sum(n for _, n in pieces)
    res0 = (0.1 * rng.normal(size=(world, nsel))).astype(np.float32)
    return cts, res0


def _rs_worker(out):
    """Runs every case (and the OR check) on host devices; saves inputs and outputs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxodc.compress.collective import compressed_reduce_scatter, or_scatter
    saved = {}
    for case in CASES + [EF_CASE]:
        name, world = case[:2]
        ex = _exchange(case)
        mesh = Mesh(np.array(jax.devices()[:world]), ("d",))
        one = lambda c, r: tuple(x[None] for x in compressed_reduce_scatter(c[0], r[0], ex, "d"))
        f = jax.jit(jax.shard_map(one, mesh=mesh,
                                  in_specs=(P("d"), P("d")), out_specs=(P("d"), P("d"), P("d")), check_vma=False))
        cts, res = _inputs(case)
        shards, residuals, counts = [], [], []
        r = jnp.asarray(res)
        for c in cts:
            s, r, k = f(jnp.asarray(c), r)
            shards.append(np.asarray(s).reshape(world, -1))
            residuals.append(np.asarray(r).reshape(world, -1))
            counts.append(np.asarray(k).reshape(world, 3))
        saved.update({f"{name}/shards": np.stack(shards), f"{name}/residuals": np.stack(residuals),
                      f"{name}/counts": np.stack(counts)})
    # OR: 3 ranks, each with a random bitmap row per owner (rank, owner, words)
    bits = np.random.default_rng(0).integers(0, 2**32, size=(3, 3, 5), dtype=np.uint32)
    bits[:, :, -1] &= np.uint32(0x0000FFFF)
    mesh = Mesh(np.array(jax.devices()[:3]), ("d",))
    g = jax.jit(jax.shard_map(lambda b: or_scatter(b[0], "d")[None], mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                              check_vma=False))
    saved["or/in"], saved["or/out"] = bits, np.asarray(g(jnp.asarray(bits)))
    np.savez(os.path.join(out, "rs.npz"), **saved)


@pytest.fixture(scope="module")
def rs(tmp_path_factory):
    out = tmp_path_factory.mktemp("rs")
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "support")]),
               XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_cpu_multi_thread_eigen=false")
    p = subprocess.run([sys.executable, __file__, "rs", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return dict(np.load(out / "rs.npz"))


def _selected_mask(world, numel, pieces):
    kp = -(-numel // world) * world
    mask = np.zeros(kp, bool)
    for o, n in pieces:
        mask[o:o + n] = True
    return mask.reshape(world, kp // world)  # [owner, slice position]


def _reference(case, cts, res0):
    """The whole algorithm in numpy, one call after another: (shards, residuals, counts) per call."""
    name, world, numel, pieces, fraction, ratio, seed, calls = case
    mask = _selected_mask(world, numel, pieces)
    n = mask.sum(axis=1)
    N = int(n.max())
    width = max(1, math.ceil(N / (3 * ratio)))
    if name not in NARROW:  # widened to peel W senders' kept elements: 1.3 buckets each
        width = max(width, math.ceil(1.3 * min(N, world * math.ceil(fraction * N)) / 3))
    assert not N or width == _exchange(case).width
    offs = np.concatenate([[0], np.cumsum(n)])
    res = res0.copy()
    outs = []
    for ct in cts:
        slices = ct.reshape(world, world, -1)  # [sender, owner, position]
        shards = slices.sum(axis=0, dtype=np.float32)
        new_res, counts = np.zeros_like(res), np.zeros((world, 3), np.int64)
        for d in range(world):
            if not n[d]:
                continue
            bms, sks = [], []
            for r in range(world):
                kept, rest, bm = ref.sparsify(slices[r, d][mask[d]], res[r, offs[d]:offs[d + 1]], fraction)
                new_res[r, offs[d]:offs[d + 1]] = rest
                counts[r, 2] += ref.unpack_bits(bm, n[d]).sum()  # what sender r kept
                bms.append(np.pad(bm, (0, (N + 31) // 32 - bm.size)))
                sks.append(ref.build(kept, bm, width, seed))
            index = np.bitwise_or.reduce(np.stack(bms), axis=0)
            values, counts[d, :2] = ref.peel(np.sum(sks, axis=0, dtype=np.float32), index, N, seed)
            shards[d][mask[d]] = values[:n[d]]
        res = new_res
        outs.append((shards, res.copy(), counts))
    return outs


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reduce_scatter_matches_numpy(rs, case):
    name, world, numel, pieces = case[:4]
    cts, res0 = _inputs(case)
    mask = _selected_mask(world, numel, pieces)
    for call, (shards, res, counts) in enumerate(_reference(case, cts, res0)):
        got = rs[f"{name}/shards"][call]
        np.testing.assert_array_equal(rs[f"{name}/residuals"][call], res, err_msg=f"{name} call {call}: residual")
        np.testing.assert_array_equal(rs[f"{name}/counts"][call], counts, err_msg=f"{name} call {call}: counts")
        # dense elements: the same sums as an uncompressed psum_scatter; decoded ones up to peeling's rounding
        np.testing.assert_allclose(got[~mask], shards[~mask], rtol=1e-6, atol=1e-6, err_msg=f"{name} call {call}")
        np.testing.assert_allclose(got[mask], shards[mask], rtol=1e-5, atol=2e-5, err_msg=f"{name} call {call}")
    if name == "wide":  # fraction 1 and a wide sketch: every element peeled, the plain sum
        assert rs["wide/counts"][:, :, 1].sum() == 0 and not rs["wide/residuals"].any()
        np.testing.assert_allclose(rs["wide/shards"][1].reshape(-1), cts[1].sum(axis=0), atol=2e-5)
    if name in ("cross", "all"):  # both decoders exercised: peeling and the median estimate
        assert rs[f"{name}/counts"][..., 0].sum() > 0 and rs[f"{name}/counts"][..., 1].sum() > 0


def test_index_is_a_bitwise_or(rs):
    bits = rs["or/in"]
    want = np.stack([np.bitwise_or.reduce(bits[:, d], axis=0) for d in range(3)])
    np.testing.assert_array_equal(rs["or/out"], want)
    assert not np.array_equal(want, bits.sum(axis=0, dtype=np.uint32))  # a sum would not do


def test_error_feedback_conserves_the_gradient(rs):
    """Decoded sums over k calls + every rank's final residual = raw gradients + initial residuals."""
    name, world, numel, pieces = EF_CASE[:4]
    cts, res0 = _inputs(EF_CASE)
    counts = rs["ef/counts"]
    assert counts[..., 1].sum() == 0 and counts[..., 0].sum() > 0  # everything peeled
    mask = _selected_mask(world, numel, pieces).reshape(-1)
    sent = rs["ef/shards"].reshape(len(cts), -1).sum(axis=0)
    final = rs["ef/residuals"][-1].sum(axis=0)  # [selected elements], owner-slice order = unit order
    raw = cts.sum(axis=(0, 1))
    np.testing.assert_allclose(sent[mask] + final, raw[mask] + res0.sum(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sent[~mask], raw[~mask], rtol=1e-6, atol=1e-6)
    assert np.abs(final).max() > 0.1  # something was held back


def test_exchange_layout_and_wire_bytes():
    from jaxodc.compress.collective import dense_wire_bytes, unit_exchange
    ex = unit_exchange(_spec("u", 4, 517), _plan("u", ((200, 37), (300, 10)), 0.5, 1.5, 0))
    assert ex.shard == 130 and ex.selected == ((), ((70, 107),), ((40, 50),), ())
    assert ex.counts == (0, 37, 10, 0) and ex.residual_size == 47
    # widened for the sum: 4 senders keep 19 of 37 each, a union of up to 37 at 1.3 buckets each
    assert ex.width == math.ceil(1.3 * 37 / 3) > math.ceil(37 / 4.5) and ex.words == 2
    assert unit_exchange(_spec("u", 4, 517), _plan("u", ((200, 37), (300, 10)), 0.5, 1.5, 0),
                         union=False).width == math.ceil(37 / 4.5)
    assert ex.wire.compressed == 3 * 4 * (2 + 3 * ex.width)
    assert ex.wire.dense == 3 * 4 * 130 == dense_wire_bytes(_spec("u", 4, 517))
    assert ex.wire.selected_dense == 3 * 4 * 37
    with pytest.raises(ValueError, match="unit 'u': compressed pieces overlap"):
        unit_exchange(_spec("u", 2, 100), _plan("u", ((0, 10), (5, 10)), 0.5, 2.0, 0))
    with pytest.raises(ValueError, match="unit 'u': compressed pieces .* outside its 100 elements"):
        unit_exchange(_spec("u", 2, 100), _plan("u", ((95, 10),), 0.5, 2.0, 0))


def test_default_setting_peels_the_sum_over_ranks():
    """The default setting (5% kept, ratio 10) at W = 2: a sketch sized by the ratio holds 2 x 5%
    at 1.0 bucket per element and leaves most of the union to the median estimate; the exchange's
    width peels all of it (the same kernels compressed_reduce_scatter runs, one owner slice)."""
    import jax.numpy as jnp
    from jaxodc.compress.collective import unit_exchange
    from jaxodc.compress.policy import Compression
    from jaxodc.ops.sketch import sketch_build, sketch_peel, sketch_sparsify
    n, world = 65536, 2
    plan = _plan("u", ((0, n * world),), Compression().fraction, Compression().ratio, 0)
    rng = np.random.default_rng(0)
    common = rng.standard_t(3, n)  # correlated senders, as ranks on one model are
    grads = [(0.5 * common + rng.standard_t(3, n)).astype(np.float32) for _ in range(world)]
    estimated = {}
    for union in (False, True):
        ex = unit_exchange(_spec("u", world, n * world), plan, union=union)
        sketch, bitmap, want = 0.0, 0, 0.0
        for g in grads:
            kept, _, bm = sketch_sparsify(jnp.asarray(g), jnp.zeros(n, jnp.float32), fraction=ex.fraction)
            sketch, bitmap, want = sketch + sketch_build(kept, bm, width=ex.width, seed=0), bitmap | bm, want + kept
        values, counts = sketch_peel(sketch, bitmap, n=n, seed=0)
        estimated[union] = int(counts[1]) / int(counts[0] + counts[1])
        if union:
            np.testing.assert_allclose(values, want, atol=1e-4)
            # still > 4x fewer bytes than the slice sent densely: bitmap + 1.3 x 10% of n buckets
            assert ex.wire.selected_dense / ex.wire.compressed > 5.5
    assert estimated[True] == 0 and estimated[False] > 0.5, estimated


# ---------------------------------------------------------------------------------------------
# CollectiveTrainer(compress=...) on 2 processes.

TW, SIZES, STEPS, MBS = 2, (7, 40, 19, 5), 3, 2


def _kernels(path, shape):
    """Every matrix but layer_2's: a unit with no compressed piece, and units whose bias stays dense."""
    return len(shape) >= 2 and not path.startswith("layer_2/")


def _microbatch(step, rank, j):
    rng = np.random.default_rng([step, rank, j])
    return {"x": rng.normal(size=(4, SIZES[0])).astype(np.float32),
            "y": rng.integers(0, SIZES[-1], 4).astype(np.int32), "mask": np.ones(4, np.float32)}


def trainer_body(ctx):
    from jaxodc.launch.context import init_jax_distributed
    init_jax_distributed(ctx)
    import dataclasses
    import jax
    import optax
    from jaxodc.compress.policy import Compression
    from jaxodc.models.mlp import MLP
    from jaxodc.train.collective import CollectiveTrainer
    from jaxodc.modeling.units import make_layout
    model = MLP(SIZES)
    params = model.init(jax.random.PRNGKey(0))
    layout = make_layout(params, TW, order=model.unit_names)

    def run(compress):
        tr = CollectiveTrainer(model, optax.sgd(0.1), params, compress=compress)
        steps = []
        for s in range(STEPS):
            res = tr.train_minibatch([_microbatch(s, ctx.rank, j) for j in range(MBS)], 4.0 * TW * MBS)
            steps.append((res.loss, res.wire_bytes, res.wire_bytes_selected, res.peeled, res.estimated))
        local = tr.local_shards()
        full = [np.frombuffer(b, np.float32) for b in tr.allgather_bytes(
            np.concatenate([local[n] for n in layout.names]).tobytes())]
        return {"shards": local, "full": np.concatenate(full), "steps": steps,
                "wire": {n: tuple(w) for n, w in tr.gradient_wire.items()},
                "mine": {n: ex.counts[ctx.rank] for n, ex in tr.exchanges.items()}}

    # fraction 1 and a sketch wide enough to peel everything (wider than Compression allows: ratio < 1)
    exact = dataclasses.replace(Compression(fraction=1.0, ratio=2.0, select=_kernels).plan(layout), ratio=0.25)
    out = {"plain": run(None), "exact": run(exact), "default": run(Compression(select=_kernels).plan(layout))}
    frac = Compression(fraction=0.05 if ctx.rank == 0 else 0.1, select=_kernels).plan(layout)
    out["mismatch"] = error_text(lambda: CollectiveTrainer(model, optax.sgd(0.1), params, compress=frac))
    out["one_sided"] = error_text(lambda: CollectiveTrainer(model, optax.sgd(0.1), params,
                                                            compress=exact if ctx.rank == 0 else None))
    return out


@pytest.fixture(scope="module")
def trained():
    return run_ranks(trainer_body, TW, timeout_s=180)


def test_trainer_fraction_one_equals_uncompressed(trained):
    for r, out in enumerate(trained):
        plain, exact = out["plain"], out["exact"]
        for n, a in plain["shards"].items():
            np.testing.assert_allclose(exact["shards"][n], a, rtol=1e-5, atol=1e-6, err_msg=f"rank {r} unit {n}")
        np.testing.assert_allclose([s[0] for s in exact["steps"]], [s[0] for s in plain["steps"]], rtol=1e-5)
        assert set(exact["mine"]) == {"layer_0", "layer_1"}  # layer_2: no compressed piece
        for loss, wire, selected, peeled, estimated in exact["steps"]:
            # every kept element peeled (exact zeros, e.g. padding, are never kept)
            assert estimated == 0 and 0.5 * MBS * sum(exact["mine"].values()) < peeled <= MBS * sum(exact["mine"].values())
            assert wire == MBS * sum(c + d for c, d, _ in exact["wire"].values())
            assert selected == MBS * sum(c for c, _, _ in exact["wire"].values())
        # uncompressed: dense bytes of every unit, nothing compressed or decoded
        # selected: what the default setting would compress, sent dense
        assert all(s[1] == MBS * sum(d for _, d, _ in plain["wire"].values()) and s[3:] == (None,) * 2
                   and s[2] is not None and 0 <= s[2] < s[1] for s in plain["steps"])
        assert plain["wire"]["layer_2"] == exact["wire"]["layer_2"]


def test_trainer_default_setting(trained):
    fulls = [out["default"]["full"] for out in trained]
    np.testing.assert_array_equal(fulls[0], fulls[1])  # every rank holds the same parameters
    assert [s[0] for s in trained[0]["default"]["steps"]] == [s[0] for s in trained[1]["default"]["steps"]]
    plain = trained[0]["plain"]["full"]
    assert np.isfinite(fulls[0]).all() and not np.array_equal(fulls[0], plain)  # compression took effect
    for out in trained:
        d = out["default"]
        # bitmap (1/32) + sketch (1/ratio) of the selected pieces' dense bytes, plus rounding up
        assert sum(c for c, _, _ in d["wire"].values()) < 0.2 * sum(s for _, _, s in d["wire"].values())
        for _, total, selected, peeled, estimated in d["steps"]:
            assert total < out["plain"]["steps"][0][1] and selected > 0 and peeled + estimated > 0


def test_trainer_refuses_mismatched_compression(trained):
    for r, out in enumerate(trained):
        assert out["mismatch"].startswith("ConfigMismatchError"), out["mismatch"]
        assert "ranks disagree on the compression and precision setting: fraction (rank 0: 0.05, rank 1: 0.1)" in out["mismatch"]
        assert "compression (rank 0: 'on', rank 1: 'off')" in out["one_sided"], out["one_sided"]


if __name__ == "__main__":
    if sys.argv[1] == "rs":
        _rs_worker(sys.argv[2])
