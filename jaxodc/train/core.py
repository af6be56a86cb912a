"""The FSDP core both sharded trainers share (comm="collective" in collective.py, comm="odc" in
odc.py): the optimizer step on local shards, step results, the run-time checks every rank must
agree on, and the minibatch loop.

Parameters live only as fp32 shards per unit (jaxodc.modeling.units). One microbatch runs the model
unit by unit (jaxodc.modeling.staging): each unit is gathered right before its stage, dropped after
it and gathered again in the backward pass. `gather` is the only thing the communication mode changes.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import optax

from jaxodc.balance.cost import CostModel
from jaxodc.balance.packing import bucket, fields_of, loss_tokens, pack, sample_loss_tokens
from jaxodc.balance.plan import Plan, make_plan, validate_run
from jaxodc.optim.clipping import global_reduction
from jaxodc.train.metrics import MinibatchRecord, Progress
from jaxodc.modeling.units import Layout, UnitSpec, gathered_params

class ConfigMismatchError(ValueError):
    """Ranks were configured differently (the message names each field and every rank's value)."""


def check_same(allgather_bytes: Callable[[bytes], list[bytes]], config: Mapping[str, Any], rank: int,
               what: str, error: type = ConfigMismatchError) -> None:
    """Raises `error` on every rank unless all ranks pass the same `config`.

    This is the one place where "do all ranks agree" is decided; the message names each differing
    field and every rank's value.

    Args:
      allgather_bytes: every rank's bytes (index = rank); a trainer's, or a job context's.
      config: msgpack-able values by field name.
      rank: this rank.
      what: what the fields describe, for the message.
    """
    values = [msgpack.unpackb(b) for b in allgather_bytes(msgpack.packb(dict(config)))]
    diffs = []
    for key in values[rank]:
        vals = [v.get(key) for v in values]
        if any(v != vals[0] for v in vals):
            diffs.append(f"{key} (" + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(vals)) + ")")
    if diffs:
        raise error(f"rank {rank}: ranks disagree on the {what}: " + "; ".join(diffs))


def optimizer_updates(optimizer: optax.GradientTransformation, shards, opt_state, grads,
                      reduce_fn: Callable[[jax.Array], jax.Array]):
    """(updates, new state) of the optimizer on local shards, `global_sum` bound to `reduce_fn`."""
    with global_reduction(reduce_fn):
        return optimizer.update(grads, opt_state, shards)


def optimizer_step(optimizer: optax.GradientTransformation, shards, opt_state, grads,
                   reduce_fn: Callable[[jax.Array], jax.Array]):
    """(new shards, new state): `optimizer_updates` applied."""
    upd, opt_state = optimizer_updates(optimizer, shards, opt_state, grads, reduce_fn)
    return optax.apply_updates(shards, upd), opt_state


@dataclass
class StepResult:
    """One minibatch on this rank. `loss`: global minibatch loss (sum over all ranks of token
    losses / global tokens). Intervals are perf_counter seconds."""

    version: int
    loss: float
    t_start: float
    t_end: float
    microbatches: list[tuple[float, float]] = field(default_factory=list)
    opt: tuple[float, float] = (0.0, 0.0)
    ran: list[tuple[int, ...]] = field(default_factory=list)  # train_plan: sample indices per microbatch run here
    # Process CPU seconds from t_start to t_end (every thread: compute, the ODC daemon's
    # accumulation, transports): with one core per rank, wall - cpu is the time it sat blocked.
    cpu: float = 0.0
    # Gradient exchange, where the trainer counts it (None otherwise): bytes this rank sent for the
    # units' gradients (compressed + dense); of those, the bytes of the pieces the compression
    # setting selects (without compression: of the pieces the default setting would select, sent
    # dense); with TAGC compression, the elements of this rank's shards decoded by peeling /
    # estimated and the kept fraction.
    wire_bytes: int | None = None
    wire_bytes_selected: int | None = None
    peeled: int | None = None
    estimated: int | None = None
    wire_bytes_units: dict[str, int] | None = None  # wire_bytes by unit
    kept_fraction: float | None = None  # of the compressed pieces' elements sent, the fraction kept
    straggle_s: list[float] | None = None  # with straggler injection (train.straggle): seconds added per microbatch
    # The end of the minibatch: seconds from this rank's gradients being complete (ODC: wait_complete
    # returned; collective: its last microbatch returned) to its end (the exchange of the loss and
    # the optimizer's global sums, the optimizer, the publication): `opt`'s length.
    end_s: float = 0.0


def microbatches_for(plan: Plan, rank: int, samples: Sequence[np.ndarray], pad_to: int | None = None,
                     min_bucket: int | Sequence[int] | None = None, lockstep: bool = False) -> list[dict]:
    """This rank's packed microbatches ([1, T] arrays) of a static plan. T = plan.max_tokens, or
    with `min_bucket` the microbatch's bucket (packing.bucket); `lockstep` (collective) uses, for
    step m, the largest bucket of any rank's m-th microbatch so all ranks agree on the shape.
    `pad_to` appends all-padding microbatches (collective: equal counts on every rank)."""
    if plan.balance == "lb_steal":
        raise ValueError("an lb_steal plan is claimed at run time (iter_steal); only comm='odc' runs it")
    mine = list(plan.ranks[rank])
    if pad_to is not None:
        if len(mine) > pad_to:
            raise ValueError(f"rank {rank} has {len(mine)} microbatches > pad_to={pad_to}")
        mine += [()] * (pad_to - len(mine))

    def size(r, m):
        mbs = plan.ranks[r]
        return bucket(plan.microbatch_tokens(mbs[m]) if m < len(mbs) else 0, plan.max_tokens, min_bucket)

    out, fields = [], fields_of(samples)  # the padding microbatches carry the same arrays
    for m, mb in enumerate(mine):
        if min_bucket is None:
            T = plan.max_tokens
        elif lockstep:
            T = max(size(r, m) for r in range(plan.world))
        else:
            T = size(rank, m)
        out.append(pack([samples[i] for i in mb], T, fields=fields).as_dict())
    return out


def with_key(batch: dict, seed: int | None, step: int, sample_ids: Sequence[int]) -> dict:
    """`batch` with its microbatch's key under "rng" (modeling.adapters.microbatch_key), if `seed`."""
    if seed is None:
        return batch
    from jaxodc.modeling.adapters import RNG_KEY, microbatch_key
    return {**batch, RNG_KEY: microbatch_key(seed, step, sample_ids)}


NORMALIZE = ("tokens", "samples", "none")


def plan_divisor(plan: Plan, samples: Sequence | None, normalize: str) -> float:
    """What the minibatch's summed loss is divided by: its loss tokens (plan_global_tokens), its
    number of samples (a per-sample loss: classification, a reward model), or 1 ("none")."""
    if normalize == "tokens":
        return plan_global_tokens(plan, samples)
    if normalize == "samples":
        return float(len(plan.lengths))
    if normalize == "none":
        return 1.0
    raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")


def plan_global_tokens(plan: Plan, samples: Sequence | None = None) -> float:
    """Loss tokens of the whole minibatch (what every microbatch loss is divided by): with the
    minibatch's `samples`, their loss masks' sum (packing.Sample: completion / assistant tokens
    only), else every sample's length - 1."""
    return loss_tokens(plan.lengths) if samples is None else sample_loss_tokens(samples)


class ShardedTrainer(abc.ABC):
    """What both sharded trainers share: identity, a byte all-gather, checkpoints.

    Subclasses set `comm`, `rank`, `world`, `layout`, `version` (minibatches done), `shards` and
    `opt_state`, and implement `train_minibatch`, `train_plan`, `allgather_bytes`,
    `local_shards`, `local_opt_state` and `load_local_state`.
    """

    comm: str
    rank: int
    world: int
    layout: Layout
    version: int
    # train_plan's packed batches carry microbatch_key(rng_seed, step, their samples) under "rng"
    # (a loss drawing random numbers; Trainer sets it); None: no key
    rng_seed: int | None = None
    # what train_plan divides the minibatch's summed loss by: "tokens" (loss tokens), "samples", "none"
    normalize: str = "tokens"

    @abc.abstractmethod
    def train_minibatch(self, microbatches: Iterable[dict], global_tokens: float) -> StepResult:
        """One minibatch: this rank's microbatches, then the optimizer step."""

    @abc.abstractmethod
    def train_plan(self, plan: Plan, samples: Sequence[np.ndarray],
                   min_bucket: int | Sequence[int] | None = None) -> StepResult:
        """One minibatch from a balancer's plan over `samples`."""

    @abc.abstractmethod
    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data` (index = rank). Collective: every rank calls it in the same order."""

    def allgather_obj(self, obj) -> list:
        """Every rank's msgpack-able `obj` (index = rank); collective."""
        return [msgpack.unpackb(b) for b in self.allgather_bytes(msgpack.packb(obj))]

    def check_same(self, config: Mapping[str, Any], what: str) -> None:
        """Raises ConfigMismatchError on every rank unless all ranks pass the same `config`."""
        check_same(self.allgather_bytes, config, self.rank, what)

    def local_consts(self) -> tuple:
        """The constants every rank keeps whole (with mutable state, its current values), as this
        rank's copies (a replicated global array's local one)."""
        return tuple(c.addressable_data(0) if isinstance(c, jax.Array) and not c.is_fully_addressable else c
                     for c in getattr(self, "consts", ()))

    def load_model_state(self, values: Sequence[np.ndarray]) -> None:
        """Replace the mutable model state's leaves (Program.state order; checkpoint.restore)."""
        consts = list(self.consts)
        for i, x in zip(self.program.state.consts, values):
            consts[i] = self._const(np.asarray(x, consts[i].dtype))
        self.consts = tuple(consts)

    def _const(self, x: np.ndarray) -> jax.Array:
        """A constant as this trainer holds it."""
        return jnp.asarray(x)

    @abc.abstractmethod
    def local_shards(self) -> dict[str, np.ndarray]:
        """This rank's fp32 parameter shards, as host copies."""

    @abc.abstractmethod
    def local_opt_state(self):
        """This rank's optimizer state, as host arrays."""

    @abc.abstractmethod
    def load_local_state(self, shards: dict, opt_state, version: int) -> None:
        """Replace this rank's shards, optimizer state and step (all ranks together)."""

    def local_residuals(self) -> dict[str, np.ndarray]:
        """This rank's TAGC error-feedback residuals (name -> fp32 host copy; checkpoints keep
        them), {} without compression."""
        return {}

    def load_residuals(self, residuals: Mapping[str, np.ndarray] | None) -> None:
        """Replace them (the names of local_residuals(); None: zeros, what a new trainer starts
        from). Every rank calls it together, between minibatches (checkpoint.restore does)."""

    def save(self, path: str) -> str:
        """Writes a checkpoint (jaxodc.train.checkpoint); all ranks call it together.

        Returns:
          The manifest's path.
        """
        from jaxodc.train.checkpoint import save
        return save(self, path)

    def restore(self, path: str) -> int:
        """Loads a checkpoint of the same world, layout and optimizer-state structure.

        Returns:
          The restored step.
        """
        from jaxodc.train.checkpoint import restore
        return restore(self, path)

    def close(self, barrier: bool = True) -> None:
        """Releases what the trainer owns (the ODC runtime, when it started one)."""


def train_loop(trainer: ShardedTrainer, samples, minibatch_indices: Iterable[Sequence[int]], balance: str, max_tokens: int,
               cost=None, progress: bool = False, estimate_busy: bool = False,
               min_bucket: int | Sequence[int] | None = None) -> list:
    """Run `trainer` (collective or ODC) over global minibatches (each a sequence of indices into
    `samples`, the same on every rank), planning each with `balance`. Returns this rank's
    metrics.MinibatchRecord list. `estimate_busy` (collective): set each record's busy time to
    the cost model's prediction (cost in seconds, e.g. from calibrate(ReferenceTrainer.timing_fn))
    plus the optimizer time, because the measured microbatch intervals include collective waits.
    `min_bucket`: bucketed microbatch shapes (packing.bucket), so compute follows the content."""
    cost = cost or CostModel()
    validate_run(trainer.comm, balance)
    batches = [list(map(int, b)) for b in minibatch_indices]
    bar = Progress(len(batches), f"{trainer.comm}+{balance}", enabled=progress and trainer.rank == 0)
    records = []
    for idx in batches:
        sub = [samples[i] for i in idx]
        plan = make_plan(balance, [len(x) for x in sub], trainer.world, max_tokens, cost)
        res = trainer.train_plan(plan, sub, min_bucket=min_bucket)
        mine = [i for mb in res.ran for i in mb]
        rec = MinibatchRecord.from_result(res, trainer.rank, len(mine), sum(plan.lengths[i] for i in mine),
                                          trainer.comm, balance)
        if estimate_busy:
            rec.busy_s = sum(cost.microbatch([plan.lengths[i] for i in mb]) for mb in res.ran) + (res.opt[1] - res.opt[0])
        records.append(rec)
        bar.update(loss=res.loss)
    return records

