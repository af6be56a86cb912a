"""GRPO (PPO-clip with group-normalised advantages) as a per-token loss over the same sharded
machinery as SFT, so ODC, LB-Mini and LB-Steal apply unchanged.

A model's per-token output is its cross entropy on the packed targets (x loss_mask), so the new
policy's log-probability of each target is logp = -that. Per trained token t (loss_mask = 1):

    ratio_t = exp(logp_t - old_t)
    loss_t  = -min(ratio_t * A_t, clip(ratio_t, 1 - eps, 1 + eps_high) * A_t)
              + kl_coef * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)

with A_t the sample's advantage, old_t the behaviour policy's log-probability and ref_t the frozen
reference's; the loss sums loss_t over the minibatch's trained tokens and divides by their global
count (what the trainers do for every loss), so no sample's length changes another's weight.

The per-token values travel in the batch dict as packed fields (packing.Sample.fields, named
below; jaxodc.modeling.dataset.load_rollouts fills them). Without `old_logp` the behaviour policy
is the current one: old = stop_gradient(logp), exactly what a forward pass of the step's starting
parameters gives (ratio 1, gradient A * grad logp), without running that pass twice. Without
`ref_logp`, `reference_logprobs` computes it once, up front, from the frozen (initial) weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc.modeling.units import StagedModel

ADVANTAGE, OLD_LOGP, REF_LOGP = "advantages", "old_logp", "ref_logp"
FIELDS = (ADVANTAGE, OLD_LOGP, REF_LOGP)


@dataclass(frozen=True)
class GRPO:
    """GRPO's objective. `clip_eps`: PPO's clip range below 1; `clip_eps_high`: above 1 (None:
    the same; DAPO's clip-higher raises it); `kl_coef`: weight of the KL estimate against the
    reference (0: no reference needed)."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0

    def __post_init__(self):
        if not 0 < self.clip_eps < 1 or (self.clip_eps_high is not None and self.clip_eps_high <= 0):
            raise ValueError(f"GRPO needs 0 < clip_eps < 1 and clip_eps_high > 0, got {self.clip_eps}, {self.clip_eps_high}")
        if self.kl_coef < 0:
            raise ValueError(f"GRPO needs kl_coef >= 0, got {self.kl_coef}")

    def token_loss(self, logp: jax.Array, batch) -> jax.Array:
        """The per-token loss [B, T] (0 where loss_mask is 0) from the policy's per-token
        log-probabilities `logp` and the batch's fields (module docstring)."""
        if ADVANTAGE not in batch:
            raise ValueError(f"a GRPO batch needs the per-token field {ADVANTAGE!r} (rollouts: "
                             "jaxodc.modeling.dataset.load_rollouts)")
        mask = batch["loss_mask"]
        logp = logp.astype(jnp.float32)
        adv = batch[ADVANTAGE].astype(jnp.float32)
        old = batch[OLD_LOGP].astype(jnp.float32) if OLD_LOGP in batch else jax.lax.stop_gradient(logp)
        ratio = jnp.exp(jnp.where(mask > 0, logp - old, 0.0))
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - self.clip_eps, 1.0 + high) * adv)
        if self.kl_coef:
            if REF_LOGP not in batch:
                raise ValueError(f"GRPO with kl_coef={self.kl_coef} needs the per-token field {REF_LOGP!r}: give "
                                 '"ref_logprobs" in the rollouts or compute them (rl.reference_logprobs)')
            d = jnp.where(mask > 0, batch[REF_LOGP].astype(jnp.float32) - logp, 0.0)
            loss = loss + self.kl_coef * (jnp.exp(d) - d - 1.0)
        return loss * mask

    def linen_loss(self, apply: Callable, batch) -> jax.Array:
        """For jaxodc.modeling.adapters.linen_loss_fn(module, cfg.linen_loss): `apply(batch)` returns
        per-token cross entropy x loss_mask (models/llama.py); the summed GRPO loss."""
        return jnp.sum(self.token_loss(-apply(batch), batch))


class GRPOModel(StagedModel):
    """A unit-staged model (models/lm.py) whose last unit's per-token cross entropy becomes the
    GRPO per-token loss; parameters, units and init are the model's own."""

    def __init__(self, model, grpo: GRPO):
        self.model, self.grpo = model, grpo
        self.unit_names = tuple(model.unit_names)

    def init(self, *args, **kwargs):
        return self.model.init(*args, **kwargs)

    def apply_unit(self, name: str, params, carry, batch):
        out = self.model.apply_unit(name, params, carry, batch)
        return self.grpo.token_loss(-out, batch) if name == self.unit_names[-1] else out


def task_fields(task: str | None, grpo: GRPO | None = None) -> tuple[str, ...]:
    """The per-token fields a `task`'s packed batches carry: none for SFT; GRPO's advantages and
    behaviour log-probabilities, and the reference's with a KL term."""
    if task != "grpo":
        return ()
    return (ADVANTAGE, OLD_LOGP) + ((REF_LOGP,) if (grpo or GRPO()).kl_coef else ())


def task_loss(task: str | None, grpo: GRPO | None = None) -> Callable:
    """The linen loss(apply, batch) of `task` (train.adapters.linen_loss_fn): the summed per-token
    loss (SFT: the cross entropy under the loss mask), or GRPO's objective."""
    if task == "grpo":
        return (grpo or GRPO()).linen_loss
    return lambda apply, batch: apply(batch).sum()


def task_model(model, task: str, grpo: GRPO | None = None):
    """`model` trained on `task`: "sft" as it is; "grpo": a unit-staged model wrapped in GRPOModel
    (a loss function must compute GRPO itself: linen_loss_fn(module, GRPO(...).linen_loss))."""
    if task == "sft":
        return model
    if task != "grpo":
        raise ValueError(f"task must be 'sft' or 'grpo', got {task!r}")
    if hasattr(model, "apply_unit"):
        return GRPOModel(model, grpo or GRPO())
    return model


def token_logprobs(token_losses: Callable, params, samples: Sequence, max_tokens: int) -> list[np.ndarray]:
    """Per sample, the log-probability of each target under `params` ([L], 0 where its loss mask
    is 0), from token_losses(params, batch) -> per-token cross entropy x loss_mask [1, T] (a
    unit-staged model's `token_losses`, or a linen module's apply). One sample per microbatch of
    max_tokens tokens, so each sees exactly what it sees in training."""
    from jaxodc.balance.packing import pack
    fn = jax.jit(token_losses)
    out = []
    for s in samples:
        b = pack([s], max_tokens)
        nll = np.asarray(fn(params, {k: jnp.asarray(v) for k, v in b.as_dict().items()}))[0, :len(s)]
        out.append(np.where(b.loss_mask[0, :len(s)] > 0, -nll, 0.0).astype(np.float32))
    return out


def reference_logprobs(token_losses: Callable, params, samples: Sequence, max_tokens: int) -> list:
    """`samples` (packing.Sample) with the REF_LOGP field computed from the frozen reference
    weights `params` (every rank computes the same; for models too big for one rank, have the
    inference engine return "ref_logprobs" instead)."""
    from dataclasses import replace
    lps = token_logprobs(token_losses, params, samples, max_tokens)
    return [replace(s, fields={**s.fields, REF_LOGP: lp}) for s, lp in zip(samples, lps)]
