"""Single-process parity reference: full parameters on one device, the exact minibatch update.

update = optimizer(sum over all microbatches of grad(loss_sum(mb)) / global_tokens), in the plain
Flax/Optax way (no sharding, no units, stock optax transformations), so the sharded trainers can
be checked against it elementwise."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax


class ReferenceTrainer:
    def __init__(self, model, optimizer: optax.GradientTransformation, params: dict):
        self.model = model
        self.optimizer = optimizer
        self.params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
        self.opt_state = optimizer.init(self.params)
        self._grad = jax.jit(jax.value_and_grad(lambda p, b, n: model.loss_sum(p, b) / n))
        self._update = jax.jit(self._update_impl)

    def _update_impl(self, params, opt_state, grads):
        upd, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), opt_state

    def grads(self, microbatches: Sequence[dict], global_tokens: float) -> tuple[float, Any]:
        """(loss, grads) of one minibatch: every microbatch's loss_sum / global_tokens, summed."""
        if not microbatches:
            raise ValueError("empty minibatch: no microbatches")
        n = jnp.float32(global_tokens)
        total, acc = 0.0, None
        for mb in microbatches:
            loss, g = self._grad(self.params, mb, n)
            total += float(loss)
            acc = g if acc is None else jax.tree_util.tree_map(jnp.add, acc, g)
        return total, acc

    def apply(self, grads) -> None:
        """Optimizer update with minibatch gradients from `grads`."""
        self.params, self.opt_state = self._update(self.params, self.opt_state, grads)

    def step(self, microbatches: Sequence[dict], global_tokens: float) -> float:
        loss, g = self.grads(microbatches, global_tokens)
        self.apply(g)
        return loss

    def timing_fn(self, max_tokens: int, seed: int = 0, min_bucket: int | None = None):
        """step_fn for cost.calibrate: item (a length or a list of lengths) -> one packed microbatch
        of random tokens, forward + backward on this process alone, blocking. Pure compute with no
        communication: what a rank's busy time is when collectives' waits are taken out. Use the
        same `min_bucket` as training: without buckets every microbatch costs a full max_tokens row."""
        from jaxodc.balance.packing import bucket, pack
        rng = np.random.default_rng(seed)
        vocab = getattr(getattr(self.model, "cfg", None), "vocab", 256)

        def step(item):
            ls = [int(item)] if np.isscalar(item) else [int(x) for x in item]
            T = max_tokens if min_bucket is None else bucket(sum(ls), max_tokens, min_bucket)
            b = pack([rng.integers(0, vocab, size=L).astype(np.int32) for L in ls], T).as_dict()
            jax.block_until_ready(self._grad(self.params, b, jnp.float32(1.0)))

        return step

    def numpy_params(self) -> dict:
        return jax.tree_util.tree_map(np.asarray, self.params)
