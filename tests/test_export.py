"""Export: a linen Llama trained on 2 ranks (comm="odc") the way the README's "Your own Flax model"
shows -- linen_loss_fn + sharded_step -- and the unit-staged LM trained with `Trainer`, each
exported and loaded back with nothing but `flax.serialization.msgpack_restore`; the loaded
parameters are the trainer's own full parameters and the models compute the same thing from them,
element for element. The README's single-process loop on the same data gives the same losses and
parameters. An export path that cannot be written fails on every rank, naming the path.
`jaxodc train --model llama --export PATH` trains the Llama and writes a file Flax loads."""
import json
import os

import numpy as np
import pytest

from harness import run_ranks

STEPS, T, LR = 2, 16, 1e-3


def llama():
    from jaxodc.models.llama import Llama, LlamaConfig
    return Llama(LlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn=64))


def microbatch(step, rank, j):
    """One packed [1, T] row of two samples."""
    rs = np.random.RandomState([step, rank, j])
    return {"tokens": rs.randint(1, 64, (1, T)).astype(np.int32), "targets": rs.randint(1, 64, (1, T)).astype(np.int32),
            "segment_ids": np.array([[1] * 10 + [2] * 6], np.int32),
            "positions": np.array([list(range(10)) + list(range(6))], np.int32),
            "loss_mask": np.ones((1, T), np.float32)}


def microbatches(step, rank):
    return [microbatch(step, rank, j) for j in range(2 + (rank == 0))]  # uneven: rank 0 runs one more


def lm_setup():
    import jax
    from jaxodc.data import synthetic_text
    from jaxodc.models.lm import LM, LMConfig
    model = LM(LMConfig(d_model=16, n_layers=1, n_heads=2))
    return model, model.init(jax.random.PRNGKey(0)), synthetic_text("longalign", 8, 32, seed=3, min_len=4)


def export_body(ctx, root):
    import jax
    import optax
    import jaxodc
    from jaxodc.modeling.adapters import linen_loss_fn
    from jaxodc.train.export import export, full_params

    out = {}
    # -- the README's jaxodc version of a linen train step
    model = llama()
    batch = microbatch(0, 0, 0)
    variables = model.init(jax.random.key(0), batch)
    tx = optax.adam(LR)
    loss_fn = linen_loss_fn(model, lambda apply, batch: apply(batch).sum())
    trainer = jaxodc.sharded_step(loss_fn, tx, comm="odc").init(variables, ctx=ctx, example_batch=batch)
    losses = []
    for step in range(STEPS):
        tokens = sum(b["loss_mask"].sum() for r in range(ctx.world) for b in microbatches(step, r))
        losses.append(trainer.train_minibatch(microbatches(step, ctx.rank), tokens).loss)
    out["llama"] = (losses, full_params(trainer), export(trainer, os.path.join(root, "llama", "model.msgpack")))
    blocker = os.path.join(root, "a_file")
    if ctx.rank == 0:
        open(blocker, "w").close()
    ctx.allgather("test/blocker", b"")
    try:
        export(trainer, os.path.join(blocker, "model.msgpack"))
    except OSError as e:
        out["unwritable"] = str(e)
    trainer.close()

    # -- the unit-staged LM through Trainer
    lm, params, samples = lm_setup()
    with jaxodc.Trainer(lm, optax.adam(1e-2), comm="odc", max_tokens=64, params=params, ctx=ctx) as tr:
        tr.fit(samples.tokens, minibatch=2, steps=STEPS, seed=2)
        out["lm"] = (tr.full_params(), tr.export(os.path.join(root, "lm.msgpack")))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("export"))
    return root, run_ranks(export_body, 2, args=(root,), timeout_s=240)


def restore(path):
    import flax.serialization  # what a Flax user without jaxodc does
    with open(path, "rb") as f:
        return flax.serialization.msgpack_restore(f.read())


def assert_same_tree(a, b):
    import jax
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_linen_llama_export_loads_in_plain_flax(results):
    root, (r0, r1) = results
    losses, full, path = r0["llama"]
    assert path == os.path.join(root, "llama", "model.msgpack") and r1["llama"][2] == path
    assert_same_tree(r1["llama"][1], full)
    loaded = restore(path)
    assert_same_tree(loaded, full)
    model = llama()
    for step in range(STEPS):
        for b in microbatches(step, 1):
            np.testing.assert_array_equal(np.asarray(model.apply(loaded, b)), np.asarray(model.apply(full, b)))
    info = json.load(open(path + ".json"))
    assert info["step"] == STEPS and info["world"] == 2 and info["comm"] == "odc"
    assert info["leaves"]["params/embed/embedding"] == "float32[64, 32]", info["leaves"]


def test_readme_single_process_loop_matches(results):
    """The README's "before": jax.value_and_grad of the mean loss over the whole minibatch."""
    import jax
    import optax
    _, (r0, _) = results
    model = llama()
    batch = microbatch(0, 0, 0)
    variables = model.init(jax.random.key(0), batch)
    tx = optax.adam(LR)
    opt_state = tx.init(variables)

    def loss_fn(variables, batch):
        return model.apply(variables, batch).sum() / batch["loss_mask"].sum()

    @jax.jit
    def train_step(variables, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(variables, batch)
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state, loss

    losses = []
    for step in range(STEPS):
        whole = jax.tree_util.tree_map(lambda *x: np.concatenate(x),
                                       *[b for r in range(2) for b in microbatches(step, r)])
        variables, opt_state, loss = train_step(variables, opt_state, whole)
        losses.append(float(loss))
    sharded_losses, full, _ = r0["llama"]
    np.testing.assert_allclose(sharded_losses, losses, rtol=2e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(full), jax.tree_util.tree_leaves(variables)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=jax.tree_util.keystr(path))


def test_staged_lm_export_loads_into_its_units(results):
    root, (r0, _) = results
    full, path = r0["lm"]
    loaded = restore(path)
    assert_same_tree(loaded, full)
    assert set(loaded) == {"embed", "block_0", "head"}
    from jaxodc.balance.packing import pack
    model, params, samples = lm_setup()
    batch = pack(samples.tokens[:2], 64).as_dict()  # two samples of <= 32 tokens

    def per_token_losses(p):
        carry = None
        for name in model.unit_names:
            carry = model.apply_unit(name, p[name], carry, batch)
        return np.asarray(carry)

    got = per_token_losses(loaded)
    np.testing.assert_array_equal(got, per_token_losses(full))
    assert got.shape == batch["tokens"].shape and not np.array_equal(got, per_token_losses(params))  # trained


def test_unwritable_path_fails_on_every_rank_naming_it(results):
    root, (r0, r1) = results
    path = os.path.join(root, "a_file", "model.msgpack")
    assert r0["unwritable"].startswith(f"cannot write the export {path}: "), r0["unwritable"]
    assert r1["unwritable"] == "rank 0: " + r0["unwritable"]


# -- jaxodc train --model llama --export ------------------------------------------------------

def test_write_read_any_tree(tmp_path):
    """Typed PRNG keys go out as their key data, int dict keys and tuples as strings (Flax's state
    dict); an unwritable path names itself."""
    import jax
    from jaxodc.train.export import read, write
    tree = {"params": {"w": np.ones((2, 3), np.float32)}, "state": {"rng": jax.random.key(3), "blocks": {0: (np.int32(7),)}}}
    path = write(tree, str(tmp_path / "t.msgpack"), {"note": "x"})
    got = read(path)
    np.testing.assert_array_equal(got["params"]["w"], tree["params"]["w"])
    np.testing.assert_array_equal(got["state"]["rng"], jax.random.key_data(tree["state"]["rng"]))
    assert got["state"]["blocks"] == {"0": {"0": 7}}
    info = json.load(open(path + ".json"))
    assert info["note"] == "x" and info["prng_key_data"] == ["state/rng"] and info["parameters"] == 9
    with pytest.raises(OSError, match=f"cannot write the export {tmp_path}/t.msgpack/x: "):
        write(tree, str(tmp_path / "t.msgpack" / "x"))


def test_cli_refuses_bad_model_options_before_launching(tmp_path, capsys):
    from test_train_cli import _main
    code, err = _main(["--model", "llama", "--heads", "4", "--kv-heads", "3"], capsys)
    assert code == 2 and "--kv-heads 3 must divide --heads 4" in err, err
    code, err = _main(["--kv-heads", "2"], capsys)
    assert code == 2 and "--kv-heads applies to --model llama" in err, err
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, err = _main(["--export", str(blocker / "model.msgpack")], capsys)
    assert code == 2 and f"--export: cannot create the directory {blocker}" in err, err


def test_cli_export_path_per_run():
    from types import SimpleNamespace
    from jaxodc.cli.train import export_path
    args = SimpleNamespace(export="/x/model.msgpack")
    assert export_path(args, ("odc", "lb_mini"), 1) == "/x/model.msgpack"
    assert export_path(args, ("odc", "lb_mini"), 2) == "/x/model.odc-lb_mini.msgpack"


@pytest.mark.slow
def test_cli_trains_llama_and_exports(tmp_path):
    from test_train_cli import _train
    path, js = tmp_path / "out" / "llama.msgpack", tmp_path / "runs.json"
    out = _train(["--model", "llama", "--ranks", "2", "--steps", "2", "--minibatch", "2", "--max-tokens", "32",
                  "--d-model", "16", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--warmup", "0",
                  "--json", str(js), "--export", str(path)])
    assert f"odc + lb_mini  export: {path} (minibatch 2)" in out, out
    losses = [r["loss"] for r in json.load(open(js))["odc + lb_mini"]]
    assert len(losses) == 4 and np.all(np.isfinite(losses)), losses
    from jaxodc.balance.packing import pack
    from jaxodc.models.llama import Llama, LlamaConfig
    cfg = LlamaConfig(d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn=64)
    batch = pack([np.arange(1, 20, dtype=np.int32)], 32).as_dict()
    per_token = np.asarray(Llama(cfg).apply(restore(path), batch))
    assert per_token.shape == (1, 32) and np.all(np.isfinite(per_token)) and per_token.sum() > 0


def test_cli_refuses_bad_image_model_options(capsys):
    from test_train_cli import _main
    code, err = _main(["--model", "cnn", "--max-tokens", "100"], capsys)
    assert code == 2 and "--model cnn: --max-tokens 100 must be a multiple of 65" in err, err
    code, err = _main(["--model", "nnx", "--min-bucket", "65"], capsys)
    assert code == 2 and "--model nnx trains on the digits, whole images per row" in err, err


@pytest.mark.slow
def test_cli_trains_the_batchnorm_cnn_and_nnx_on_digits(tmp_path):
    """`jaxodc train --model cnn / nnx` on both comms (images per microbatch from --max-tokens);
    the CNN's export holds updated BatchNorm statistics Flax evaluates with. (BatchNorm's
    training loss depends on how the balancer groups images into microbatches, so the two runs'
    losses are not compared.)"""
    from test_train_cli import _train
    path, js = tmp_path / "cnn.msgpack", tmp_path / "runs.json"
    _train(["--model", "cnn", "--ranks", "2", "--steps", "3", "--minibatch", "6", "--max-tokens", "260",
            "--comm", "odc,collective", "--warmup", "0", "--json", str(js), "--export", str(path)])
    for name, recs in json.load(open(js)).items():
        per_step = {}
        for r in recs:
            per_step.setdefault(r["step"], set()).add(r["loss"])
        assert sorted(per_step) == [0, 1, 2] and all(len(v) == 1 and np.isfinite(min(v)) for v in per_step.values())
    from jaxodc.data import decode_images, load_digits
    from jaxodc.balance.packing import pack
    from jaxodc.models.cnn import CNN
    variables = restore(str(path).replace(".msgpack", ".odc-lb_mini.msgpack"))
    assert not np.allclose(variables["batch_stats"]["BatchNorm_0"]["var"], 1.0)  # trained statistics
    images, _ = decode_images(pack(load_digits().tokens[:4], 4 * 65).as_dict())
    ce = np.asarray(CNN().apply(variables, images, train=False))
    assert ce.shape == (4,) and np.all(np.isfinite(ce))
    _train(["--model", "nnx", "--ranks", "2", "--steps", "2", "--minibatch", "2", "--max-tokens", "130",
            "--d-model", "16", "--layers", "1", "--comm", "odc", "--warmup", "0", "--json", str(js)])
    assert all(np.isfinite(r["loss"]) for r in json.load(open(js))["odc + lb_mini"])
