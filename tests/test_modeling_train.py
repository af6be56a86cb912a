"""SFT with completion-only masks and GRPO through the sharded trainers: GRPO's loss and gradient
equal a direct implementation of the formula on a fixed batch; at 2 ranks, ODC (LB-Mini,
LB-Steal) and the collective equal single-process training of the same loss, losses per step and
parameters after the last step."""
import functools

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from harness import run_ranks

W, B, STEPS, MAX_TOKENS, LR, EPS = 2, 3, 3, 96, 1e-2, 1e-5
GRPO_KW = dict(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05)


@functools.cache
def _data(root: str):
    """(tokenizer dir, SFT samples, rollouts with behaviour log-probs, rollouts without)."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from support.tiny_tokenizer import CHATML, write_tokenizer
    from jaxodc.modeling import synthetic_data as synthetic
    from jaxodc.modeling.dataset import load_rollouts, load_sft
    from jaxodc.modeling.tokenizer import Tokenizer
    d = write_tokenizer(os.path.join(root, "tok"), CHATML)
    tok = Tokenizer(d)
    sft, _ = load_sft(synthetic.write_chat(os.path.join(root, "chat.jsonl"), 12, 6, seed=1), tok, MAX_TOKENS)
    roll, _ = load_rollouts(synthetic.write_rollouts(os.path.join(root, "r.jsonl"), tok, 4, 3, 8, seed=2,
                                                     prompt_words=(2, 5)), tok, MAX_TOKENS)
    bare, _ = load_rollouts(synthetic.write_rollouts(os.path.join(root, "b.jsonl"), tok, 4, 3, 8, seed=3,
                                                     logprobs=False, prompt_words=(2, 5)), tok, MAX_TOKENS)
    return d, sft.tokens, roll.tokens, bare.tokens


def _llama():
    import jax
    from jaxodc.balance.packing import pack
    from jaxodc.models.llama import Llama, LlamaConfig
    model = Llama(LlamaConfig(vocab=300, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn=32))
    return model, jax.jit(model.init)(jax.random.PRNGKey(0), pack([], MAX_TOKENS).as_dict())


def _lm():
    import jax
    from jaxodc.models.lm import LM, LMConfig
    model = LM(LMConfig(vocab=300, d_model=16, n_layers=1, n_heads=2, attention="dense"))
    return model, model.init(jax.random.PRNGKey(1))


def _case(name: str, root: str):
    """(model or loss fn for Trainer, params, token_losses(params, batch), samples, task, grpo)."""
    from jaxodc.modeling.rl import GRPO, reference_logprobs
    from jaxodc.modeling.adapters import linen_loss_fn
    _, sft, roll, bare = _data(root)
    if name == "sft":
        llama, params = _llama()
        return linen_loss_fn(llama, lambda apply, b: apply(b).sum()), params, llama.apply, sft, "sft", None
    if name == "grpo":  # behaviour log-probs given, KL against the initial weights computed up front
        llama, params = _llama()
        grpo = GRPO(**GRPO_KW)
        samples = reference_logprobs(llama.apply, params, roll, MAX_TOKENS)
        return linen_loss_fn(llama, grpo.linen_loss), params, llama.apply, samples, "grpo", grpo
    lm, params = _lm()  # "grpo_staged": the unit-staged LM, on-policy (no behaviour log-probs), no KL
    return lm, params, lm.token_losses, bare, "grpo", GRPO()


def _minibatches(n):
    from jaxodc.data import minibatches
    return [list(map(int, b)) for _, b in zip(range(STEPS), minibatches(n, W * B, seed=4, epochs=None))]


def _optimizer():
    import optax
    return optax.adam(LR, eps=EPS)


RUNS = [("sft", "odc", "lb_mini"), ("sft", "collective", "lb_micro"), ("grpo", "odc", "lb_mini"),
        ("grpo", "collective", "lb_micro"), ("grpo_staged", "odc", "lb_steal")]


def train_body(ctx, root):
    from jaxodc.launch.context import init_jax_distributed
    init_jax_distributed(ctx)
    from jaxodc.train.api import Trainer
    out = {}
    for name, comm, balance in RUNS:
        model, params, _, samples, task, grpo = _case(name, root)
        with Trainer(model, _optimizer(), comm=comm, balance=balance, max_tokens=MAX_TOKENS, params=params,
                     ctx=ctx, task=task, grpo=grpo) as tr:
            recs = tr.fit(samples, _minibatches(len(samples)))
            out[(name, comm, balance)] = ([r.loss for r in recs], tr.full_params())
    return out


def _reference(name: str, root: str):
    """Single process: the minibatch's samples one per microbatch, loss sums / the minibatch's
    trained-token count, Adam on the full parameters."""
    import jax
    import jax.numpy as jnp
    import optax
    from jaxodc.balance.packing import pack
    from jaxodc.modeling.rl import task_model
    model, params, _, samples, task, grpo = _case(name, root)
    if hasattr(model, "apply_unit"):
        staged = task_model(model, task, grpo)
        loss_fn = staged.loss_sum
    else:
        loss_fn = model
    opt = _optimizer()
    state = opt.init(params)
    grad = jax.jit(jax.value_and_grad(lambda p, b, n: loss_fn(p, b) / n))
    losses = []
    for idx in _minibatches(len(samples)):
        sub = [samples[i] for i in idx]
        n = jnp.float32(sum(s.loss_mask.sum() for s in sub))
        total, acc = 0.0, None
        for s in sub:
            lo, g = grad(params, {k: jnp.asarray(v) for k, v in pack([s], MAX_TOKENS).as_dict().items()}, n)
            total += float(lo)
            acc = g if acc is None else jax.tree_util.tree_map(jnp.add, acc, g)
        upd, state = opt.update(acc, state, params)
        params = optax.apply_updates(params, upd)
        losses.append(total)
    return losses, params


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hftrain"))
    _data(root)  # written once here; the ranks read the same files
    return root, run_ranks(train_body, W, args=(root,), timeout_s=600)


@pytest.mark.slow  # five trainings of two ranks each (~1 min on a quiet machine)
@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_sharded_equals_single_process(trained, run):
    import jax
    root, results = trained
    ref_losses, ref_params = _reference(run[0], root)
    assert len(set(np.round(ref_losses, 6))) == STEPS  # the loss moves
    for out in results:
        losses, params = out[run]
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=1e-6)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(ref_params)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=jax.tree_util.keystr(path))
    # the ranks end with the same parameters
    for (_, a), b in zip(jax.tree_util.tree_leaves_with_path(results[0][run][1]), jax.tree_util.tree_leaves(results[1][run][1])):
        np.testing.assert_array_equal(a, b)


def test_grpo_loss_and_gradient_equal_the_formula(tmp_path):
    """The loss against numpy, its gradient against the VJP of the policy's log-probabilities with
    the formula's derivative (dL/dlogp = mask / N * (-A r [r A <= clip(r) A] + beta (1 - exp(ref - logp))))."""
    import jax
    import jax.numpy as jnp
    from jaxodc.balance.packing import pack
    from jaxodc.modeling.rl import ADVANTAGE, GRPO, OLD_LOGP, REF_LOGP
    from jaxodc.modeling.adapters import linen_loss_fn
    llama, params = _llama()
    _, _, roll, _ = _data(str(tmp_path))
    rng = np.random.default_rng(5)
    fit, used = [], 0
    for s in roll:
        if used + len(s) <= MAX_TOKENS:
            fit.append(s)
            used += len(s)
    assert len(fit) >= 2
    batch = pack(fit, MAX_TOKENS).as_dict()
    mask = batch["loss_mask"]
    logp_fn = lambda p: -llama.apply(p, {k: jnp.asarray(v) for k, v in batch.items()})  # noqa: E731
    logp, vjp = jax.vjp(logp_fn, params)
    logp = np.asarray(logp, np.float64)
    # behaviour log-probs around the policy's so both clip edges and the inside are hit
    batch[OLD_LOGP] = (mask * (logp + rng.normal(0, 0.4, logp.shape))).astype(np.float32)
    batch[REF_LOGP] = (mask * (logp + rng.normal(0, 0.3, logp.shape))).astype(np.float32)
    batch[ADVANTAGE] = (mask * rng.normal(0, 1, logp.shape)).astype(np.float32)
    N = float(mask.sum()) * 1.5  # a global count larger than this microbatch's
    for cfg, old_given in ((GRPO(**GRPO_KW), True), (GRPO(), False)):
        b = dict(batch) if old_given else {k: v for k, v in batch.items() if k not in (OLD_LOGP, REF_LOGP)}
        old = b[OLD_LOGP] if old_given else logp
        r = np.where(mask > 0, np.exp(logp - old), 1.0)
        A = b[ADVANTAGE].astype(np.float64)
        hi = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
        unclipped, clipped = r * A, np.clip(r, 1 - cfg.clip_eps, 1 + hi) * A
        tok = -np.minimum(unclipped, clipped)
        dlogp = -A * r * (unclipped <= clipped)
        if cfg.kl_coef:
            d = np.where(mask > 0, b[REF_LOGP] - logp, 0.0)
            tok = tok + cfg.kl_coef * (np.exp(d) - d - 1)
            dlogp = dlogp + cfg.kl_coef * (1 - np.exp(d))
        want_loss = float(np.sum(tok * mask) / N)
        if old_given:
            assert (r < 1 - cfg.clip_eps).any() and (r > 1 + hi).any() and ((r > 1 - cfg.clip_eps) & (r < 1 + hi)).any()
        loss_fn = linen_loss_fn(llama, cfg.linen_loss)
        loss, g = jax.value_and_grad(lambda p: loss_fn(p, {k: jnp.asarray(v) for k, v in b.items()}) / N)(params)
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-7)
        (want_g,) = vjp(jnp.asarray(dlogp * mask / N, jnp.float32))
        for (path, a), w in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree_util.tree_leaves(want_g)):
            np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_grpo_trainer_errors():
    from jaxodc.modeling.rl import GRPO
    from jaxodc.train.api import _task
    with pytest.raises(ValueError, match="keep_inputs"):
        _task(None, "grpo", GRPO(), "bf16")
    with pytest.raises(ValueError, match="task must be 'sft' or 'grpo'"):
        _task(object(), "dpo", None, "fp32")
    with pytest.raises(ValueError, match="clip_eps"):
        GRPO(clip_eps=1.5)
