"""Collective trainer (comm="collective") across 2 processes over gloo vs the single-process
reference: parameters after 3 minibatches agree elementwise (adam + exact global-norm clipping)."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W, B, MAX_TOKENS, STEPS, MAX_NORM, LR = 2, 4, 64, 3, 0.05, 1e-3
# The summed gradients agree with the reference to fp32 rounding (~1e-7 of the largest element;
# psum_scatter sums in another order), but adam's g / (sqrt(v) + eps) amplifies rounding by up to
# ~lr/eps on elements whose gradient is near eps. lr=1e-3, eps=1e-6 keep that below atol=1e-6 while
# every parameter still moves by ~lr per step.
EPS = 1e-6


def _setup():
    import jax
    from models.lm import LM, LMConfig
    from jaxodc.train.data import minibatches, synthetic_text
    model = LM(LMConfig(d_model=32, n_layers=2, n_heads=2))
    params = model.init(jax.random.PRNGKey(0))
    samples = synthetic_text("longalign", 64, MAX_TOKENS, seed=3, min_len=4)
    mbs = [idx for _, idx in zip(range(STEPS), minibatches(len(samples), W * B, seed=6))]
    return model, params, samples, mbs


BALANCE = ("lb_micro", "local_sort", "lb_mini")  # per step; lb_mini's unequal counts get padded


def _plan(samples, idx, step):
    from jaxodc.train.balance import make_plan
    from jaxodc.train.cost import CostModel
    return make_plan(BALANCE[step], samples.lengths[idx].tolist(), W, MAX_TOKENS, CostModel.for_transformer(32))


def _worker(rank: int, port: int, out: str) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=W, process_id=rank,
                               initialization_timeout=60)
    import optax
    from jaxodc.train.collective import CollectiveTrainer, clip_by_global_norm, microbatches_for, plan_global_tokens
    from jaxodc.train.data import Samples
    model, params, samples, mbs = _setup()
    tr = CollectiveTrainer(model, optax.chain(clip_by_global_norm(MAX_NORM), optax.adam(LR, eps=EPS)), params)
    losses, counts = [], []
    for step, idx in enumerate(mbs):
        plan = _plan(samples, idx, step)
        sub = Samples([samples[i] for i in idx])
        counts.append(plan.counts())
        losses.append(tr.train_plan(plan, sub.tokens).loss)
    np.savez(os.path.join(out, f"rank{rank}.npz"), **tr.local_shards())
    # Unequal microbatch counts must fail on every rank with a message naming them.
    err = ""
    try:
        tr.train_minibatch([microbatches_for(plan, rank, sub.tokens)[0]] * (1 + rank), 10.0)
    except ValueError as e:
        err = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"losses": losses, "counts": counts, "err": err, "fp": tr.layout.fingerprint()}, fh)
    jax.distributed.shutdown()


def _spawn(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(W)]
    outs = []
    try:
        for r, p in enumerate(procs):
            o, _ = p.communicate(timeout=150)
            outs.append(o)
            assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{o[-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_collective_matches_reference(tmp_path):
    import jax
    import optax
    from jaxodc.train.collective import microbatches_for, plan_global_tokens
    from jaxodc.train.data import Samples
    from jaxodc.train.reference import ReferenceTrainer
    from jaxodc.train.units import make_layout, unshard_params

    _spawn(tmp_path)
    model, params, samples, mbs = _setup()
    ref = ReferenceTrainer(model, optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adam(LR, eps=EPS)), params)
    ref_losses, norms = [], []
    for step, idx in enumerate(mbs):
        plan = _plan(samples, idx, step)
        sub = Samples([samples[i] for i in idx])
        mb_all = [m for r in range(W) for m in microbatches_for(plan, r, sub.tokens)]
        loss, g = ref.grads(mb_all, plan_global_tokens(plan))
        norms.append(float(optax.tree.norm(g)))
        ref_losses.append(ref.step(mb_all, plan_global_tokens(plan)))
    assert max(norms) > MAX_NORM, "clipping never triggered; the test would not exercise the global norm"

    info = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(W)]
    assert info[0]["fp"] == info[1]["fp"] == make_layout(params, W).fingerprint()
    assert any(len(set(c)) == 1 and max(c) > 1 for c in info[0]["counts"])
    assert any(len(set(c)) > 1 for c in info[0]["counts"]), info[0]["counts"]  # padding exercised
    for r in range(W):
        np.testing.assert_allclose(info[r]["losses"], ref_losses, rtol=1e-5)
        assert "microbatch count" in info[r]["err"] and "rank 0: 1" in info[r]["err"] and "rank 1: 2" in info[r]["err"]

    layout = make_layout(params, W, order=model.unit_names)
    shards = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(W)]
    got = unshard_params(layout, shards)
    want = ref.numpy_params()
    init = params
    for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want),
                               jax.tree_util.tree_leaves(init)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    moved = sum(float(np.abs(np.asarray(b) - np.asarray(c)).max()) for b, c in
                zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(init)))
    assert moved > 1e-2, "reference parameters did not move"
    # padding elements of every shard stay exactly zero
    for u in layout.units:
        full = np.concatenate([s[u.name] for s in shards])
        assert np.all(full[u.numel:] == 0)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
