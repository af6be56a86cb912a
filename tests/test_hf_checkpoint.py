"""Hugging Face checkpoints in and out (jaxodc.modeling): logits of Llama (Llama 3 rope
scaling), Mistral and Qwen2 checkpoints written here against a numpy reference and transformers'
Flax models; sharded loading at 1, 2, 3 ranks against the whole load, reading only owned ranges;
bf16 checkpoints; export -> reload bit-exact (ours, safetensors', transformers'); one clear error
per bad checkpoint; training a loaded model at 2 ranks (ODC, collective) against single-process."""
import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy

import hf_reference
from jaxodc.modeling import safetensors_io
from jaxodc.modeling.hf_export import export_hf
from jaxodc.modeling.hf_load import load_hf
from jaxodc.modeling.llama import plain_batch
from jaxodc.modeling.safetensors_io import CheckpointError
from jaxodc.modeling.synthetic import tiny_config, write_checkpoint
from jaxodc.modeling.units import _path_str, flatten_unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {
    "llama3": dict(family="llama", llama3_scaling=True, rope_theta=500000.0),
    "mistral_tied": dict(family="mistral", tie=True, kv_heads=1, rope_theta=1000000.0),
    "qwen2_bias": dict(family="qwen2", tie=True, heads=4, kv_heads=2, rope_theta=10000.0),
}


def tensors_of(d):
    """Every tensor of a checkpoint directory, read with the safetensors library."""
    out = {}
    for fn in os.listdir(d):
        if fn.endswith(".safetensors"):
            out.update(safetensors.numpy.load_file(os.path.join(d, fn)))
    return out


def leaves_by_path(tree):
    return {_path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def tokens(vocab, B=2, T=24, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (B, T))


def assert_close(ours, ref):
    """fp32 against a float64 reference: every element within 1e-5 relative to the logits' scale."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max() / scale
    assert err <= 1e-5, f"max error {err:.3g} of the logits' scale {scale:.3g}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("attention", ["dense", "auto"])
def test_logits_equal_numpy_reference(tmp_path, name, attention):
    doc = tiny_config(**CONFIGS[name], vocab=80)
    write_checkpoint(str(tmp_path), doc, seed=3, max_shard_bytes=30_000)  # sharded, with an index
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ck = load_hf(str(tmp_path), attention=attention)
    toks = tokens(80)
    ours = ck.model.apply(ck.params(), plain_batch(toks), method="logits")
    assert_close(ours, hf_reference.logits(doc, tensors_of(str(tmp_path)), toks))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_logits_equal_transformers_flax(tmp_path, family):
    """transformers' Flax Llama / Mistral (rope theta 10000, no scaling: what they implement) read
    the same single-file checkpoint; the numpy reference agrees with them too."""
    transformers = pytest.importorskip("transformers")
    cls = {"llama": "FlaxLlamaForCausalLM", "mistral": "FlaxMistralForCausalLM"}[family]
    if not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls} (Flax was dropped in 5.x)")
    # Mistral v0.1's window (rows here are shorter): transformers' Flax Mistral masks everything but the
    # diagonal when sliding_window is null
    doc = tiny_config(family, vocab=64, **({"sliding_window": 4096} if family == "mistral" else {}))
    write_checkpoint(str(tmp_path), doc, seed=5)
    toks = tokens(64, T=16)
    ref = np.asarray(getattr(transformers, cls).from_pretrained(str(tmp_path))(toks).logits)
    ck = load_hf(str(tmp_path))
    assert_close(ck.model.apply(ck.params(), plain_batch(toks), method="logits"), ref)
    assert_close(ref, hf_reference.logits(doc, tensors_of(str(tmp_path)), toks))


@pytest.mark.parametrize("comm", ["odc", "collective"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_load_equals_whole_load(tmp_path, monkeypatch, comm, world):
    doc = tiny_config("qwen2", vocab=70, tie=False)
    write_checkpoint(str(tmp_path), doc, seed=1, max_shard_bytes=20_000)
    ck = load_hf(str(tmp_path))
    whole = ck.params()
    expect = leaves_by_path(whole)
    assert all(np.array_equal(expect[_hf_path(n)], v.astype(np.float32))  # the whole load is the files' values
               for n, v in tensors_of(str(tmp_path)).items())
    prog = ck.program(world, comm=comm, max_tokens=16)
    assert {u.sharding for u in prog.layout.units} == {"per_leaf" if comm == "collective" else "contiguous"}
    assert any(u.name.endswith("layers_1") for u in prog.layout.units)  # one unit per decoder layer
    reads = []
    real = safetensors_io.read_range
    monkeypatch.setattr("jaxodc.modeling.hf_load.read_range",
                        lambda e, lo, hi, out, f=None: (reads.append(hi - lo), real(e, lo, hi, out, f)))
    shards = []
    for r in range(world):
        reads.clear()
        shards.append(prog.shard(None, r))
        owned = 0
        for u in prog.layout.units:  # each shard equals the slice of the flattened whole unit
            a, b = u.shard_range(r)
            flat = np.asarray(flatten_unit(u, [expect[p] for p in u.paths]))
            np.testing.assert_array_equal(shards[r][u.name], flat[a:b])
            owned += sum(min((r + 1) * s, n) - min(r * s, n) for (_, n), (_, s) in
                         zip(u.leaf_pieces(), u.leaf_shards())) if u.per_leaf else \
                max(0, min(b, u.numel) - a)
        assert sum(reads) == owned  # a rank reads exactly the elements it owns
    back = leaves_by_path(prog.unshard(shards))
    assert back.keys() == expect.keys() and all(np.array_equal(back[k], expect[k]) for k in expect)


def _hf_path(name):
    from jaxodc.modeling.llama import param_path
    return param_path(name)


def test_bf16_checkpoint_loads_exactly(tmp_path):
    doc = tiny_config("llama", vocab=64, dtype="bfloat16", llama3_scaling=True)
    write_checkpoint(str(tmp_path), doc, seed=2)
    files = tensors_of(str(tmp_path))
    assert {str(x.dtype) for x in files.values()} == {"bfloat16"}
    ck = load_hf(str(tmp_path))
    got = leaves_by_path(ck.params())
    for name, x in files.items():
        assert got[_hf_path(name)].dtype == np.float32
        np.testing.assert_array_equal(got[_hf_path(name)], x.astype(np.float32))
    prog = ck.program(2, max_tokens=8)
    back = leaves_by_path(prog.unshard([prog.shard(None, r) for r in range(2)]))
    assert all(np.array_equal(back[k], got[k]) for k in got)


@pytest.mark.parametrize("threads,populate", [(1, True), (3, True), (3, False)])
@pytest.mark.parametrize("comm", ["odc", "collective"])
def test_threaded_read_equals_files(tmp_path, monkeypatch, threads, populate, comm):
    """read_shards split into many small jobs over threads (each mapping its own pages, or the
    whole mapping populated at once where MADV_POPULATE_WRITE is missing): every shard equals
    the safetensors library's values element by element, padding zero, and the jobs ran on
    `threads` threads."""
    import threading
    from jaxodc.modeling import hf_load
    doc = tiny_config("llama", vocab=64, dtype="bfloat16", llama3_scaling=True)
    write_checkpoint(str(tmp_path), doc, seed=3, max_shard_bytes=20_000)
    expect = {_hf_path(n): x.astype(np.float32) for n, x in tensors_of(str(tmp_path)).items()}
    monkeypatch.setattr(hf_load, "CHUNK", 37)  # pieces cut across chunk (and page) boundaries
    if not populate:
        monkeypatch.setattr(hf_load, "MADV_POPULATE_WRITE", None)
    who = set()
    real = safetensors_io.read_range
    monkeypatch.setattr(hf_load, "read_range", lambda *a: (who.add(threading.current_thread()), real(*a)))
    ck = load_hf(str(tmp_path))
    prog = ck.program(2, comm=comm, max_tokens=8)
    for r in range(2):
        who.clear()
        shards = ck.read_shards(prog.layout, r, threads=threads)
        assert len(who) == threads
        for u in prog.layout.units:
            a, b = u.shard_range(r)
            flat = np.asarray(flatten_unit(u, [expect[p] for p in u.paths]))
            np.testing.assert_array_equal(shards[u.name], flat[a:b])


def test_bf16_widening_is_exact(tmp_path):
    """read_range's bf16 -> fp32: every one of the 65536 bf16 bit patterns (NaN payloads,
    subnormals, signed zeros) becomes the fp32 whose top half it is."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    path = str(tmp_path / "all.safetensors")
    head, spans, size = safetensors_io.layout_file([("x", "BF16", (bits.size,))])
    safetensors_io.create_file(path, head, size)
    fd = os.open(path, os.O_WRONLY)
    try:
        safetensors_io.write_range(fd, spans["x"][0], 0, bits)
    finally:
        os.close(fd)
    entry = safetensors_io.read_header(path)[0]["x"]
    out = np.empty(bits.size, np.float32)
    safetensors_io.read_range(entry, 0, bits.size, out)
    np.testing.assert_array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16)


class OneRank:
    """What export_hf uses of a trainer, for rank `rank` of an in-process world whose shards are
    read from a checkpoint (ranks run one after the other: each writes only its own ranges)."""

    def __init__(self, prog, rank, shards):
        self.layout, self.rank, self._shards = prog.layout, rank, shards

    def local_shards(self):
        return self._shards

    def allgather_obj(self, obj):
        return [obj] * self.layout.world


@pytest.mark.parametrize("comm,world,dtype,shard_bytes", [("odc", 3, "float32", 25_000),
                                                          ("collective", 2, "bfloat16", 1 << 30),
                                                          ("odc", 1, "float32", 1 << 30)])
def test_export_round_trip(tmp_path, comm, world, dtype, shard_bytes):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    doc = tiny_config("qwen2", vocab=64, tie=True, dtype="float32")
    write_checkpoint(src, doc, seed=4)
    ck = load_hf(src)
    prog = ck.program(world, comm=comm, max_tokens=8)
    # masters no bf16 rounds exactly: the export casts them once
    shards = [{n: s + np.float32(1e-3) * np.sin(np.arange(s.size, dtype=np.float32)) for n, s in prog.shard(None, r).items()}
              for r in range(world)]
    for r in range(world):
        export_hf(OneRank(prog, r, shards[r]), out, ck.config, dtype=dtype, max_shard_bytes=shard_bytes)
    masters = leaves_by_path(prog.unshard(shards))
    np_dtype = safetensors_io.DTYPES["F32" if dtype == "float32" else "BF16"]
    want = {k: v.astype(np_dtype).astype(np.float32) for k, v in masters.items()}
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert (len(files) > 1) == (shard_bytes < 1 << 20)
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == dtype
    again = leaves_by_path(load_hf(out).params())  # ours
    assert again.keys() == want.keys() and all(np.array_equal(again[k], want[k]) for k in want)
    lib = tensors_of(out)  # the safetensors library's
    assert set(lib) == set(index["weight_map"])
    for name, x in lib.items():
        assert x.dtype == np_dtype
        np.testing.assert_array_equal(x.astype(np.float32), want[_hf_path(name)])


def test_export_reloads_in_transformers(tmp_path):
    """transformers' own loader (Flax, single file) reads the export bit-exactly."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxLlamaForCausalLM"):
        pytest.skip("transformers without Flax models")
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    write_checkpoint(src, tiny_config("llama", vocab=64, dtype="bfloat16"), seed=6)
    ck = load_hf(src)
    prog = ck.program(2, max_tokens=8)
    shards = [{n: s * np.float32(1.01) for n, s in prog.shard(None, r).items()} for r in range(2)]
    for r in range(2):
        export_hf(OneRank(prog, r, shards[r]), out, ck.config)
    m = transformers.FlaxLlamaForCausalLM.from_pretrained(out, dtype=np.float32)
    theirs = leaves_by_path(m.params)
    for path, x in leaves_by_path(prog.unshard(shards)).items():
        name = path[len("params/"):].replace("layers_", "layers/")
        t = theirs[name.replace("/weight", "/kernel") if "proj" in name or "lm_head" in name else
                   name.replace("embed_tokens/weight", "embed_tokens/embedding")]
        if "proj" in name or "lm_head" in name:
            t = t.T  # Flax Dense kernels are [in, out]
        import ml_dtypes
        np.testing.assert_array_equal(np.asarray(t, np.float32), x.astype(ml_dtypes.bfloat16).astype(np.float32))


# --------------------------------------------------------------------------- bad checkpoints

def _good(tmp_path, **kw):
    d = str(tmp_path / "ck")
    write_checkpoint(d, tiny_config("llama", vocab=64, **kw), seed=0, max_shard_bytes=20_000)
    return d


def _edit_config(d, **fields):
    p = os.path.join(d, "config.json")
    doc = json.load(open(p))
    doc.update(fields)
    json.dump(doc, open(p, "w"))


def _bad_missing_file(d):
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    fn = sorted(set(index["weight_map"].values()))[1]
    os.remove(os.path.join(d, fn))
    return [fn, "missing", "model.safetensors.index.json"]


def _bad_architecture(d):
    _edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    return ["config.json", "GPT2LMHeadModel", "not supported"]


def _bad_shape(d):
    _edit_config(d, intermediate_size=40)
    return ["mlp.", "shape", "config.json"]


def _bad_truncated(d):
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    fn = index["weight_map"]["model.norm.weight"]
    p = os.path.join(d, fn)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 10)
    return [fn, "truncated", "'"]


def _bad_missing_config(d):
    os.remove(os.path.join(d, "config.json"))
    return ["config.json", "missing"]


def _bad_rope(d):
    _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    return ["config.json", "rope_scaling", "yarn"]


def _bad_missing_tensor(d):
    index_p = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(index_p))
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    json.dump(index, open(index_p, "w"))
    return ["model.layers.1.mlp.up_proj.weight", "missing"]


def _bad_not_safetensors(d):
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    fn = sorted(set(index["weight_map"].values()))[0]
    open(os.path.join(d, fn), "wb").write(b"\xff" * 64)
    return [fn, "header"]


BAD = {f.__name__[5:]: f for f in (_bad_missing_file, _bad_architecture, _bad_shape, _bad_truncated,
                                   _bad_missing_config, _bad_rope, _bad_missing_tensor, _bad_not_safetensors)}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_one_clear_error(tmp_path, case):
    d = _good(tmp_path)
    words = BAD[case](d)
    with pytest.raises(CheckpointError) as e:
        load_hf(d).params()
    msg = str(e.value)
    assert all(w in msg for w in words), msg
    assert "\n" not in msg


def test_truncated_error_names_the_tensor(tmp_path):
    d = str(tmp_path / "one")
    write_checkpoint(d, tiny_config("llama", vocab=64), seed=0)
    p = os.path.join(d, "model.safetensors")
    header, _ = safetensors_io.read_header(p)
    last = max(header.values(), key=lambda e: e.start)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 4)
    with pytest.raises(CheckpointError, match=f"{p}: tensor '{last.name}' ends at .* truncated"):
        load_hf(d)


# --------------------------------------------------------------------------- training

def hf_case(d):
    """(loss_fn, full params, batch, count) of the checkpoint in `d`, as test_any_model_training's cases."""
    import jax.numpy as jnp
    from jaxodc.modeling.adapters import linen_loss_fn
    ck = load_hf(d)
    loss_fn = linen_loss_fn(ck.model, lambda apply, b: jnp.sum(apply(b)))

    def batch(step, rank, j):
        rs = np.random.RandomState([step, rank, j, 7])
        T = 8
        return {"tokens": rs.randint(1, 64, (1, T)).astype(np.int32),
                "targets": rs.randint(1, 64, (1, T)).astype(np.int32),
                "segment_ids": np.array([[1] * 5 + [2] * 3], np.int32),
                "positions": np.array([list(range(5)) + list(range(3))], np.int32),
                "loss_mask": np.ones((1, T), np.float32)}
    return ck, loss_fn, batch, lambda b: float(b["loss_mask"].sum())


def train_loaded(ctx, d, comm, out):
    if comm == "collective":
        from jaxodc.launch.context import init_jax_distributed
        init_jax_distributed(ctx)
    import jaxodc
    from test_any_model_training import STEPS, counts, optimizer
    ck, _, batch, count = hf_case(d)
    prog = ck.program(ctx.world, comm=comm, example_batch=batch(0, 0, 0))
    tr = jaxodc.sharded_step(prog, optimizer(), comm=comm).init(ck.abstract_params(), ctx=ctx,
                                                                example_batch=batch(0, 0, 0))
    n = counts(ctx.world, comm)
    losses = []
    for step in range(STEPS):
        total = sum(count(batch(step, r, j)) for r in range(ctx.world) for j in range(n[r]))
        losses.append(tr.train_minibatch([batch(step, ctx.rank, j) for j in range(n[ctx.rank])], total).loss)
    from jaxodc.train.export import full_params
    full = jax.tree_util.tree_map(np.asarray, full_params(tr))
    export_hf(tr, out, ck.config, max_shard_bytes=30_000)  # fp32 checkpoint: the masters exactly
    tr.close()
    return losses, full


@pytest.mark.timeout(600)
@pytest.mark.parametrize("comm", ["odc", "collective"])
def test_train_loaded_model_two_ranks_equals_single_process(tmp_path, comm):
    from harness import run_ranks
    from test_any_model_training import _reference, counts
    d, out = str(tmp_path / "ck"), str(tmp_path / "out")
    write_checkpoint(d, tiny_config("qwen2", vocab=64, tie=True, layers=2), seed=8)
    ck, loss_fn, batch, count = hf_case(d)
    ref_losses, ref_params = _reference(loss_fn, ck.params(), batch, count, comm, 2)
    results = run_ranks(train_loaded, 2, args=(d, comm, out), timeout_s=300)
    want = leaves_by_path(ref_params)
    for losses, full in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
        got = leaves_by_path(full)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=2e-6, err_msg=k)
    exported = leaves_by_path(load_hf(out).params())  # written rank by rank, read back exactly
    got = leaves_by_path(results[0][1])
    assert exported.keys() == got.keys() and all(np.array_equal(exported[k], got[k]) for k in got)


# --------------------------------------------------------------------------- the command

@pytest.mark.timeout(600)
def test_cli_train_hf_model_and_export(tmp_path, capsys):
    """`jaxodc train --model hf:DIR --export-hf OUT` on 2 ranks: the export holds exactly the
    trained parameters (the same run's Flax msgpack export) in the checkpoint's dtype; bad uses
    are refused before any rank starts."""
    import subprocess
    import sys
    from jaxodc.cli.train import main
    from jaxodc.train.export import read
    d, out, mp = tmp_path / "ck", tmp_path / "out", tmp_path / "p.msgpack"
    write_checkpoint(str(d), tiny_config("llama", vocab=256, hidden=32, layers=2), seed=9)
    assert main(["--export-hf", str(out)]) == 2 and "needs --model hf:DIR" in capsys.readouterr().err
    assert main(["--model", f"hf:{tmp_path / 'nope'}"]) == 2 and "not a directory" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "jaxodc", "train", "--model", f"hf:{d}", "--ranks", "2",
                        "--comm", "odc,collective",
                        "--steps", "2", "--minibatch", "2", "--max-tokens", "32", "--export-hf", str(out),
                        "--export", str(mp)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Hugging Face export:" in r.stdout and "minibatch 1: loss" in r.stdout, r.stdout
    start = leaves_by_path(load_hf(str(d)).params())
    for run in ("odc-lb_mini", "collective-lb_micro"):  # one export of each kind per run
        trained = leaves_by_path(read(str(tmp_path / f"p.{run}.msgpack")))
        again = leaves_by_path(load_hf(str(out / run)).params())
        assert again.keys() == trained.keys() and all(np.array_equal(again[k], trained[k]) for k in trained), run
        assert not all(np.array_equal(again[k], v) for k, v in start.items()), run


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_load_smoke(tmp_path):
    """`jaxodc bench load` on a small checkpoint: one record per W with the issue's fields, and
    each rank's loading peak within the memory bar (the time bar needs a quiet machine)."""
    import subprocess
    import sys
    js = tmp_path / "load.json"
    r = subprocess.run([sys.executable, "-m", "jaxodc", "bench", "load", "--gb", "0.03", "--ranks", "1,2",
                        "--json", str(js)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.load(open(js))
    assert [row["ranks"] for row in rows] == [1, 2]
    for row in rows:
        assert {"ranks", "checkpoint_bytes", "master_bytes", "peak_rss", "load_s", "baseline_s"} <= set(row)
        assert row["checkpoint_bytes"] >= 0.03e9 and row["master_bytes"] >= 2 * row["checkpoint_bytes"] * 0.99
        assert row["peak_rss"] <= 1.25 * row["master_bytes"] / row["ranks"] + 300 * (1 << 20), row
