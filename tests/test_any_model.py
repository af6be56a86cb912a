"""Any model, unchanged: unit discovery (discover.py), gather-on-use staging of a plain loss_fn
(gather_on_use.py) and the linen / nnx adapters. Every gradient is checked, leaf by leaf and element
by element, against jax.value_and_grad of the unsharded loss; gathers are the identity (a world of
one) here, and jax collectives over two in-process CPU devices in the subprocess test."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxodc.modeling.adapters import frozen_collections, linen_loss_fn, nnx_loss_fn
from jaxodc.modeling.discover import const_leaves, discover_units, shard_tree, unshard_tree, unit_leaves, assemble
from jaxodc.modeling.gather_on_use import gather_on_use, microbatch_grad_any, plan_for, scanned_axes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def identity_gather(shard, spec, ctx):
    return shard


def check_against_reference(loss_fn, tree, batch, plan, has_aux=False, rtol=1e-5, atol=1e-6):
    """Staged loss and gradients (world 1) == jax.value_and_grad of loss_fn, every trainable element."""
    staged = gather_on_use(loss_fn, plan, identity_gather)
    consts = const_leaves(plan, tree)
    out, grads = jax.jit(jax.value_and_grad(staged, has_aux=has_aux))(shard_tree(plan, tree, 0), consts, batch)
    ref_out, ref_grads = jax.value_and_grad(loss_fn, has_aux=has_aux, allow_int=True)(tree, batch)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol), out, ref_out)
    got = jax.tree_util.tree_leaves(unshard_tree(plan, [grads], consts))
    for place, g, r in zip(plan.places, got, jax.tree_util.tree_leaves(ref_grads)):
        if place.kind != "const":
            np.testing.assert_allclose(g, r, rtol=rtol, atol=atol, err_msg=place.path)
    return staged


# ---------------------------------------------------------------- discovery

def test_default_policy_layers_stacks_rest_and_consts():
    p = {"params": {"Embed_0": {"embedding": np.ones((10, 4), np.float32)},
                    "layers_0": {"k": np.ones((4, 4), np.float32), "b": np.ones(4, np.float32)},
                    "layers_1": {"k": np.ones((4, 4), np.float32), "b": np.ones(4, np.float32)},
                    "norm": {"scale": np.ones(4, np.float32)}, "step": np.int32(3)},
         "stack": {"Dense_0": {"kernel": np.ones((3, 4, 4), np.float32), "bias": np.ones((3, 4), np.float32)}}}
    plan = discover_units(p, 3, stacked={"stack/*": 0})
    assert [(u.name, u.paths) for u in plan.layout.units] == [
        ("params/Embed_0+1", ("params/Embed_0/embedding", "params/norm/scale")),
        ("params/layers_0", ("params/layers_0/b", "params/layers_0/k")),
        ("params/layers_1", ("params/layers_1/b", "params/layers_1/k")),
        *[(f"stack[{l}]", ("stack/Dense_0/bias", "stack/Dense_0/kernel")) for l in range(3)]]
    assert plan.layout["stack[1]"].shapes == ((4,), (4, 4)) and plan.layout["stack[1]"].padded % 3 == 0
    assert plan.const_paths == ("params/step",)
    # a size bound of one embedding splits the rest; layers are never merged
    small = discover_units(p, 1, stacked={"stack/*": 0}, max_unit_bytes=4 * 40)
    assert [u.name for u in small.layout.units][:2] == ["params/Embed_0", "params/layers_0"]
    assert "params/norm" in small.layout.names


def test_shard_roundtrip_and_unit_leaves_slice_stacks():
    rs = np.random.RandomState(0)
    p = {"a": rs.randn(5, 3).astype(np.float32), "s": rs.randn(4, 2, 3).astype(np.float32),
         "t": rs.randn(2, 4).astype(np.float32), "n": np.arange(3)}
    plan = discover_units(p, 3, stacked={"s": 1, "t": 1})
    units = unit_leaves(plan, p)
    for l in range(2):
        np.testing.assert_array_equal(units[f"s[{l}]"][0], p["s"][:, l])  # siblings stack on their own
        np.testing.assert_array_equal(units[f"t[{l}]"][0], p["t"][:, l])
    back = unshard_tree(plan, [shard_tree(plan, p, r) for r in range(3)], const_leaves(plan, p))
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, p)
    jax.tree_util.tree_map(np.testing.assert_array_equal, assemble(plan, units, const_leaves(plan, p)), p)


def test_override_by_pattern_glob_regex_and_callable():
    p = {"enc": {"w": np.ones((2, 2)), "b": np.ones(2)}, "dec": {"w": np.ones((2, 2))}, "head": np.ones(3)}
    plan = discover_units(p, 1, units={"encoder": "enc/*", "rest": [re.compile(r"dec/.*"), "re:head"]})
    assert [(u.name, u.paths) for u in plan.layout.units] == [("rest", ("dec/w", "head")),
                                                               ("encoder", ("enc/b", "enc/w"))]
    plan = discover_units(p, 1, units=["enc/*", "*"][:1] + ["dec/*", "head"])
    assert plan.layout.names == ("dec/*", "enc/*", "head")
    plan = discover_units(p, 1, units=lambda path, leaf: path.split("/")[0])
    assert plan.layout.names == ("dec", "enc", "head")


def test_policy_errors_name_the_parameter():
    p = {"enc": {"w": np.ones((2, 2))}, "dec": {"w": np.ones((2, 2))}}
    with pytest.raises(ValueError, match=r"no unit: 'dec/w'.*catch-all"):
        discover_units(p, 1, units={"e": "enc/*"})
    with pytest.raises(ValueError, match=r"'enc/w' is assigned to units \['a', 'b'\]"):
        discover_units(p, 1, units={"a": "enc/*", "b": "*/w"})
    with pytest.raises(ValueError, match=r"no unit: 'dec/w'"):
        discover_units(p, 1, units=lambda path, leaf: "e" if path.startswith("enc") else None)
    with pytest.raises(ValueError, match=r"mixes leaves stacked"):
        discover_units({"s": np.ones((3, 2)), "w": np.ones(2)}, 1, units={"u": "*"}, stacked={"s": 0})
    with pytest.raises(ValueError, match=r"'s' of shape \(3, 2\) has no stack axis 2"):
        discover_units({"s": np.ones((3, 2))}, 1, stacked={"s": 2})


def llama_setup(**kw):
    from jaxodc.models.llama import Llama, LlamaConfig
    cfg = LlamaConfig(n_layers=3, d_model=32, ffn=64, vocab=50, **kw)
    rs = np.random.RandomState(0)
    T = 8
    batch = {"tokens": rs.randint(0, 50, (2, T)).astype(np.int32), "targets": rs.randint(0, 50, (2, T)).astype(np.int32),
             "segment_ids": np.array([[1] * 5 + [2] * 3, [1] * 6 + [0] * 2], np.int32),
             "positions": np.array([list(range(5)) + list(range(3)), list(range(6)) + [0, 0]], np.int32),
             "loss_mask": np.array([[1] * 8, [1] * 6 + [0] * 2], np.float32)}
    variables = jax.jit(lambda k: Llama(cfg).init(k, batch))(jax.random.key(0))
    deterministic = cfg.dropout == 0
    if not deterministic:
        batch["rng"] = jax.random.key(7)
    loss_fn = linen_loss_fn(Llama(cfg, deterministic=deterministic), lambda apply, b: jnp.sum(apply(b)),
                            rngs=() if deterministic else ("dropout",))
    return loss_fn, variables, batch


def test_discovery_of_each_example():
    # linen nn.scan LM: the stack is found from how the loss scans over it, axis 0 or 1
    for axis in (0, 1):
        loss_fn, variables, batch = llama_setup(scan_axis=axis)
        axes = scanned_axes(loss_fn, variables, batch)
        assert axes and set(axes.values()) == {axis} and all(k.startswith("params/layers/") for k in axes)
        plan = plan_for(loss_fn, variables, batch, 2, max_unit_bytes=4 * 32 * 50)
        assert plan.layout.names == ("params/embed", "params/final_norm", "params/head",
                                     "params/layers[0]", "params/layers[1]", "params/layers[2]")
    # the staged model's MLP (layer_0 ... as a dict)
    from jaxodc.models.mlp import MLP
    mlp = MLP((4, 8, 8, 3))
    assert discover_units(mlp.init(jax.random.key(0)), 2).layout.names == ("layer_0", "layer_1", "layer_2")
    # nnx: blocks in an nnx.List are repeated layers; the rng state and non-Param variables are constants
    from flax import nnx
    from jaxodc.models.nnx_mlp import Classifier
    _, tree = nnx_loss_fn(Classifier(dropout=0.1, rngs=nnx.Rngs(0, dropout=1)), lambda m, b: 0.0)
    plan = discover_units(tree, 2, frozen=("state/*",))
    assert plan.layout.names == ("params/blocks/0", "params/blocks/1", "params/blocks/2", "params/inp+2")
    assert all(p.startswith("state/") for p in plan.const_paths)


# ---------------------------------------------------------------- gradients

def plain_setup():
    k = jax.random.split(jax.random.key(0), 8)
    p = {"l0": {"w": jax.random.normal(k[0], (3, 4)), "b": jnp.ones(4)},
         "stack": {"w": 0.5 * jax.random.normal(k[1], (5, 4, 4)), "b": 0.1 * jax.random.normal(k[2], (5, 4))},
         "l1": {"w": jax.random.normal(k[3], (2, 4))},
         "frozen": {"w": jax.random.normal(k[4], (4, 4))},
         "lora": {"a": 0.1 * jax.random.normal(k[5], (4, 2)), "b": 0.1 * jax.random.normal(k[6], (2, 4))},
         "step": jnp.int32(2)}
    batch = {"x": jax.random.normal(k[7], (6, 3)), "flag": jnp.int32(1)}
    return p, batch


@jax.custom_vjp
def scaled_tanh(x, w):
    return jnp.tanh(x) * w


def _st_fwd(x, w):
    return scaled_tanh(x, w), (x, w)


def _st_bwd(res, ct):
    x, w = res
    return ct * w * (1 - jnp.tanh(x) ** 2), jnp.sum(ct * jnp.tanh(x), axis=0)


scaled_tanh.defvjp(_st_fwd, _st_bwd)


def plain_loss(p, b):
    h = jnp.tanh(b["x"] @ p["l0"]["w"] + p["l0"]["b"])

    def body(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), jnp.sum(h)
    h, ys = jax.lax.scan(body, h, p["stack"])
    h = jax.lax.cond(b["flag"] > 0, lambda h: h * p["l1"]["w"][0], lambda h: h - 1, h)
    h = scaled_tanh(h, p["l1"]["w"][1])
    base = jax.lax.stop_gradient(p["frozen"]["w"])  # LoRA-style: a frozen base plus a trained update
    h = h @ (base + p["lora"]["a"] @ p["lora"]["b"])
    return jnp.sum((h @ p["l1"]["w"].T) ** 2) * p["step"].astype(jnp.float32) + 0.1 * jnp.sum(ys)


def test_plain_loss_scan_cond_custom_vjp_frozen_int_leaf():
    p, batch = plain_setup()
    plan = plan_for(plain_loss, p, batch, 1, frozen=("frozen/*",))
    assert plan.const_paths == ("frozen/w", "step")
    staged = check_against_reference(plain_loss, p, batch, plan)
    stages = staged.stage_units(batch)
    assert stages[1:6] == [(f"stack[{l}]",) for l in range(5)]  # each layer gathered on its own
    # the trainer's form: divided by the global token count
    loss, grads = microbatch_grad_any(plain_loss, plan, identity_gather)(shard_tree(plan, p, 0), const_leaves(plan, p),
                                                                         batch, 4.0, None)
    ref_loss, ref_grads = jax.value_and_grad(lambda p, b: plain_loss(p, b) / 4.0, allow_int=True)(p, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(unshard_tree(plan, [grads], const_leaves(plan, p))["l0"]["w"], ref_grads["l0"]["w"],
                               rtol=1e-5, atol=1e-6)
    # the frozen base as a stop_gradient-ed trained unit instead: its gradient is exactly zero
    plan = plan_for(plain_loss, p, batch, 1)
    check_against_reference(plain_loss, p, batch, plan)


def test_reverse_scan_and_stack_axis_one():
    p = {"w": 0.5 * jax.random.normal(jax.random.key(1), (4, 3, 4)), "v": jnp.ones((4, 3))}

    def loss(p, b):
        w = jnp.moveaxis(p["w"], 1, 0)  # stacked on axis 1, as flax nn.scan with variable_axes 1
        h, _ = jax.lax.scan(lambda h, wv: (jnp.tanh(h @ wv[0] + wv[1]), None), b, (w, p["v"].T), reverse=True)
        return jnp.sum(h ** 2)
    assert scanned_axes(loss, p, jnp.ones((2, 4))) == {"w": 1, "v": 1}
    plan = plan_for(loss, p, jnp.ones((2, 4)), 1)
    check_against_reference(loss, p, jnp.ones((2, 4)), plan)


def test_stacked_parameter_used_whole_is_refused_with_its_path():
    p = {"w": jnp.ones((3, 4, 4))}

    def loss(p, b):
        h = jax.lax.fori_loop(0, 3, lambda i, h: h @ p["w"][i], b)
        return jnp.sum(h)
    plan = discover_units(p, 1, stacked={"w": 0})
    staged = gather_on_use(loss, plan, identity_gather)
    with pytest.raises(NotImplementedError, match=r"parameter 'w' is stacked over layers.*uses it whole"):
        staged(shard_tree(plan, p, 0), (), jnp.ones((2, 4)))
    assert scanned_axes(loss, p, jnp.ones((2, 4))) == {}  # and detection leaves it whole


@pytest.mark.parametrize("kw", [dict(scan_axis=0), dict(scan_axis=1, tie_embeddings=True), dict(dropout=0.3)],
                         ids=["scan_axis0", "scan_axis1_tied", "dropout"])
def test_linen_llama_matches_reference(kw):
    loss_fn, variables, batch = llama_setup(**kw)
    plan = plan_for(loss_fn, variables, batch, 1, frozen=frozen_collections(variables))
    staged = check_against_reference(loss_fn, variables, batch, plan)
    stages = staged.stage_units(batch)
    assert stages[1:4] == [(f"params/layers[{l}]",) for l in range(3)]
    if kw.get("tie_embeddings"):  # the tied table is gathered again where the head uses it
        assert stages[0] == stages[-1] == ("params/embed+1",)


class TwiceUsed(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = nn.Dense(x.shape[-1], name="block")  # one module, applied twice
        x = jnp.tanh(block(x))
        x = nn.Dense(x.shape[-1], name="mid")(x)
        return jnp.sum(jnp.tanh(block(x)) ** 2)


def test_linen_block_used_twice():
    x = jax.random.normal(jax.random.key(1), (3, 4))
    variables = TwiceUsed().init(jax.random.key(0), x)
    loss_fn = linen_loss_fn(TwiceUsed(), lambda apply, b: apply(b))
    plan = discover_units(variables, 1, units=lambda path, leaf: path.split("/")[1])
    staged = check_against_reference(loss_fn, variables, x, plan)
    assert staged.stage_units(x) == [("block",), ("mid",), ("block",)]


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(4)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return jnp.sum(nn.Dense(2)(jax.nn.relu(x)) ** 2)


def test_linen_batch_stats_are_constants_returned_as_aux():
    x = jax.random.normal(jax.random.key(1), (5, 3))
    variables = BNNet().init(jax.random.key(0), x)
    loss_fn = linen_loss_fn(BNNet(), lambda apply, b: apply(b), mutable=("batch_stats",))
    plan = discover_units(variables, 1, frozen=frozen_collections(variables))
    assert all(p.startswith("batch_stats/") for p in plan.const_paths) and plan.const_paths
    check_against_reference(loss_fn, variables, x, plan, has_aux=True)
    # forgetting `mutable` says what to change
    bad = linen_loss_fn(BNNet(), lambda apply, b: apply(b))
    with pytest.raises(ValueError, match=r"name it in mutable"):
        bad(variables, x)
    with pytest.raises(ValueError, match=r"put a PRNG key in the batch under 'rng'"):
        linen_loss_fn(BNNet(), lambda apply, b: apply(b), rngs=("dropout",))(variables, x)


def test_nnx_model_with_dropout_and_a_shared_layer():
    from flax import nnx
    from jaxodc.models.nnx_mlp import Classifier
    model = Classifier(dropout=0.2, rngs=nnx.Rngs(0, dropout=1))
    loss_fn, tree = nnx_loss_fn(model, lambda m, b: jnp.sum(m(b)), rngs=("dropout",))
    rs = np.random.RandomState(0)
    batch = {"x": rs.randn(6, 8).astype(np.float32), "y": rs.randint(0, 5, 6).astype(np.int32),
             "mask": np.ones(6, np.float32), "rng": jax.random.key(3)}
    plan = discover_units(tree, 1, frozen=("state/*",))
    staged = check_against_reference(loss_fn, tree, batch, plan)
    assert staged.stage_units(batch)[-1] == ("params/inp+2",)  # shared + out, grouped
    # dropout is live: another key, another loss
    other = dict(batch, rng=jax.random.key(4))
    assert float(loss_fn(tree, other)) != float(loss_fn(tree, batch))


# ---------------------------------------------------------------- two ranks, real collectives

TWO_RANKS = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxodc.train.collective import collective_gather
    from jaxodc.modeling.discover import const_leaves, shard_tree, unshard_tree
    from jaxodc.modeling.gather_on_use import gather_on_use, plan_for
    from jaxodc.modeling.adapters import frozen_collections
    import test_any_model as t

    W = 2
    mesh = Mesh(np.array(jax.devices()[:W]), ("d",))
    for name, (loss_fn, tree, batch) in {"plain": (t.plain_loss, *t.plain_setup()),
                                         "llama": t.llama_setup(scan_axis=1, tie_embeddings=True)}.items():
        frozen = frozen_collections(tree) if name == "llama" else ()
        plan = plan_for(loss_fn, tree, batch, W, frozen=frozen)
        staged = gather_on_use(loss_fn, plan, collective_gather("d"))
        consts = const_leaves(plan, tree)
        per_rank = [shard_tree(plan, tree, r) for r in range(W)]
        shards = {u: jnp.concatenate([s[u] for s in per_rank]) for u in plan.layout.names}
        # every rank computes the same loss on the same batch: the pushed gradient is W x the reference
        step = jax.jit(jax.shard_map(jax.value_and_grad(staged), mesh=mesh, in_specs=(P("d"), P(), P()),
                                     out_specs=(P(), P("d")), check_vma=False))
        loss, grads = step(shards, consts, batch)
        ref_loss, ref_grads = jax.value_and_grad(loss_fn, allow_int=True)(tree, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        got = unshard_tree(plan, [{u: np.asarray(g)[r * plan.layout[u].shard:(r + 1) * plan.layout[u].shard]
                                   for u, g in grads.items()} for r in range(W)], consts)
        for place, g, r in zip(plan.places, jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref_grads)):
            if place.kind != "const":
                np.testing.assert_allclose(g, W * np.asarray(r), rtol=1e-5, atol=1e-6, err_msg=place.path)
        print("ok", name)
""")


def test_two_ranks_collective_gather_matches_reference():
    assert run_two_devices(TWO_RANKS).split() == ["ok", "plain", "ok", "llama"]


# ---------------------------------------------------------------- memory

MEMORY = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxodc.train.collective import collective_gather
    from jaxodc.modeling.discover import discover_units, assemble
    from jaxodc.modeling.units import unflatten_unit
    from jaxodc.modeling.gather_on_use import gather_on_use

    def list_loss(p, x):  # a Python list of layers: one unit each
        for w in p["layers"]:
            x = jnp.tanh(x @ w)
        return jnp.sum(x ** 2)

    def scan_loss(p, x):  # layers stacked on axis 0 and scanned over: sliced per layer
        return jnp.sum(jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, p["layers"])[0] ** 2)

    d, B, W = 256, 4, 2
    mesh = Mesh(np.array(jax.devices()[:W]), ("d",))
    gather = collective_gather("d")
    out = {"staged_list": {}, "staged_scan": {}, "gather_all": {}}
    for L in (4, 8, 16):
        x = jax.ShapeDtypeStruct((B, d), jnp.float32)
        for kind, loss, p, stacked in (("list", list_loss, {"layers": [jax.ShapeDtypeStruct((d, d), jnp.float32)] * L}, None),
                                       ("scan", scan_loss, {"layers": jax.ShapeDtypeStruct((L, d, d), jnp.float32)}, {"layers": 0})):
            plan = discover_units(p, W, stacked=stacked)
            assert len(plan.layout.units) == L
            shards = {u.name: jax.ShapeDtypeStruct((u.padded,), jnp.float32) for u in plan.layout.units}
            staged = gather_on_use(loss, plan, gather)
            fns = {"staged_" + kind: lambda s, x: staged(s, (), x)}
            if kind == "list":  # the counterfactual: gather every unit first, then run the loss
                fns["gather_all"] = lambda s, x: loss(assemble(plan, {u.name: unflatten_unit(u, gather(s[u.name], u, None))
                                                                    for u in plan.layout.units}, ()), x)
            for name, f in fns.items():
                step = jax.shard_map(jax.value_and_grad(f), mesh=mesh, in_specs=(P("d"), P()), out_specs=(P(), P("d")),
                                     check_vma=False)
                out[name][L] = jax.jit(step).lower(shards, x).compile().memory_analysis().temp_size_in_bytes
    print(json.dumps(out))
""")


def run_two_devices(code: str) -> str:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_compiled_peak_grows_by_activations_not_parameters():
    """Compiled temp memory of one sharded value_and_grad step (per device, two ranks, all_gather /
    psum_scatter) at 4, 8, 16 layers of 256x256 fp32 (a unit: 256 KiB; an activation: 4 KiB)."""
    import json
    temp = json.loads(run_two_devices(MEMORY).strip().splitlines()[-1])
    unit, act = 256 * 256 * 4, 4 * 256 * 4
    print("compiled temp bytes by layers:", temp)
    for name in ("staged_list", "staged_scan"):
        t = {int(k): v for k, v in temp[name].items()}
        assert (t[16] - t[4]) / 12 <= 4 * act, (name, t)  # a few activations per layer, no parameter
        assert t[16] <= 2 * unit + 16 * 4 * act, (name, t)  # about two gathered units in all
    g = {int(k): v for k, v in temp["gather_all"].items()}
    assert (g[16] - g[4]) / 12 >= unit, g  # the measurement sees gathered parameters when they pile up
