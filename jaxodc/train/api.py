"""The user-facing trainer API: `sharded_step` (the sharded trainer of a unit-staged model) and
`Trainer` (that plus balancing, metrics, checkpoints and the config check across ranks).

A model follows the unit protocol (models/lm.py, models/mlp.py): `unit_names` (run order) and
`apply_unit(name, params, carry, batch) -> carry`, the last unit returning per-token losses; the
loss of a microbatch is their sum divided by the global token count of the minibatch. Without a
model class, decorate the per-unit function::

    @jaxodc.sharded_step(optimizer=optax.adam(1e-3), units=("embed", "block_0", "head"), comm="odc")
    def step(name, params, carry, batch): ...

    state = step.init(params, ctx=ctx)                # fp32 shards; comm="odc" also starts the runtime
    res = state.train_minibatch(my_microbatches, global_tokens)   # one minibatch; res.loss is global
    state.save("ckpt"); state.close()

The state is a mutable object, not a pytree: under ODC the parameters live in the runtime's shared
memory, where peers read them, so a minibatch updates the state in place (like `nnx.Optimizer`).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import optax

from jaxodc.balance.cost import CostModel
from jaxodc.compress.policy import Compression, CompressionPlan, setting_of
from jaxodc.train.collective import CollectiveTrainer
from jaxodc.balance.plan import validate_run
from jaxodc.train.core import ShardedTrainer, check_same, train_loop
from jaxodc.train.odc import OdcTrainer
from jaxodc.train.metrics import MinibatchRecord, summarize
from jaxodc.balance.packing import pack
from jaxodc.modeling.precision import MixedPrecision, precision_of
from jaxodc.modeling.program import Program, program_of
from jaxodc.train.straggle import Straggle
from jaxodc.modeling.units import Layout, StagedModel


class UnitModel(StagedModel):
    """A per-unit function as a model of the unit protocol."""

    def __init__(self, apply_unit: Callable, unit_names: Sequence[str]):
        self.apply_unit = apply_unit
        self.unit_names = tuple(unit_names)
        if not self.unit_names:
            raise ValueError("a unit model needs at least one unit name")


def _as_model(fn_or_model, units):
    """A unit-staged model, a per-unit function with its unit names, or (no `units`) a loss
    function / Program, which the trainers take as they are."""
    if isinstance(fn_or_model, Program):
        return fn_or_model
    if hasattr(fn_or_model, "apply_unit"):
        if units is None:
            return fn_or_model
        return UnitModel(fn_or_model.apply_unit, units)
    if not callable(fn_or_model):
        raise TypeError(f"sharded_step needs a model with apply_unit/unit_names, a per-unit function (with units=) "
                        f"or a loss_fn(params, batch), got {type(fn_or_model).__name__}")
    if units is not None:
        return UnitModel(fn_or_model, units)
    if _positional_arity(fn_or_model) == 4:
        raise ValueError("sharded_step over a per-unit function fn(name, params, carry, batch) needs units=(unit "
                         "names in run order); a loss_fn takes (params, batch)")
    return fn_or_model


def _positional_arity(fn) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


class ShardedStep:
    """Builds the sharded trainer of `model` with `optimizer` under `comm` (see the module docstring).

    `init(params, ctx=None, runtime=None)` returns the trainer, a `ShardedTrainer` (the mutable
    state): `train_minibatch(microbatches, global_tokens) -> StepResult`, `save`, `restore`, `close`.
    """

    def __init__(self, model, optimizer: optax.GradientTransformation, comm: str = "odc",
                 compress: Compression | None = None, unit_policy: dict | None = None,
                 precision: str | MixedPrecision = "fp32", reproducible: bool | None = None):
        validate_run(comm, None)
        precision = precision_of(precision)  # checked here, before any rank starts
        if not hasattr(optimizer, "update"):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
        if compress is not None and not isinstance(compress, Compression):
            raise TypeError(f"compress must be a jaxodc.compress.Compression or None, got {type(compress).__name__}")
        self.model, self.optimizer, self.comm, self.compress = model, optimizer, comm, compress
        self.unit_policy, self.precision = dict(unit_policy or {}), precision
        if reproducible is not None and not isinstance(reproducible, bool):
            raise TypeError(f"reproducible must be True, False or None, got {reproducible!r}")
        self.reproducible = reproducible
        self._programs: dict = {}

    def program(self, params, world: int, example_batch=None) -> Program:
        """The model made shardable for `world` ranks (params may be arrays or
        jax.ShapeDtypeStruct); a loss function is traced on `example_batch` (once per world)."""
        if world not in self._programs:
            # the collective shards per parameter (train.units, "per_leaf"), ODC contiguously
            policy = dict(self.unit_policy)
            sharding = policy.pop("sharding", "per_leaf" if self.comm == "collective" else "contiguous")
            self._programs[world] = program_of(self.model, params, world, example_batch=example_batch,
                                               sharding=sharding, **policy)
        return self._programs[world]

    def layout(self, params, world: int, example_batch=None) -> Layout:
        """The unit layout for `world` ranks."""
        return self.program(params, world, example_batch).layout

    def compression_plan(self, params, world: int, example_batch=None) -> CompressionPlan | None:
        """The compression setting resolved on the layout (None without compression)."""
        if self.compress is None:
            return None
        return self.compress.plan(self.layout(params, world, example_batch))

    def config(self, params, world: int, example_batch=None) -> dict:
        """What every rank must agree on before training: comm, layout, optimizer-state structure,
        compression setting, and the initial values themselves (a digest: ranks that initialised
        from their own seeds would stitch one model out of several)."""
        layout = self.layout(params, world, example_batch)
        shapes = {u.name: jax.ShapeDtypeStruct((u.shard,), jnp.float32) for u in layout.units}
        opt_struct = jax.tree_util.tree_map(lambda s: (tuple(s.shape), str(s.dtype)),
                                            jax.eval_shape(self.optimizer.init, shapes))
        return {"comm": self.comm, "layout fingerprint": layout.fingerprint(),
                "optimizer-state structure": _digest(jax.tree_util.tree_flatten(opt_struct)),
                **setting_of(self.compression_plan(params, world, example_batch)), "precision": str(self.precision),
                "reproducible": self.reproducible,
                "initial parameter values (a digest: every rank must pass the same; init from one seed, not the "
                "rank)": _values_digest(params)}

    def init(self, params, *, ctx=None, runtime=None, check: bool = True, example_batch=None,
             **runtime_kwargs) -> ShardedTrainer:
        """Shards `params` (every rank passes the same full parameters) and sets up communication.

        Args:
          params: the full initial parameters.
          ctx: the job's `jaxodc.launch.Context`. With it, ranks first check that they agree on
            `config()` (ConfigMismatchError otherwise); comm="odc" starts a runtime here
            (`runtime_kwargs` go to `jaxodc.odc.Runtime`, e.g. timeout_s, transport).
          runtime: an ODC runtime to use instead (comm="odc"); the caller closes it. With
            comm="collective", `transport=` picks its collectives: "gloo" (jax's) or "jaxodc" (the
            lock-step collective over jaxodc's own shm / tcp paths).
          check: run the config check (Trainer runs a larger one itself).
          example_batch: one microbatch, for a loss function (its units are found by tracing it).

        Returns:
          The trainer (CollectiveTrainer or OdcTrainer).
        """
        if check and ctx is not None and ctx.world > 1:
            check_same(functools.partial(ctx.allgather, "jaxodc/config/step"),
                       self.config(params, ctx.world, example_batch), ctx.rank, "trainer config")
        if self.comm == "collective":
            if ctx is not None and jax.process_count() != ctx.world:
                raise RuntimeError(f"rank {ctx.rank}: comm='collective' needs jax.distributed over the job's "
                                   f"{ctx.world} processes (jax sees {jax.process_count()}); call "
                                   "jaxodc.launch.init_jax_distributed(ctx) before using jax")
            world = jax.device_count()
            transport = runtime_kwargs.pop("transport", "gloo")
            if runtime_kwargs:
                raise ValueError(f"comm='collective' takes transport= ('gloo' or 'jaxodc') only, got "
                                 f"{sorted(runtime_kwargs)} (options of the ODC runtime)")
            return CollectiveTrainer(self.program(params, world, example_batch), self.optimizer, params,
                                     compress=self.compression_plan(params, world, example_batch),
                                     precision=self.precision, transport=transport)
        world = runtime.world if runtime is not None else ctx.world if ctx is not None else None
        if world is None:
            raise ValueError("comm='odc' needs ctx= (jaxodc.launch.Context) or runtime=")
        program = self.program(params, world, example_batch)
        plan = self.compression_plan(params, world, example_batch)
        if runtime is not None:
            if self.reproducible and getattr(runtime, "accumulate", "exact") != "exact":
                raise ValueError(f"rank {runtime.rank}: reproducible=True, but the runtime passed sums pushes with "
                                 f"accumulate={runtime.accumulate!r}; create it with accumulate='exact'")
            return OdcTrainer(program, self.optimizer, params, runtime, compress=plan, precision=self.precision)
        from jaxodc.odc import Runtime
        runtime = Runtime.create(program.runtime_units(), ctx, **_with_accumulate(self.reproducible, runtime_kwargs))
        try:
            return OdcTrainer(program, self.optimizer, params, runtime, owns_runtime=True, compress=plan,
                              precision=self.precision)
        except BaseException:
            runtime.close(barrier=False)
            raise


def _with_accumulate(reproducible: bool | None, runtime_kwargs: dict) -> dict:
    """The ODC runtime's kwargs with `accumulate` set by `reproducible` (None: left to the kwargs
    or $JAXODC_ODC_ACCUMULATE)."""
    if reproducible is None:
        return runtime_kwargs
    want, given = ("exact" if reproducible else "fp32"), runtime_kwargs.get("accumulate")
    if given is not None and given != want:
        raise ValueError(f"reproducible={reproducible} sums pushes with accumulate={want!r}, "
                         f"but accumulate={given!r} was passed too")
    return {**runtime_kwargs, "accumulate": want}


def sharded_step(fn=None, optimizer: optax.GradientTransformation | None = None, *, units=None,
                 comm: str = "odc", compress: Compression | None = None, unit_policy: dict | None = None,
                 precision: str | MixedPrecision = "fp32", reproducible: bool | None = None):
    """The sharded trainer builder for a model or a per-unit function.

    Args:
      fn: a model with `unit_names` / `apply_unit`; a per-unit function
        `fn(name, params, carry, batch) -> carry` (with `units`); or any
        `loss_fn(params, batch)` returning the microbatch's SUMMED loss, over any parameter pytree
        (`jaxodc.modeling.adapters` makes one of a flax linen / nnx module): its units are discovered
        and each gathered where it is first used (`init` then needs `example_batch=`). It may
        return (that, new state) for BatchNorm-like state (`jaxodc.modeling.state`: the minibatch's
        new state is the count-weighted mean of its microbatches'). Omitted, `sharded_step` is a
        decorator.
      optimizer: any Optax transformation (clip with `jaxodc.clip_by_global_norm`).
      units: the unit names in run order (a per-unit function needs them).
      comm: "odc" or "collective".
      compress: TAGC gradient compression (`jaxodc.compress.Compression`), None for none.
      unit_policy: for a loss function, `train.discover.discover_units`' options (units=,
        stacked=, frozen=, max_unit_bytes=), and with mutable state count_fn= (batch -> the
        microbatch's count; default the sum of batch["loss_mask"] or batch["mask"]).
      precision: "fp32", "bf16" or a `MixedPrecision` (`jaxodc.modeling.precision`): FSDP2's mixed
        precision -- fp32 master shards and optimizer, units gathered and computed in bf16, the
        batch's float leaves cast to bf16, gradients sent in the reduce dtype (bf16 unless
        `MixedPrecision(reduce_dtype="fp32")` or "bf16,reduce=fp32") and summed in fp32.
      reproducible: True: same seed, data and world give bit-identical parameters under
        comm="odc" too -- owners sum pushes exactly (order-independent fixed point), which costs
        16 bytes per owned element (4 for the default fp32 sum, FSDP's memory) and under 3% of
        throughput; CPU owners only (docs/reproducibility.md). False: the fp32 sum. None
        (default): $JAXODC_ODC_ACCUMULATE, else the fp32 sum. The collective is reproducible
        either way (its reduction order is fixed).

    Returns:
      A `ShardedStep`; `.init(params, ctx=ctx)` gives the trainer (the mutable state).

    Example:
      >>> tr = sharded_step(model, optax.adam(1e-3), comm="odc").init(params, ctx=ctx)
      >>> res = tr.train_minibatch(my_microbatches, global_tokens)
    """
    if fn is None:
        return functools.partial(sharded_step, optimizer=optimizer, units=units, comm=comm, compress=compress,
                                 unit_policy=unit_policy, precision=precision, reproducible=reproducible)
    if optimizer is None:
        raise ValueError("sharded_step needs optimizer= (an optax.GradientTransformation)")
    return ShardedStep(_as_model(fn, units), optimizer, comm, compress, unit_policy, precision, reproducible)


def _task(model, task: str, grpo, precision):
    """(the model to train, the per-token fields its batches carry, the task's config to check
    across ranks) for Trainer(task=...)."""
    from jaxodc.modeling.rl import GRPO, task_fields, task_model
    if task == "sft":
        if grpo is not None:
            raise ValueError("grpo= settings apply to task='grpo'")
        return task_model(model, task), (), {"task": task}
    grpo = GRPO() if grpo is None else grpo
    if not isinstance(grpo, GRPO):
        raise TypeError(f"grpo must be a jaxodc.modeling.rl.GRPO, got {type(grpo).__name__}")
    p = precision_of(precision)
    if p.param_dtype != "fp32" and p.cast_inputs:
        raise ValueError(f"task='grpo' with precision {str(p)!r} would round the advantages and log-probabilities "
                         "to bf16 (the batch's float leaves are cast): add keep_inputs (\"bf16,keep_inputs\", "
                         "MixedPrecision(cast_inputs=False))")
    return task_model(model, task, grpo), task_fields(task, grpo), {"task": task, "grpo": repr(grpo)}


def _digest(x) -> str:
    return hashlib.sha256(repr(x).encode()).hexdigest()[:12]


def _values_digest(params) -> str | None:
    """A digest of every leaf's bytes (None for abstract parameters, e.g. a checkpoint each rank
    reads its own ranges of)."""
    from jaxodc.comm.hashing import hash_array
    leaves = jax.tree_util.tree_leaves(params)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return None
    keys = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x  # noqa: E731
    return _digest([hash_array(np.asarray(keys(x))) for x in leaves])


class Trainer:
    """Train a unit-staged model on variable-length token samples across the ranks of a job.

    Creating it exchanges its configuration with every rank first (comm, balance, max_tokens,
    min_bucket, cost, layout fingerprint, optimizer-state structure) and raises
    ConfigMismatchError naming the fields that differ and every rank's value.

    Args:
      model: a unit-staged model (`unit_names`, `apply_unit`, `init`), or a
        `loss_fn(params, batch)` over packed token microbatches (tokens, targets, segment_ids,
        positions, loss_mask; [1, max_tokens]) returning their summed loss (or (that, new
        state): BatchNorm) -- e.g. a flax module through `jaxodc.modeling.adapters.linen_loss_fn` --
        with `params=`. Fixed-size samples (images) ride as fixed-length token samples
        (`jaxodc.data.load_digits` / `decode_images`).
      optimizer: any Optax transformation; it runs on the local shards.
      comm: "odc" or "collective".
      balance: a balancer of jaxodc.balance.plan (default lb_mini for odc, lb_micro for
        collective; lb_steal needs odc).
      max_tokens: tokens per packed microbatch (the memory bound).
      params: initial parameters, the same on every rank (default: model.init(PRNGKey(seed))).
      cost: the CostModel the balancers plan with.
      ctx: the job's `jaxodc.launch.Context` (default: init_from_env(), closed by close()).
        comm="collective" also needs `jaxodc.launch.init_jax_distributed(ctx)` before jax is used.
      min_bucket: bucketed row lengths (packing.bucket), so compute follows content.
      seed: the parameter init seed when `params` is None, and the dropout keys' (a loss function
        naming rng streams gets `modeling.adapters.microbatch_key(seed, step, samples)` in every
        packed batch: the same masks on whichever rank runs a microbatch).
      compress: TAGC gradient compression (`jaxodc.compress.Compression`: which parameters, kept
        fraction, sketch ratio), None for none; records then report wire bytes, kept fraction and
        peeled / estimated counts.
      precision: "fp32", "bf16" or a `MixedPrecision` (see `sharded_step`).
      straggle: straggler injection (`jaxodc.train.straggle.Straggle`; records then carry the
        injected seconds per microbatch), None for none; every rank the same (checked).
      task: "sft" (the model's summed per-token loss over the samples' loss masks) or "grpo"
        (jaxodc.modeling.rl: a unit-staged model's per-token cross entropy becomes the GRPO loss
        with `grpo`'s settings; a loss function computes it itself, e.g.
        linen_loss_fn(module, grpo.linen_loss)). Samples: jaxodc.modeling.dataset's.
      grpo: the GRPO objective's settings (`jaxodc.modeling.rl.GRPO`; default GRPO()).
      reproducible: bit-identical parameters across runs under comm="odc" (the exact sum: 16
        bytes per owned element; see `sharded_step`); None: $JAXODC_ODC_ACCUMULATE, else fp32.
      normalize: what the minibatch's summed loss is divided by: "tokens" (its loss tokens, a
        language model's mean per token), "samples" (its number of samples: a per-sample loss,
        classification, a reward model) or "none" (the sum); the same on every rank (checked).
      frozen: path patterns (globs over "/"-joined paths, or "re:" regexes) of float leaves of a
        loss function's `params` that must not train (a frozen embedding, a reference model, a
        buffer): kept whole on every rank, no gradient. Linen collections other than "params" and
        nnx variables other than `Param` are frozen already (modeling/adapters.py).
      **runtime_kwargs: for `jaxodc.odc.Runtime` (comm="odc"), e.g. timeout_s, transport,
        link=jaxodc.odc.Link(mbps, ms) (an emulated slower network on the tcp transport).

    Example:
      >>> with Trainer(model, optax.adam(3e-3), comm="odc", max_tokens=256) as tr:
      ...     tr.fit(samples, minibatch=4, steps=100)
      ...     print(tr.summary())
    """

    def __init__(self, model, optimizer: optax.GradientTransformation, *, comm: str = "odc",
                 balance: str | None = None, max_tokens: int, params: dict | None = None,
                 cost: CostModel | None = None, ctx=None, min_bucket: int | None = None, seed: int = 0,
                 compress: Compression | None = None, precision: str | MixedPrecision = "fp32", straggle: Straggle | None = None,
                 task: str = "sft", grpo=None, reproducible: bool | None = None, frozen: Sequence[str] = (),
                 normalize: str = "tokens", **runtime_kwargs):
        balance = validate_run(comm, balance)
        from jaxodc.train.core import NORMALIZE
        if normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")
        if int(max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self._own_ctx = ctx is None
        if ctx is None:
            from jaxodc.launch.context import init_from_env
            ctx = init_from_env()
        self.ctx = ctx
        self.comm, self.balance, self.max_tokens = comm, balance, int(max_tokens)
        self.cost = cost or CostModel()
        self.min_bucket = min_bucket
        self.records: list[MinibatchRecord] = []
        self.state: ShardedTrainer | None = None
        try:
            if params is None:
                if not hasattr(model, "init"):
                    raise ValueError("a loss function needs params= (its initial parameters)")
                params = model.init(jax.random.PRNGKey(seed))
            model, fields, task_config = _task(model, task, grpo, precision)
            self.task = task
            if isinstance(frozen, str):
                raise TypeError(f"frozen must be a sequence of path patterns, got the string {frozen!r}")
            self.step_fn = sharded_step(model, optimizer, comm=comm, compress=compress, precision=precision,
                                        reproducible=reproducible,
                                        unit_policy={"frozen": tuple(frozen)} if frozen else None)
            # a loss function is traced on one packed microbatch (the batches fit() feeds it)
            example = None if hasattr(model, "apply_unit") else pack([], self.max_tokens, fields=fields).as_dict()
            streams = tuple(getattr(model, "rng_streams", ()))  # modeling/adapters.py
            if streams:
                from jaxodc.train.core import with_key
                example = with_key(example, seed, 0, ())
            if ctx.world > 1:
                config = {**self.step_fn.config(params, ctx.world, example), **task_config, "balance": balance,
                          "max_tokens": self.max_tokens, "min_bucket": min_bucket,
                          "cost": [float(self.cost.a), float(self.cost.b), float(self.cost.c)],
                          "straggle": None if straggle is None else straggle.spec(), "normalize": normalize,
                          "dropout seed": seed if streams else None}
                check_same(functools.partial(ctx.allgather, "jaxodc/config/trainer"), config, ctx.rank,
                           "trainer config")
            if straggle is not None:
                straggle.check_world(ctx.world)
            self.state = self.step_fn.init(params, ctx=ctx, check=False, example_batch=example, **runtime_kwargs)
            self.state.straggle = straggle
            self.state.normalize, self.state.rng_seed = normalize, (seed if streams else None)
        except BaseException:
            self._close_ctx()
            raise

    # properties ---------------------------------------------------------------------------
    rank = property(lambda self: self.state.rank)
    world = property(lambda self: self.state.world)
    step = property(lambda self: self.state.version, doc="minibatches done (restored with checkpoints)")
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
        recs = train_loop(self.state, samples, minibatches, self.balance, self.max_tokens, self.cost,
                          progress=progress, min_bucket=self.min_bucket)
        self.records.extend(recs)
        return recs

    def minibatch_stream(self, n_samples: int, minibatch: int, steps: int, seed: int = 0) -> list[np.ndarray]:
        """Global minibatches self.step .. steps-1 of the seeded stream (epochs reshuffled)."""
        from jaxodc.data import minibatches as stream
        return list(itertools.islice(stream(n_samples, self.world * minibatch, seed=seed, epochs=None),
                                     self.step, max(steps, self.step)))

    # metrics ------------------------------------------------------------------------------
    def gather_records(self, records: Sequence[MinibatchRecord] | None = None) -> list[MinibatchRecord]:
        """Every rank's records (default: all of self.records), on every rank."""
        from dataclasses import asdict
        mine = [asdict(r) for r in (self.records if records is None else records)]
        out = []
        for blob in self.ctx.allgather("jaxodc/trainer/records", msgpack.packb(mine)):
            out += [MinibatchRecord.from_dict(d) for d in msgpack.unpackb(blob)]
        return out

    def summary(self, records: Sequence[MinibatchRecord] | None = None) -> dict:
        """metrics.summarize over every rank's records (samples/s, tokens/s, bubble, loss);
        collective over ranks."""
        return summarize(self.gather_records(records))

    # parameters and checkpoints -----------------------------------------------------------
    def full_params(self) -> dict:
        """The full parameters (numpy), in the model's own structure, assembled from every rank's
        shards; collective."""
        from jaxodc.train.export import full_params
        return full_params(self.state)

    def export(self, path: str) -> str:
        """Writes the full parameters as a Flax msgpack file plain Flax loads
        (`flax.serialization.msgpack_restore`; jaxodc.train.export); collective: every rank calls
        it, rank 0 writes. Returns the absolute path."""
        from jaxodc.train.export import export
        return export(self.state, path, metadata={"balance": self.balance, "max_tokens": self.max_tokens})

    def export_hf(self, directory: str, dtype: str | None = None, max_shard_bytes: int | None = None) -> str:
        """Writes a Hugging Face model directory (config.json, safetensors shards and their index)
        of a model loaded with `jaxodc.modeling.load_hf`, in the checkpoint's dtype (or `dtype`),
        each rank writing the ranges it owns (jaxodc.modeling.hf_export); collective, the ranks
        sharing the directory's filesystem. Returns the absolute directory."""
        from jaxodc.modeling.hf_export import DEFAULT_SHARD_BYTES, export_hf
        config = getattr(self.state.program, "hf_config", None)
        if config is None:
            raise ValueError("export_hf needs a model loaded from a Hugging Face checkpoint "
                             "(jaxodc.modeling.load_hf(dir).program(...)); use export() for other models")
        return export_hf(self.state, directory, config, dtype, max_shard_bytes or DEFAULT_SHARD_BYTES)

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
            from jaxodc.launch.context import shutdown
            ctx, self.ctx = self.ctx, None
            shutdown(ctx)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
            return
        # After a failure peers may be stuck: close without waiting for them.
        if self.state is not None:
            self.state.close(barrier=False)
        if self._own_ctx and self.ctx is not None:
            ctx, self.ctx = self.ctx, None
            ctx.rendezvous.close()
            if ctx.server is not None:
                ctx.server.close()
