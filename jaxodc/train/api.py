"""The user-facing trainer API: `sharded_step` (one minibatch step of a unit-staged model with
fp32 parameter shards) and `Trainer` (a step plus balancing, metrics, checkpoints and the config
check across ranks).

A model follows the unit protocol (models/lm.py, models/mlp.py): `unit_names` (run order) and
`apply_unit(name, params, carry, batch) -> carry`, the last unit returning per-token losses; the
loss of a microbatch is their sum divided by the global token count of the minibatch. Without a
model class, decorate the per-unit function::

    @jaxodc.sharded_step(optimizer=optax.adam(1e-3), units=("embed", "block_0", "head"), comm="odc")
    def step(name, params, carry, batch): ...

    state = step.init(params, ctx=ctx)         # fp32 shards; comm="odc" also starts the runtime
    res = step(state, my_microbatches, global_tokens)   # one minibatch; res.loss is global
    state.save("ckpt"); state.close()

The state is not a pytree: under ODC the parameters live in the runtime's shared memory, where
peers read them, so a step updates `state` in place (and returns the minibatch's StepResult).
Both are the trainer core of jaxodc.train.collective, which is what runs: one gathered unit at a
time inside remat'd stages, any Optax transformation on the local shards (use
collective.clip_by_global_norm for clipping), ODC or collective communication.

`Trainer(model, optimizer, comm=..., balance=..., max_tokens=...)` adds what a training run
needs: it plans every global minibatch (balance.make_plan), packs samples, runs it (train_loop),
keeps per-rank metrics, saves and restores checkpoints, and, when created, checks that all ranks
agree on its configuration.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import optax

from jaxodc.train.balance import BALANCERS
from jaxodc.train.collective import CollectiveTrainer, OdcTrainer, StepResult, train_loop
from jaxodc.train.cost import CostModel
from jaxodc.train.metrics import MinibatchRecord, summarize
from jaxodc.train.units import Layout, StagedModel, make_layout, unshard_params

COMMS = ("odc", "collective")


class ConfigMismatchError(ValueError):
    """Ranks were configured differently."""


class UnitModel(StagedModel):
    """A per-unit function as a model of the unit protocol."""

    def __init__(self, apply_unit: Callable, unit_names: Sequence[str]):
        self.apply_unit = apply_unit
        self.unit_names = tuple(unit_names)
        if not self.unit_names:
            raise ValueError("a unit model needs at least one unit name")


def _as_model(fn_or_model, units):
    if hasattr(fn_or_model, "apply_unit"):
        if units is None:
            return fn_or_model
        return UnitModel(fn_or_model.apply_unit, units)
    if not callable(fn_or_model):
        raise TypeError(f"sharded_step needs a model with apply_unit/unit_names or a per-unit function, "
                        f"got {type(fn_or_model).__name__}")
    if units is None:
        raise ValueError("sharded_step over a per-unit function needs units=(unit names in run order)")
    return UnitModel(fn_or_model, units)


def _check_comm(comm: str) -> None:
    if comm not in COMMS:
        raise ValueError(f"unknown comm {comm!r}; choose one of {COMMS}")


class ShardedState:
    """Sharded parameters + optimizer state of one rank (the trainer core, `.core`) and the ODC
    runtime when the step created it. Not a pytree: it changes in place."""

    def __init__(self, core, runtime=None):
        self.core, self._runtime = core, runtime

    comm = property(lambda self: self.core.comm)
    rank = property(lambda self: self.core.rank)
    world = property(lambda self: self.core.world)
    layout: Layout = property(lambda self: self.core.layout)
    step = property(lambda self: self.core.version, doc="minibatches done (restored with checkpoints)")
    shards = property(lambda self: self.core.shards)
    opt_state = property(lambda self: self.core.opt_state)

    def local_shards(self) -> dict[str, np.ndarray]:
        return self.core.local_shards()

    def local_opt_state(self):
        return self.core.local_opt_state()

    def save(self, path: str) -> str:
        return self.core.save(path)

    def restore(self, path: str) -> int:
        return self.core.restore(path)

    def close(self) -> None:
        """Shut down the ODC runtime this state started (all ranks close together)."""
        if self._runtime is not None:
            rt, self._runtime = self._runtime, None
            rt.close()


class ShardedStep:
    """One minibatch step of `model` with `optimizer` under `comm`; see the module docstring.
    Calls: `init(params, ctx=None, runtime=None) -> ShardedState`, then
    `step(state, microbatches, global_tokens) -> StepResult`."""

    def __init__(self, model, optimizer: optax.GradientTransformation, comm: str = "odc"):
        _check_comm(comm)
        if not hasattr(optimizer, "update"):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
        self.model, self.optimizer, self.comm = model, optimizer, comm

    def layout(self, params, world: int) -> Layout:
        """The unit layout for `world` ranks (params may be arrays or jax.ShapeDtypeStruct)."""
        return make_layout(params, world, order=self.model.unit_names)

    def init(self, params: dict, *, ctx=None, runtime=None, **runtime_kwargs) -> ShardedState:
        """Shard `params` (every rank passes the same full parameters) and set up communication.
        comm="collective": jax.distributed must span the job (jaxodc.dist.init_jax_distributed).
        comm="odc": pass `runtime` (an OdcRuntime) or `ctx` (a jaxodc.dist.Context) to start
        one here (`runtime_kwargs` go to jaxodc.odc.Runtime, e.g. timeout_s, transport)."""
        if self.comm == "collective":
            if ctx is not None and jax.process_count() != ctx.world:
                raise RuntimeError(f"rank {ctx.rank}: comm='collective' needs jax.distributed over the job's "
                                   f"{ctx.world} processes (jax sees {jax.process_count()}); call "
                                   "jaxodc.dist.init_jax_distributed(ctx) before using jax")
            return ShardedState(CollectiveTrainer(self.model, self.optimizer, params))
        owned = None
        if runtime is None:
            if ctx is None:
                raise ValueError("comm='odc' needs ctx= (jaxodc.dist.Context) or runtime=")
            from jaxodc.train.odc_runtime import TrainerRuntime
            runtime = owned = TrainerRuntime.create(self.layout(params, ctx.world), ctx, **runtime_kwargs)
        try:
            return ShardedState(OdcTrainer(self.model, self.optimizer, params, runtime), owned)
        except BaseException:
            if owned is not None:
                owned.close(barrier=False)
            raise

    def __call__(self, state: ShardedState, microbatches: Iterable[dict], global_tokens: float) -> StepResult:
        """This rank's microbatches of one minibatch (dicts of arrays the model's apply_unit
        takes; collective: the same count and shapes on every rank), then the optimizer.
        `global_tokens`: loss tokens of the whole minibatch over all ranks."""
        if state.comm != self.comm:
            raise ValueError(f"state is comm={state.comm!r}, this step comm={self.comm!r}")
        return state.core.train_minibatch(microbatches, global_tokens)


def sharded_step(fn=None, optimizer: optax.GradientTransformation | None = None, *, units=None,
                 comm: str = "odc"):
    """A sharded training step (ShardedStep) for `fn`: a model with `unit_names`/`apply_unit`,
    or a per-unit function `fn(name, params, carry, batch) -> carry` with `units` = unit names in
    run order. Without `fn`, returns a decorator."""
    if fn is None:
        return functools.partial(sharded_step, optimizer=optimizer, units=units, comm=comm)
    if optimizer is None:
        raise ValueError("sharded_step needs optimizer= (an optax.GradientTransformation)")
    return ShardedStep(_as_model(fn, units), optimizer, comm)


# --------------------------------------------------------------------------- config agreement

def _digest(x) -> str:
    return hashlib.sha256(repr(x).encode()).hexdigest()[:12]


def check_same_config(ctx, config: dict, what: str = "trainer config") -> None:
    """All ranks of `ctx` must hold the same `config` (a dict of msgpack-able values); raises
    ConfigMismatchError on every rank naming each differing field and every rank's value."""
    if ctx is None or ctx.world == 1:
        return
    got = [msgpack.unpackb(b) for b in ctx.allgather(f"jaxodc/config/{what}", msgpack.packb(config))]
    diffs = []
    for key in config:
        vals = [g.get(key) for g in got]
        if any(v != vals[0] for v in vals):
            diffs.append(f"{key} (" + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(vals)) + ")")
    if diffs:
        raise ConfigMismatchError(f"rank {ctx.rank}: ranks disagree on the {what}: " + "; ".join(diffs))


class Trainer:
    """Train a unit-staged model on variable-length token samples across the ranks of a job.

    Trainer(model, optimizer, comm="odc", balance="lb_mini", max_tokens=512, params=None,
            cost=None, ctx=None, min_bucket=None, seed=0)

    - `params`: initial parameters, the same on every rank (default: model.init(PRNGKey(seed))).
    - `balance`: a balancer of jaxodc.train.balance (default lb_mini for odc, lb_micro for
      collective; lb_steal needs odc). `max_tokens`: tokens per packed microbatch (the memory
      bound); `cost`: the CostModel the balancers use; `min_bucket`: bucketed row lengths.
    - `ctx`: the job's jaxodc.dist.Context (default: init_from_env(), closed by close()).
      comm="collective" also needs jaxodc.dist.init_jax_distributed(ctx) before jax is used.

    Creating it exchanges its configuration with every rank first (comm, balance, max_tokens,
    min_bucket, cost, layout fingerprint, optimizer-state structure) and raises
    ConfigMismatchError naming the fields that differ and every rank's value."""

    def __init__(self, model, optimizer: optax.GradientTransformation, *, comm: str = "odc",
                 balance: str | None = None, max_tokens: int, params: dict | None = None,
                 cost: CostModel | None = None, ctx=None, min_bucket: int | None = None, seed: int = 0,
                 **runtime_kwargs):
        _check_comm(comm)
        balance = balance or ("lb_mini" if comm == "odc" else "lb_micro")
        if balance not in BALANCERS:
            raise ValueError(f"unknown balancer {balance!r}; choose one of {BALANCERS}")
        if comm == "collective" and balance == "lb_steal":
            raise ValueError("balance='lb_steal' claims microbatches at run time; it needs comm='odc'")
        if int(max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self._own_ctx = ctx is None
        if ctx is None:
            from jaxodc.dist import init_from_env
            ctx = init_from_env()
        self.ctx = ctx
        self.comm, self.balance, self.max_tokens = comm, balance, int(max_tokens)
        self.cost = cost or CostModel()
        self.min_bucket = min_bucket
        self.records: list[MinibatchRecord] = []
        self.state: ShardedState | None = None
        try:
            if params is None:
                params = model.init(jax.random.PRNGKey(seed))
            self.step_fn = sharded_step(model, optimizer, comm=comm)
            layout = self.step_fn.layout(params, ctx.world)
            shapes = {u.name: jax.ShapeDtypeStruct((u.shard,), jnp.float32) for u in layout.units}
            opt_struct = jax.tree_util.tree_map(lambda s: (tuple(s.shape), str(s.dtype)),
                                                jax.eval_shape(optimizer.init, shapes))
            check_same_config(ctx, {
                "comm": comm, "balance": balance, "max_tokens": self.max_tokens, "min_bucket": min_bucket,
                "cost": [float(self.cost.a), float(self.cost.b)],
                "layout fingerprint": layout.fingerprint(),
                "optimizer-state structure": _digest(jax.tree_util.tree_flatten(opt_struct)),
            })
            self.state = self.step_fn.init(params, ctx=ctx, **runtime_kwargs)
        except BaseException:
            self._close_ctx()
            raise

    # properties ---------------------------------------------------------------------------
    rank = property(lambda self: self.state.rank)
    world = property(lambda self: self.state.world)
    step = property(lambda self: self.state.step, doc="minibatches done (restored with checkpoints)")
    layout = property(lambda self: self.state.layout)

    # training -----------------------------------------------------------------------------
    def train_minibatch(self, samples: Sequence[np.ndarray], progress: bool = False) -> MinibatchRecord:
        """One global minibatch: `samples` (1-D int token arrays) is the whole minibatch over
        all ranks, the same list on every rank; it is planned with the trainer's balancer and
        each rank runs its part. Returns this rank's record (loss is the global loss)."""
        samples = list(samples)
        if not samples:
            raise ValueError(f"rank {self.rank}: empty minibatch: no samples to train on")
        return self.fit(samples, [range(len(samples))], progress=progress)[0]

    def fit(self, samples: Sequence[np.ndarray], minibatches: Iterable[Sequence[int]] | None = None, *,
            minibatch: int | None = None, steps: int | None = None, seed: int = 0,
            progress: bool = False) -> list[MinibatchRecord]:
        """Train on global minibatches of `samples` (index lists, the same on every rank), or,
        with `minibatch` (samples per rank) and `steps`, on minibatches self.step .. steps-1
        of the seeded shuffled stream data.minibatches(len(samples), world * minibatch, seed)
        -- so a restored trainer continues where its checkpoint left off. Returns this rank's
        records (also appended to self.records)."""
        if minibatches is None:
            if minibatch is None or steps is None:
                raise ValueError("fit needs minibatches= or both minibatch= (samples per rank) and steps=")
            minibatches = self.minibatch_stream(len(samples), minibatch, steps, seed)
        recs = train_loop(self.state.core, samples, minibatches, self.balance, self.max_tokens, self.cost,
                          progress=progress, min_bucket=self.min_bucket)
        self.records.extend(recs)
        return recs

    def minibatch_stream(self, n_samples: int, minibatch: int, steps: int, seed: int = 0) -> list[np.ndarray]:
        """Global minibatches self.step .. steps-1 of the seeded stream (epochs reshuffled)."""
        from jaxodc.train.data import minibatches as stream
        return list(itertools.islice(stream(n_samples, self.world * minibatch, seed=seed, epochs=None),
                                     self.step, max(steps, self.step)))

    # metrics ------------------------------------------------------------------------------
    def gather_records(self, records: Sequence[MinibatchRecord] | None = None) -> list[MinibatchRecord]:
        """Every rank's records (default: all of self.records), on every rank."""
        from dataclasses import asdict
        mine = [asdict(r) for r in (self.records if records is None else records)]
        out = []
        for blob in self.ctx.allgather("jaxodc/trainer/records", msgpack.packb(mine)):
            for d in msgpack.unpackb(blob):
                d["compute"] = [tuple(x) for x in d["compute"]]
                d["opt"] = tuple(d["opt"]) if d.get("opt") else None
                out.append(MinibatchRecord(**d))
        return out

    def summary(self, records: Sequence[MinibatchRecord] | None = None) -> dict:
        """metrics.summarize over every rank's records (samples/s, tokens/s, bubble, loss);
        collective over ranks."""
        return summarize(self.gather_records(records))

    # parameters and checkpoints -----------------------------------------------------------
    def full_params(self) -> dict:
        """The full parameters (numpy), assembled from every rank's shards; collective."""
        mine = {n: np.asarray(x, np.float32).tobytes() for n, x in self.state.local_shards().items()}
        got = [msgpack.unpackb(b) for b in self.ctx.allgather("jaxodc/trainer/params", msgpack.packb(mine))]
        return unshard_params(self.layout, [{n: np.frombuffer(b, np.float32) for n, b in g.items()} for g in got])

    def save(self, path: str) -> str:
        """Checkpoint (jaxodc.train.checkpoint); all ranks call it together."""
        return self.state.save(path)

    def restore(self, path: str) -> int:
        """Load a checkpoint of the same world, layout and optimizer; returns its step."""
        return self.state.restore(path)

    def close(self) -> None:
        """Stop the ODC runtime (all ranks together) and the context this trainer created."""
        try:
            if self.state is not None:
                self.state.close()
        finally:
            self._close_ctx()

    def _close_ctx(self) -> None:
        if self._own_ctx and self.ctx is not None:
            from jaxodc.dist import shutdown
            ctx, self.ctx = self.ctx, None
            shutdown(ctx)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
            return
        # After a failure peers may be stuck: close without waiting for them.
        if self.state is not None and self.state._runtime is not None:
            rt, self.state._runtime = self.state._runtime, None
            rt.close(barrier=False)
        if self._own_ctx and self.ctx is not None:
            ctx, self.ctx = self.ctx, None
            ctx.rendezvous.close()
            if ctx.server is not None:
                ctx.server.close()
