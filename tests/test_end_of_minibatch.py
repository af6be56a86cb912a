"""The end of a minibatch (train.unitwise.EndStep; OdcTrainer._end): the optimizer's global
reductions found by tracing it, their partial sums exchanged once per dependency level, one
compiled optimizer program. Against the single-process reference for Adam, AdamW +
clip_by_global_norm and a chain with a global reduction of its own (which reads the clipped
updates: two levels), at 2 and 3 ranks, ODC and collective; and the two-phase arithmetic alone
against optax on whole vectors."""
import numpy as np
import pytest

from harness import run_ranks

B, MAX_TOKENS, STEPS, MAX_NORM, LR = 4, 64, 3, 0.05, 1e-2


def scale_by_global_mean_square(n: int, eps: float = 1e-12):
    """Divides the updates by the root of their mean square over all `n` parameters: a global
    reduction of its own (jaxodc's `global_sum` hook; the identity outside a trainer)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jaxodc.optim.clipping import global_sum

    def update(updates, state, params=None):
        del params
        sq = sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(updates))
        rms = jnp.sqrt(global_sum(sq) / n + eps)
        return jax.tree_util.tree_map(lambda x: x / rms, updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def optimizers(n: int) -> dict:
    """name -> optimizer, written for the whole tree (the trainers place it on shards)."""
    import optax
    clip = optax.clip_by_global_norm
    return {
        "adam": optax.adam(LR),
        "adamw+clip": optax.chain(clip(MAX_NORM), optax.adamw(LR, weight_decay=0.1)),
        "clip+global_mean+adam": optax.chain(clip(MAX_NORM), scale_by_global_mean_square(n), optax.adam(LR)),
    }


# --- the two-phase arithmetic in one process: W ranks' shards of random vectors ----------------

def placed(opt, sizes: dict, world: int, rank: int):
    """`opt` on rank `rank`'s shards of vectors `sizes` (one unit each, per_leaf: rank r holds
    [r*s, (r+1)*s) of each, s = ceil(size / world))."""
    import jax
    import jax.numpy as jnp
    from jaxodc.modeling.units import make_layout
    from jaxodc.optim.placement import ParamTree, place
    layout = make_layout({k: {"w": jax.ShapeDtypeStruct((n,), jnp.float32)} for k, n in sizes.items()}, world,
                         sharding="per_leaf")
    return place(opt, ParamTree.of_layout(layout), layout, rank)


@pytest.mark.parametrize("world", [2, 3])
def test_end_step_matches_optax_on_whole_vectors(world):
    import jax
    import jax.numpy as jnp
    import optax
    from jaxodc.train.unitwise import EndStep

    rng = np.random.default_rng(world)
    sizes = {"a": 10, "b": 7, "c": 12}
    n = sum(sizes.values())
    shard = {k: -(-s // world) for k, s in sizes.items()}
    full_p = {k: rng.normal(size=s).astype(np.float32) for k, s in sizes.items()}

    def cut(tree, r):  # rank r's shard, padded with zeros
        return {k: jnp.asarray(np.pad(v, (0, world * shard[k] - v.size))[r * shard[k]:(r + 1) * shard[k]])
                for k, v in tree.items()}

    whole = {**optimizers(n), "momentum+clip": optax.chain(optax.sgd(0.1, momentum=0.9),
                                                            optax.clip_by_global_norm(MAX_NORM))}
    for name, ref_opt in whole.items():
        ref_p, ref_state = {k: jnp.asarray(v) for k, v in full_p.items()}, None
        ref_state = ref_opt.init(ref_p)
        shards = [cut(full_p, r) for r in range(world)]
        opts = [placed(ref_opt, sizes, world, r) for r in range(world)]
        states = [o.init(s) for o, s in zip(opts, shards)]
        ends = [EndStep(opts[r], shards[r], states[r]) for r in range(world)]
        assert ends[0].rounds == {"adam": 0, "adamw+clip": 1, "clip+global_mean+adam": 2, "momentum+clip": 1}[name], ends[0].levels
        for step in range(3):
            g = {k: (rng.normal(size=s) * 0.1).astype(np.float32) for k, s in sizes.items()}
            gs = [cut(g, r) for r in range(world)]
            known = [None] * len(ends[0].sites)
            for k in range(ends[0].rounds):  # each level: every rank's partials, summed in float64
                parts = [np.asarray(e.partials(k, shards[r], jax.tree_util.tree_leaves(states[r]), gs[r],
                                               e.fill(known)), np.float64) for r, e in enumerate(ends)]
                ends[0].split(k, np.sum(parts, axis=0), known)
            for r, e in enumerate(ends):
                new_shards, leaves = e.apply(shards[r], jax.tree_util.tree_leaves(states[r]), gs[r], e.fill(known))
                shards[r], states[r] = new_shards, e.state_tree(leaves)
            upd, ref_state = ref_opt.update({k: jnp.asarray(v) for k, v in g.items()}, ref_state, ref_p)
            ref_p = optax.apply_updates(ref_p, upd)
            for k, s in sizes.items():
                got = np.concatenate([np.asarray(shards[r][k]) for r in range(world)])[:s]
                np.testing.assert_allclose(got, np.asarray(ref_p[k]), rtol=1e-5, atol=1e-6,
                                           err_msg=f"{name}, world {world}, step {step}, leaf {k}")


def test_sites_found_and_levels():
    import optax
    import jax.numpy as jnp
    from jaxodc.train.unitwise import EndStep
    sizes = {"a": 4, "b": 3}
    shards = {"a": jnp.zeros(4), "b": jnp.zeros(3)}
    opts = {k: placed(o, sizes, 1, 0) for k, o in optimizers(7).items()}
    ends = {k: EndStep(o, shards, o.init(shards)) for k, o in opts.items()}
    # a norm: one sum of every parameter's partial (they add up before it is taken); the mean
    # square reads the clipped updates, a level later
    assert [len(e.sites) for e in ends.values()] == [0, 1, 2]
    assert ends["clip+global_mean+adam"].levels == [0, 1]
    assert all(e.separable for e in ends.values()), {k: e.reason for k, e in ends.items()}
    # clipping after momentum reads every unit's new momentum through the norm: per unit once the
    # norm is fed in (train.unitwise.UnitwiseOptimizer refuses it)
    late = placed(optax.chain(optax.sgd(1e-2, momentum=0.9), optax.clip_by_global_norm(0.05)), sizes, 1, 0)
    end = EndStep(late, shards, late.init(shards))
    assert end.separable and end.levels == [0], (end.reason, end.levels)
    # one vector of all units: each parameter is gathered (a site each), so every unit's update reads
    # the exchanged values, never another unit's shard
    flat = placed(optax.flatten(optax.adamw(1e-2, weight_decay=0.1)), sizes, 1, 0)
    end = EndStep(flat, shards, flat.init(shards))
    assert end.separable and len(end.sites) >= 2, (end.reason, end.sites)


def test_exchange_rounds_pack_small_sites_and_send_big_ones_alone():
    from jaxodc.train.unitwise import exchange_rounds
    # depth order first; within a depth, packed up to the cap, a bigger site alone
    assert exchange_rounds([0, 0, 1, 0], [1, 2, 1, 3], cap=8) == [0, 0, 1, 0]
    assert exchange_rounds([0, 0, 0, 0, 1], [1, 100, 100, 1, 1], cap=8) == [0, 1, 2, 3, 4]
    assert exchange_rounds([0, 0, 0], [4, 4, 1], cap=8) == [0, 0, 1]
    assert exchange_rounds([], []) == []


def test_gathered_leaves_are_alive_one_at_a_time():
    """Muon gathers each matrix whole (a site each, an exchange each): the end program's
    temporaries must not grow with the number of matrices beyond their update pieces (each
    gathered leaf is exchanged, used and cut back before the next). With a unit per matrix they
    do not grow at all; with all in one unit (a transformer layer's matrices) each adds its piece,
    1/2 of a matrix at 2 ranks, alive until the unit's new shard is written."""
    from jaxodc.bench.optim_memory import odc_temp_matrices
    two, eight = odc_temp_matrices(2), odc_temp_matrices(8)
    assert eight <= two + 1.0, (two, eight)  # all eight alive at once would add six leaves or more
    two, eight = odc_temp_matrices(2, one_unit=True), odc_temp_matrices(8, one_unit=True)
    assert eight <= two + 1.0 + 6 / 2, (two, eight)  # before the cut-back barrier: 15 -> 51


# --- both trainers across processes against the single-process reference -----------------------

def _setup(world):
    import jax
    from jaxodc.data import minibatches, synthetic_text
    from jaxodc.models.lm import LM, LMConfig
    model = LM(LMConfig(d_model=32, n_layers=2, n_heads=2))
    params = model.init(jax.random.PRNGKey(0))
    samples = synthetic_text("longalign", 64, MAX_TOKENS, seed=3, min_len=4)
    mbs = [idx for _, idx in zip(range(STEPS), minibatches(len(samples), world * B, seed=5))]
    n = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(params))
    return model, params, samples, mbs, n


def _plan(comm, samples, idx, world):
    from jaxodc.balance.cost import CostModel
    from jaxodc.balance.plan import make_plan
    return make_plan("lb_mini" if comm.startswith("odc") else "lb_micro", samples.lengths[idx].tolist(), world, MAX_TOKENS,
                     CostModel.for_transformer(32))


COMMS = ("odc", "odc/copies", "collective")


def trainers_body(ctx):
    from jaxodc.launch.context import init_jax_distributed
    init_jax_distributed(ctx)
    from jaxodc.data import Samples
    from jaxodc.train.api import sharded_step
    from jaxodc.train.odc import OdcTrainer
    model, params, samples, mbs, n = _setup(ctx.world)
    out = {}
    in_place = OdcTrainer._master_views
    for comm in COMMS:
        # odc/copies: the path of owners whose shards jax cannot use in place (GPU): the end program
        # returns the new shards, which are then published
        OdcTrainer._master_views = (lambda self: None) if comm == "odc/copies" else in_place
        for name, opt in optimizers(n).items():
            tr = sharded_step(model, opt, comm=comm.split("/")[0]).init(params, ctx=ctx)
            losses, ends = [], []
            for idx in mbs:
                res = tr.train_plan(_plan(comm, samples, idx, ctx.world), Samples([samples[i] for i in idx]).tokens)
                losses.append(res.loss)
                ends.append(res.end_s)
            if comm.startswith("odc"):
                assert tr.end.separable and (tr._end_program is not None) == bool(tr.end.rounds), name
                assert (tr._masters is not None and tr._grads is not None) == (comm == "odc"), name
            out[comm, name] = (losses, ends, tr.local_shards(), tr.layout)
            tr.close()
    OdcTrainer._master_views = in_place
    return out


@pytest.mark.timeout(900)  # 250 s on a quiet 2-core runner: 3 ranks compile every chain's programs
@pytest.mark.parametrize("world", [3])  # 3: uneven pieces (2 ranks is the placement table's and the trainers' tests')
def test_end_of_minibatch_matches_reference(world):
    import jax
    from jaxodc.balance.packing import pack
    from jaxodc.data import Samples
    from jaxodc.train.core import plan_global_tokens
    from jaxodc.train.reference import ReferenceTrainer
    from jaxodc.modeling.units import unshard_params

    results = run_ranks(trainers_body, world, timeout_s=600)
    model, params, samples, mbs, n = _setup(world)
    for name, opt in optimizers(n).items():
        ref = ReferenceTrainer(model, opt, params)
        ref_losses = []
        for idx in mbs:
            plan = _plan("odc", samples, idx, world)
            sub = Samples([samples[i] for i in idx])
            ref_losses.append(ref.step([pack([sub.tokens[i] for i in mb], MAX_TOKENS).as_dict()
                                        for r in plan.ranks for mb in r], plan_global_tokens(plan)))
        for comm in COMMS:
            what = f"{comm}, {name}, world {world}"
            for r in results:
                losses, ends = r[comm, name][:2]
                np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=what)
                assert all(e > 0 for e in ends), (what, ends)
            # as tests/test_odc_trainer.py: owners' sums differ from the reference's in the last
            # bits, which Adam's m/sqrt(v) magnifies for near-zero gradient elements (1.5e-3 of
            # one Adam step). Dividing by the global rms magnifies those elements' share further:
            # measured 4.5e-5 on one element of 3072 at 3 ranks (its other elements within 1.5e-5).
            atol = 1e-4 if name == "clip+global_mean+adam" else 1.5e-5
            got = unshard_params(results[0][comm, name][3], [r[comm, name][2] for r in results])
            for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                                    jax.tree_util.tree_leaves(ref.numpy_params())):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def test_records_carry_end_s_in_its_own_field():
    """StepResult.end_s reaches MinibatchRecord.end_s (not another field) and the summary."""
    from jaxodc.train.core import StepResult
    from jaxodc.train.metrics import MinibatchRecord, summarize

    res = StepResult(version=3, loss=1.5, t_start=0.0, t_end=1.0, microbatches=[(0.0, 0.5)], opt=(0.5, 0.75))
    res.end_s = 0.25
    rec = MinibatchRecord.from_result(res, rank=0, samples=2, tokens=10, comm="odc", balance="lb_mini")
    assert rec.end_s == 0.25 and rec.params_sha256 is None and rec.straggle_s is None
    assert summarize([rec])["end_s"] == 0.25
