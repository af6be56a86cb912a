"""The end of a minibatch on CUDA, 2 processes sharing the GPU: odc_allgather's CUDA handler inside
a jitted device program (every rank's float64 head exact, the partial sums summed in rank order
in float64 and rounded once: the CPU test's body and checks, tests/test_odc.py), and ODC training
whose end of minibatch is that one program returning the new shards (no masters in place on a
GPU), against the single-process reference (tests/test_end_of_minibatch.py's models, optimizers
and tolerances), with fp32 dots (TF32 moves Adam's near-zero elements past the CPU tolerances:
3.2e-5 on one element). Both tests passed on an NVIDIA H200 on 2026-11-28. Run on the device machine:
pytest -m gpu tests/gpu/test_odc_end_gpu.py (not collected in CI, which has no GPU)."""
import numpy as np
import pytest

import test_end_of_minibatch as teom
import test_odc
from harness import run_ranks

pytestmark = pytest.mark.gpu

GPU_ENV = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "JAX_DEFAULT_MATMUL_PRECISION": "highest"}  # fp32 dots, not TF32: the CPU tolerances
W = 2


def allgather_body(ctx):
    import jax
    assert jax.default_backend() == "gpu"
    return test_odc.program_allgather_body(ctx, "shm")


def test_allgather_inside_a_device_program():
    heads = np.stack([np.array([np.pi * (r + 1), 1e300, 2.0 ** 60 + r]) for r in range(W)])
    values = [np.random.default_rng([7, r]).standard_normal(70).astype(np.float32) * 10.0 ** r for r in range(W)]
    want = np.zeros(70)
    for v in values:
        want += v.astype(np.float64)
    for r, (rows, total, alone_rows, alone_total) in enumerate(run_ranks(allgather_body, W, timeout_s=180,
                                                                          env=GPU_ENV)):
        np.testing.assert_array_equal(rows, heads)
        np.testing.assert_array_equal(total, want.astype(np.float32))
        np.testing.assert_array_equal(alone_rows, np.tile(heads[r], (W, 1)))
        np.testing.assert_array_equal(alone_total, (W * values[r].astype(np.float64)).astype(np.float32))


def odc_train_body(ctx):
    import jax
    from jaxodc.data import Samples
    from jaxodc.train.api import sharded_step
    assert jax.default_backend() == "gpu"
    model, params, samples, mbs, n = teom._setup(ctx.world)
    out = {}
    for name, opt in teom.optimizers(n).items():
        tr = sharded_step(model, opt, comm="odc").init(params, ctx=ctx)
        assert tr._masters is None and (tr._end_program is not None) == bool(tr.end.rounds), name
        losses = [tr.train_plan(teom._plan("odc", samples, idx, ctx.world),
                                Samples([samples[i] for i in idx]).tokens).loss for idx in mbs]
        out[name] = (losses, tr.local_shards(), tr.layout)
        tr.close()
    return out


def test_odc_end_of_minibatch_on_cuda():
    import jax
    from jaxodc.balance.packing import pack
    from jaxodc.data import Samples
    from jaxodc.modeling.units import unshard_params
    from jaxodc.train.core import plan_global_tokens
    from jaxodc.train.reference import ReferenceTrainer

    results = run_ranks(odc_train_body, W, timeout_s=600, env=GPU_ENV)
    model, params, samples, mbs, n = teom._setup(W)
    for name, opt in teom.optimizers(n).items():
        ref = ReferenceTrainer(model, opt, params)
        ref_losses = []
        for idx in mbs:
            plan = teom._plan("odc", samples, idx, W)
            sub = Samples([samples[i] for i in idx])
            with jax.default_matmul_precision("highest"):  # as the ranks (GPU_ENV)
                ref_losses.append(ref.step([pack([sub.tokens[i] for i in mb], teom.MAX_TOKENS).as_dict()
                                            for r in plan.ranks for mb in r], plan_global_tokens(plan)))
        for r in results:
            np.testing.assert_allclose(r[name][0], ref_losses, rtol=1e-5, err_msg=name)
        atol = 1e-4 if name == "clip+global_mean+adam" else 1.5e-5
        got = unshard_params(results[0][name][2], [r[name][1] for r in results])
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(ref.numpy_params())):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol, err_msg=f"{name}: {jax.tree_util.keystr(path)}")
