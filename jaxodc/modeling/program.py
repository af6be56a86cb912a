"""What a sharded trainer trains: the unit layout, each rank's shards, the constants every rank
keeps whole, and the microbatch gradient given a gather. Two kinds:

- a unit-staged model (`units.StagedModel`: `unit_names` + `apply_unit`), whose stages are written
  by hand (models/lm.py);
- any `loss_fn(params, batch)` over any parameter pytree -- a plain JAX function, or a flax linen /
  nnx module reduced to one by `train.adapters` -- whose units are discovered from the tree
  (`train.discover`) and gathered where they are first used (`train.gather_on_use`, which traces
  the loss once per batch signature).

`loss_fn` returns the *sum* of its per-token (or per-sample) losses over the microbatch; the
trainer divides by the global count of the minibatch, because ranks run uneven microbatches and a
per-microbatch mean would weight them wrongly. It may also return `(that sum, new state)` for
mutable state such as BatchNorm statistics (train.state: the state leaves become constants, and
the minibatch's new state is the count-weighted mean of its microbatches'); any other output is
refused when first traced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from jaxodc.modeling.staging import GatherFn, microbatch_grad
from jaxodc.modeling.precision import cast_inputs
from jaxodc.modeling.units import Layout, make_layout, shard_params, unshard_params

# (gather, compute dtype, cast=True) -> fn(shards, consts, batch, global_count, gather_arg) -> (loss,
# grads w.r.t. shards); the gather returns units in the compute dtype (fp32, or bf16 under mixed
# precision), and with `cast` the batch's float leaves are cast to it too (train.precision).
GradBuilder = Callable[[GatherFn, Any], Callable]


@dataclass(frozen=True)
class Program:
    """A model made shardable (see the module docstring).

    Attributes:
      layout: the units (names, leaf shapes, padded sizes) for the world size.
      consts: the leaves every rank keeps whole (non-float or frozen leaves, BatchNorm statistics);
        passed to every microbatch step, never sent.
      grad: builds the microbatch gradient from the trainer's gather.
      shard: (full params, rank) -> that rank's fp32 shards {unit: array}.
      unshard: (every rank's shards (by rank), consts=None) -> the full parameters, in the model's
        own structure; `consts`: the trainer's current constants (its mutable state), default
        the initial ones.
      kind: "staged" or "traced".
      state: the loss's mutable state (train.state.ModelState), None without; then `grad`'s fn
        returns ((loss, weighted state [state.size]), grads) and the trainer writes the summed
        state back with `state.updated(consts, total)`.
      tree: the model's own parameter tree as its optimizer sees it (optim.placement.ParamTree);
        None: {unit: the unit's subtree} (`param_tree()`).
    """

    layout: Layout
    consts: tuple
    grad: GradBuilder
    shard: Callable[[Any, int], dict]
    unshard: Callable[[Sequence[Mapping[str, np.ndarray]]], Any]
    kind: str
    state: Any = None
    tree: Any = None

    def param_tree(self):
        """The model's own parameter tree and where each parameter lives (optim.placement)."""
        from jaxodc.optim.pieces import ParamTree
        return self.tree if self.tree is not None else ParamTree.of_layout(self.layout)

    def runtime_units(self) -> list[int]:
        """The ODC runtime's unit sizes: the layout's units, then (with mutable state) one more
        that carries the weighted state sums (odc.py)."""
        sizes = [u.padded for u in self.layout.units]
        if self.state is not None:
            sizes.append(-(-self.state.size // self.layout.world) * self.layout.world)
        return sizes


def staged_program(model, params: Mapping, world: int, sharding: str = "contiguous") -> Program:
    """The program of a unit-staged model: one unit per top-level key of `params` (`sharding`:
    train.units)."""
    layout = make_layout(params, world, order=model.unit_names, sharding=sharding)

    def grad(gather: GatherFn, compute_dtype=jnp.float32, cast: bool = True):
        g = microbatch_grad(model, layout, gather)  # stages take the gathered dtype as it comes
        dtype = compute_dtype if cast else jnp.float32
        return lambda shards, consts, batch, count, gather_arg: g(
            shards, cast_inputs(batch, dtype), count, gather_arg)

    return Program(layout, (), grad, lambda p, rank: shard_params(layout, p, rank),
                   lambda shards, consts=None: unshard_params(layout, shards), "staged")


def _checked_loss(loss_fn: Callable, params, stateful: bool) -> Callable:
    """loss_fn, checked on every trace to return what its first trace returned (train.state)."""
    from jaxodc.modeling.state import state_paths

    def loss(p, batch):
        out = loss_fn(p, batch)
        if (state_paths(out, params) is not None) != stateful:
            raise TypeError(f"loss_fn returned {'no ' if stateful else ''}new state for this batch signature, "
                            f"unlike for the example batch; return the same structure for every batch")
        return out
    return loss


def traced_program(loss_fn: Callable, params, example_batch, world: int, *, count_fn: Callable | None = None,
                   **policy) -> Program:
    """The program of any `loss_fn(params, batch)` (see the module docstring).

    Args:
      loss_fn: returns the microbatch's summed loss (a float scalar), or (that, new state) (train.state).
      params: the full parameter pytree (arrays or jax.ShapeDtypeStruct).
      example_batch: a microbatch (arrays or ShapeDtypeStruct): the loss is traced on it to find
        scan-stacked layers.
      world: ranks.
      count_fn: with mutable state, batch -> the microbatch's count, its new state's weight
        (default: the sum of batch["loss_mask"] or batch["mask"]).
      **policy: train.discover.discover_units' unit policy (units=, stacked=, frozen=,
        max_unit_bytes=, and sharding=).
    """
    from jaxodc.modeling.discover import const_leaves, shard_tree, unshard_tree
    from jaxodc.modeling.gather_on_use import microbatch_grad_any, plan_for
    from jaxodc.modeling.state import ModelState, default_count, freeze_patterns, model_state

    own = tuple(getattr(loss_fn, "frozen", ()))  # what the loss says is no parameter (adapters.py)
    if own:
        policy["frozen"] = tuple(policy.get("frozen") or ()) + own
    paths = model_state(loss_fn, params, example_batch)
    if paths:  # state leaves are constants whatever the unit policy says
        policy["frozen"] = tuple(policy.get("frozen") or ()) + freeze_patterns(paths)
    elif count_fn is not None:
        raise ValueError("count_fn= weights a loss's new state, and this loss returns no state")
    loss = _checked_loss(loss_fn, params, bool(paths))
    plan = plan_for(loss, params, example_batch, world, **policy)
    consts = tuple(jnp.asarray(x) for x in const_leaves(plan, params))
    state = None
    if paths:
        at = {p: i for i, p in enumerate(plan.const_paths)}
        leaves = [consts[at[p]] for p in paths]
        state = ModelState(paths, tuple(at[p] for p in paths), tuple(x.shape for x in leaves),
                           tuple(x.dtype for x in leaves), count_fn or default_count)

    def grad(gather, compute_dtype=jnp.float32, cast: bool = True):
        g = microbatch_grad_any(loss, plan, gather, has_aux=state is not None, compute_dtype=compute_dtype)
        dtype = compute_dtype if cast else jnp.float32

        def step(shards, consts, batch, count, gather_arg):
            out, grads = g(shards, consts, cast_inputs(batch, dtype), count, gather_arg)
            if state is None:
                return out, grads
            l, new = out  # the state's weights come from the batch as given (its masks in fp32)
            return (l, state.weighted(new, batch)), grads
        return step

    def unshard(shards, current=None):
        return unshard_tree(plan, shards, list(consts if current is None else current))

    from jaxodc.optim.pieces import ParamTree
    return Program(plan.layout, consts, grad, lambda p, rank: shard_tree(plan, p, rank), unshard, "traced", state,
                   ParamTree.of_plan(plan))


def program_of(model, params, world: int, *, example_batch=None, sharding: str = "contiguous", **policy) -> Program:
    """`model` as a Program: a Program as it is (whatever its layout's `sharding`), a unit-staged
    model, or a loss function (which needs `example_batch`); `sharding`: how units are cut into
    shards (train.units: "contiguous" for ODC, "per_leaf" for the collective)."""
    if isinstance(model, Program):
        if model.layout.world != world:
            raise ValueError(f"the program was built for {model.layout.world} ranks, the job has {world}")
        return model
    if hasattr(model, "apply_unit") and hasattr(model, "unit_names"):
        if policy:
            raise ValueError(f"a unit-staged model defines its own units; unit policy {sorted(policy)} does not apply")
        return staged_program(model, params, world, sharding)
    if callable(model):
        if example_batch is None:
            raise ValueError("a loss function needs example_batch= (one microbatch, arrays or "
                             "jax.ShapeDtypeStruct): its units are found by tracing the loss on it")
        return traced_program(model, params, example_batch, world, sharding=sharding, **policy)
    raise TypeError(f"expected a unit-staged model (unit_names, apply_unit), a loss_fn(params, batch) or a "
                    f"Program, got {type(model).__name__}")
