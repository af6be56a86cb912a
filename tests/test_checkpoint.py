"""Checkpoints of the sharded trainers (jaxodc.train.checkpoint) on 2 processes, both comm modes:
the round trip is bit-exact (every shard and optimizer-state element), a run resumed from a
checkpoint by a fresh trainer (and fresh ODC runtime) ends bit-identical to an uninterrupted run,
restoring into a runtime that already trained works too, and bad checkpoints (other world size,
layout, optimizer, a damaged file, a missing one on one rank only) are refused on every rank with
an error naming the rank and what differs. A save interrupted before its commit leaves the
previous checkpoint intact. Compressed runs (TAGC) keep their error-feedback residuals: a
resumed compressed run is bit-identical too.

Bit-exact ODC runs: an owner adds its clients' pushes in arrival order, and fp32 sums of three or
more terms depend on that order. Here every unit gets at most two pushes per minibatch (the first
add to the zeroed accumulator is exact, so two terms commute), so the uninterrupted run itself is
deterministic and any difference would come from the checkpoint."""
import os

import numpy as np
import pytest

from harness import error_text, run_ranks

pytestmark = pytest.mark.timeout(900)  # the module fixture trains both comms at 2 ranks

W, K, M = 2, 2, 2  # save after K minibatches, then M more
SIZES = (8, 16, 16, 4)
# microbatches per rank at each step (ODC: free counts, a rank with none; collective: equal)
COUNTS = {"odc": [(1, 1), (2, 0), (0, 1), (1, 1)], "collective": [(1, 1)] * 4}


def _model(sizes=SIZES):
    import jax
    from jaxodc.models.mlp import MLP
    model = MLP(sizes)
    return model, model.init(jax.random.PRNGKey(0))


def _optimizer():
    """A chain with state of every kind the placed optimizer keeps (optim.placement): replicated
    counts and flags, parameter pieces (momentum, accumulated gradients), replicated factored
    statistics (Adafactor), a whole-leaf update (Muon's Newton-Schulz on the gathered matrix)."""
    import jax
    import optax

    def label(path, x):
        if x.ndim == 1:
            return "vector"
        return "muon" if "layer_1" in jax.tree_util.keystr(path) else "factored"
    return optax.MultiSteps(optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.multi_transform({"muon": optax.contrib.muon(1e-2), "factored": optax.adafactor(1e-2, min_dim_size_to_factor=2),
                               "vector": optax.contrib.schedule_free_adamw(1e-2)},
                              lambda p: jax.tree_util.tree_map_with_path(label, p))), 2)


def _microbatch(step, rank, j):
    rng = np.random.default_rng([step, rank, j])
    mask = np.ones(4, np.float32)
    mask[rng.integers(0, 4)] = 0.0
    return {"x": rng.normal(size=(4, SIZES[0])).astype(np.float32),
            "y": rng.integers(0, SIZES[-1], 4).astype(np.int32), "mask": mask}


def _run(state, comm, steps):
    for s in steps:
        counts = COUNTS[comm][s]
        ntok = sum(float(_microbatch(s, r, j)["mask"].sum()) for r in range(W) for j in range(counts[r]))
        state.train_minibatch([_microbatch(s, state.rank, j) for j in range(counts[state.rank])], ntok)


def _snapshot(state):
    import jax
    return state.local_shards(), [np.array(x) for x in jax.tree_util.tree_leaves(state.local_opt_state())]


def _logical(tr, snap):
    """A snapshot in layout-free form: every unit's parameters and the optimizer state's
    parameter pieces as whole leaves (gathered from every rank), then the other optimizer leaves;
    collective."""
    from jaxodc.train.checkpoint import sharded_state_leaves
    from jaxodc.modeling.units import leaf_views
    from jaxodc.optim.pieces import assemble_host
    shards, leaves = snap
    params = sharded_state_leaves(tr)
    vecs = [shards[n] for n in tr.layout.names] + [x for x, p in zip(leaves, params) if p is not None]
    got = tr.allgather_obj([np.asarray(v, np.float32).tobytes() for v in vecs])
    every = [[np.frombuffer(g[k], np.float32) for g in got] for k in range(len(vecs))]
    out = []
    for k, n in enumerate(tr.layout.names):
        out += [np.asarray(p) for p in leaf_views(tr.layout[n], np.concatenate(every[k]))]
    tree = tr.program.param_tree()
    out += [assemble_host(tree, tr.layout, p, every[k]).reshape(-1)
            for k, p in enumerate((p for p in params if p is not None), start=len(tr.layout.names))]
    return out + [x for x, p in zip(leaves, params) if p is None]


def checkpoint_body(ctx, root):
    from jaxodc.launch.context import init_jax_distributed
    init_jax_distributed(ctx)
    import optax
    from jaxodc.train.api import sharded_step

    model, params = _model()
    out = {}
    for comm in ("collective", "odc"):
        step = sharded_step(model, _optimizer(), comm=comm)
        ck = os.path.join(root, comm)
        a = step.init(params, ctx=ctx)  # K, save, M more: the uninterrupted run
        _run(a, comm, range(K))
        a.save(ck)
        saved = _snapshot(a)
        saved_logical = _logical(a, saved)
        _run(a, comm, range(K, K + M))
        full = _snapshot(a)
        a.close()
        c = step.init(params, ctx=ctx)  # fresh trainer (and runtime): restore, M more
        restored_step = c.restore(ck)
        restored = _snapshot(c)
        _run(c, comm, range(K, K + M))
        resumed = _snapshot(c)
        # restore again into the same trainer, which has trained (ODC: runtime at a later version)
        c.restore(ck)
        _run(c, comm, range(K, K + M))
        again = _snapshot(c)
        c.close()
        out[comm] = dict(full=full, saved=saved, restored=restored, resumed=resumed, again=again, logical=saved_logical,
                         step=restored_step, files=sorted(os.listdir(ck)))

    # The collective checkpoint (per_leaf units) restores into ODC (contiguous units), resharded.
    odc = sharded_step(model, _optimizer(), comm="odc")
    e = odc.init(params, ctx=ctx)
    e.restore(os.path.join(root, "collective"))
    out["cross"] = _logical(e, _snapshot(e))
    out["cross_layouts"] = (e.layout.sharding, out["collective"]["saved"] and sharded_step(
        model, _optimizer(), comm="collective").layout(params, ctx.world).sharding)

    # Refusals. One rank's checkpoint is missing: every rank raises, the trainer is unchanged.
    before = _snapshot(e)
    target = os.path.join(root, "odc") if ctx.rank == 0 else os.path.join(root, "missing")
    out["missing"] = error_text(lambda: e.restore(target))
    out["unchanged"] = all(np.array_equal(before[0][n], x) for n, x in e.local_shards().items())
    # A damaged file on rank 1.
    if ctx.rank == 0:
        import shutil
        shutil.copytree(os.path.join(root, "odc"), os.path.join(root, "damaged"))
        fn = [f for f in os.listdir(os.path.join(root, "damaged")) if f.startswith("rank1-")][0]
        with open(os.path.join(root, "damaged", fn), "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    ctx.barrier("damaged copy made")
    out["damaged"] = error_text(lambda: e.restore(os.path.join(root, "damaged")))
    e.close()
    # Another optimizer, another layout.
    s = sharded_step(model, optax.sgd(0.1), comm="odc").init(params, ctx=ctx)
    out["optimizer"] = error_text(lambda: s.restore(os.path.join(root, "odc")))
    s.close()
    model2, params2 = _model((8, 16, 12, 4))
    s = sharded_step(model2, _optimizer(), comm="odc").init(params2, ctx=ctx)
    out["layout"] = error_text(lambda: s.restore(os.path.join(root, "odc")))
    s.close()
    return out


def _matrices(path, shape):
    return len(shape) == 2


def compressed_body(ctx, root):
    """Compressed runs (TAGC, error feedback) of both comms: K minibatches, save, M more; a fresh
    trainer restores and runs the same M. ODC sums with the exact sum (reproducible=True), so the
    uninterrupted run is deterministic whatever the pushes' arrival order."""
    from jaxodc.launch.context import init_jax_distributed
    init_jax_distributed(ctx)
    import json
    import optax
    from jaxodc.compress import Compression
    from jaxodc.train.api import sharded_step

    model, params = _model()
    compress = Compression(fraction=0.25, ratio=4.0, select=_matrices)
    out = {}
    for comm in ("collective", "odc"):
        step = sharded_step(model, optax.adam(1e-2), comm=comm, compress=compress, reproducible=True)
        ck = os.path.join(root, comm)
        a = step.init(params, ctx=ctx)
        _run(a, comm, range(K))
        a.save(ck)
        saved_residuals = a.local_residuals()
        _run(a, comm, range(K, K + M))
        full = _snapshot(a)
        a.close()
        c = step.init(params, ctx=ctx)
        c.restore(ck)
        restored_residuals = c.local_residuals()
        _run(c, comm, range(K, K + M))
        resumed = _snapshot(c)
        # A checkpoint without residuals (as written before they were saved): zero residuals.
        if ctx.rank == 0:
            import shutil
            shutil.copytree(ck, ck + "-old")
            with open(os.path.join(ck + "-old", "manifest.json")) as f:
                man = json.load(f)
            del man["residuals"]
            with open(os.path.join(ck + "-old", "manifest.json"), "w") as f:
                json.dump(man, f)
        ctx.barrier(f"{comm} old checkpoint made")
        c.restore(ck + "-old")
        old_residuals = c.local_residuals()
        c.close()
        # An uncompressed trainer cannot take the residuals.
        d = sharded_step(model, optax.adam(1e-2), comm=comm, reproducible=True).init(params, ctx=ctx)
        refused = error_text(lambda: d.restore(ck))
        d.close()
        with open(os.path.join(ck, "manifest.json")) as f:
            described = json.load(f)["residuals"]
        out[comm] = dict(full=full, resumed=resumed, saved_residuals=saved_residuals, described=described,
                         restored_residuals=restored_residuals, old_residuals=old_residuals, refused=refused)
    return out


@pytest.fixture(scope="module")
def compressed_results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_compressed"))
    return run_ranks(compressed_body, W, args=(root,), timeout_s=600)


@pytest.mark.parametrize("comm", ["collective", "odc"])
def test_compressed_resume_is_bit_exact(compressed_results, comm):
    for rank, res in enumerate(compressed_results):
        r = res[comm]
        saved = r["saved_residuals"]
        assert saved and any(np.any(x != 0) for x in saved.values()), f"rank {rank}: no residual to carry"
        assert r["described"] == [[n, int(x.size)] for n, x in saved.items()]
        for n, x in saved.items():
            _bits_equal(x, r["restored_residuals"][n], f"rank {rank} {comm} residual {n}")
        _same_state(r["full"], r["resumed"], f"rank {rank} {comm} compressed, resumed vs uninterrupted")
        assert set(r["old_residuals"]) == set(saved) and all(not np.any(x) for x in r["old_residuals"].values())
        assert f"rank {rank}: checkpoint" in r["refused"] and "residuals differ" in r["refused"], r["refused"]
        assert "none (no compression) in this trainer" in r["refused"], r["refused"]


def _bits_equal(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    assert a.tobytes() == b.tobytes(), (
        f"{what}: {int(np.sum(a != b))} of {a.size} elements differ (max |diff| {np.max(np.abs(a - b)):.3g})")


def _same_state(x, y, what):
    for n in x[0]:
        _bits_equal(x[0][n], y[0][n], f"{what}: shard {n}")
    assert len(x[1]) == len(y[1])
    for i, (p, q) in enumerate(zip(x[1], y[1])):
        _bits_equal(p, q, f"{what}: optimizer-state leaf {i}")


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_ranks(checkpoint_body, W, args=(root,), timeout_s=600)


@pytest.mark.parametrize("comm", ["collective", "odc"])
def test_round_trip_and_resume_are_bit_exact(two_rank_results, comm):
    _, results = two_rank_results
    for rank, res in enumerate(results):
        r = res[comm]
        assert r["step"] == K
        _same_state(r["saved"], r["restored"], f"rank {rank} {comm} round trip")
        _same_state(r["full"], r["resumed"], f"rank {rank} {comm} resumed vs uninterrupted")
        _same_state(r["full"], r["again"], f"rank {rank} {comm} restored into a used trainer")
        # the resumed steps really trained: the state moved after the checkpoint
        assert any(not np.array_equal(r["saved"][0][n], r["full"][0][n]) for n in r["full"][0])
        assert len(r["files"]) == W + 1 and "manifest.json" in r["files"]  # no temp or stale files
    if comm == "odc":  # the ODC schedule has a rank with no microbatch and unequal counts
        assert any(0 in c for c in COUNTS["odc"][:K + M]) and any(len(set(c)) > 1 for c in COUNTS["odc"])


def test_checkpoint_restores_across_comm_modes(two_rank_results):
    _, results = two_rank_results
    for rank, res in enumerate(results):
        assert tuple(res["cross_layouts"]) == ("contiguous", "per_leaf")
        want, got = res["collective"]["logical"], res["cross"]
        assert len(want) == len(got)
        for i, (a, b) in enumerate(zip(want, got)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"rank {rank} collective -> odc: item {i}"


def test_bad_checkpoints_are_refused_on_every_rank(two_rank_results):
    root, results = two_rank_results
    r0, r1 = results
    assert "no checkpoint at" in r1["missing"] and "missing" in r1["missing"], r1["missing"]
    assert "rank 0: restoring checkpoint" in r0["missing"] and "failed on rank(s) [1]" in r0["missing"], r0["missing"]
    assert r0["unchanged"] and r1["unchanged"]
    assert "rank 1: checkpoint" in r1["damaged"] and "is damaged" in r1["damaged"], r1["damaged"]
    assert "failed on rank(s) [1]" in r0["damaged"], r0["damaged"]
    for rank, r in enumerate(results):
        assert f"rank {rank}: checkpoint" in r["optimizer"] and "optimizer-state structure differs" in r["optimizer"]
        assert f"rank {rank}: checkpoint" in r["layout"] and "parameter layout differs" in r["layout"], r["layout"]
        assert "unit 1 ('layer_1'): numel is 272 in the checkpoint, 204 in this trainer" in r["layout"], r["layout"]


def _single_rank_step():
    from jaxodc.odc import Runtime
    from jaxodc.launch.context import new_job_id
    from jaxodc.train.api import sharded_step
    model, params = _model()
    step = sharded_step(model, _optimizer(), comm="odc")
    rt = Runtime([u.padded for u in step.layout(params, 1).units], rank=0, world=1, rendezvous=None,
                 job_id=new_job_id())
    return step, step.init(params, runtime=rt), rt


def test_world_size_mismatch_is_refused(two_rank_results):
    root, _ = two_rank_results
    step, state, rt = _single_rank_step()
    try:
        with pytest.raises(ValueError, match=r"rank 0: checkpoint .*odc was saved by 2 ranks; this trainer has world 1"):
            state.restore(os.path.join(root, "odc"))
    finally:
        rt.close()


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import json
    from jaxodc.train import checkpoint
    step, state, rt = _single_rank_step()
    try:
        state.train_minibatch([_microbatch(0, 0, 0)], 3.0)
        state.save(str(tmp_path))
        first = _snapshot(state)
        man = json.load(open(tmp_path / "manifest.json"))
        assert (man["format"], man["version"], man["world"], man["step"], man["comm"]) == ("jaxodc.checkpoint", 1, 1, 1, "odc")
        assert [u["name"] for u in man["units"]] == ["layer_0", "layer_1", "layer_2"]
        assert [f["rank"] for f in man["files"]] == [0] and os.path.exists(tmp_path / man["files"][0]["file"])

        state.train_minibatch([_microbatch(1, 0, 0)], 3.0)
        real = checkpoint._write_atomic

        def crash_on_manifest(path, data):
            if path.endswith("manifest.json"):
                raise OSError("disk full (simulated)")
            real(path, data)

        monkeypatch.setattr(checkpoint, "_write_atomic", crash_on_manifest)
        with pytest.raises(ValueError, match="rank 0: cannot write .*manifest.json: disk full"):
            state.save(str(tmp_path))
        monkeypatch.setattr(checkpoint, "_write_atomic", real)
        assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
        assert state.restore(str(tmp_path)) == 1
        _same_state(first, _snapshot(state), "previous checkpoint after an interrupted save")
        state.save(str(tmp_path))  # a good save removes the orphan of the interrupted one
        assert sorted(os.listdir(tmp_path)) == sorted(["manifest.json", json.load(open(tmp_path / "manifest.json"))["files"][0]["file"]])
    finally:
        rt.close()
