"""comm="collective": the FSDP baseline with per-unit `all_gather` / `psum_scatter` in lock-step over a
1-D mesh of all processes' devices. transport="gloo": jax's own collectives (gloo on CPU, NCCL on
GPU); transport="jaxodc": the same collectives over jaxodc's shm / tcp paths (`LockstepGroup`), the
transport ODC uses, so that comparing the two measures the protocol rather than gloo."""
from __future__ import annotations

import functools
import hashlib
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxodc.balance.packing import pack
from jaxodc.balance.plan import Plan
from jaxodc.compress.collective import (UnitExchange, WireBytes, compressed_reduce_scatter, dense_wire_bytes,
                                        unit_exchange)
from jaxodc.compress.policy import CompressionPlan, setting_of, tracking_plan
from jaxodc.optim.clipping import global_reduction
from jaxodc.optim.placement import place
from jaxodc.train.unitwise import memory_schedule
from jaxodc.train.core import ShardedTrainer, StepResult, microbatches_for, optimizer_step, plan_divisor, with_key
from jaxodc.train.lockstep import GATHER_SCOPE, lockstep_gather, lockstep_sum
from jaxodc.modeling.staging import GatherFn
from jaxodc.modeling.precision import MixedPrecision, precision_of
from jaxodc.modeling.program import program_of
from jaxodc.train.straggle import Straggle, compile_seconds, microbatch_identity, stall
from jaxodc.modeling.units import flat_from_pieces

AXIS = "d"
TRANSPORTS = ("gloo", "jaxodc")
_HOST_WORDS = 1024  # the lockstep channel of allgather_bytes: [length, payload...] in float32 words


# Decode counts of a compressed unit leave its backward pass as the "cotangent" of a float32 [3, 2]
# input the loss never reads (custom_vjp outputs are the only way out of a backward pass), in base
# 4096 digits: (peeled, estimated, kept) x (count >> 12, count & 4095), exact as floats for any count below
# 2^31, and still exact if jax ever summed two such cotangents.
_DIGIT = 12


def _counts_to_carrier(counts: jax.Array) -> jax.Array:
    return jnp.stack([counts >> _DIGIT, counts & ((1 << _DIGIT) - 1)], axis=-1).astype(jnp.float32)


def _carrier_to_counts(carrier: jax.Array) -> jax.Array:
    digits = jnp.round(carrier).astype(jnp.int32)
    return (digits[..., 0] << _DIGIT) + digits[..., 1]


def _all_gather_bits(x: jax.Array, axis: str) -> jax.Array:
    """all_gather(x, tiled) moving a 16-bit float's bits as uint16: an all-gather only copies, and
    XLA:CPU otherwise runs a bf16 all-gather in f32 (its collectives have no bf16), holding the
    gathered unit in f32 and again in bf16 and sending twice the bytes. Free elsewhere (a bitcast)."""
    if jnp.dtype(x.dtype).itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.all_gather(x, axis, tiled=True)
    bits = jax.lax.all_gather(jax.lax.bitcast_convert_type(x, jnp.uint16), axis, tiled=True)
    return jax.lax.bitcast_convert_type(bits, x.dtype)


def unitwise_optimizer(optimizer, layout, world: int, state_specs, spec_sh, smap):
    """The placed optimizer run unit by unit (train.unitwise.UnitwiseOptimizer), each unit's call a
    jitted `smap` (shard_map over AXIS) donating its state, its global sums psums."""
    from jaxodc.train.unitwise import UnitwiseOptimizer
    leaf_specs = jax.tree_util.tree_leaves(state_specs, is_leaf=lambda x: isinstance(x, P))

    def compile_unit(step, mine, shared, first):
        others = [None if i in mine else sp for i, sp in enumerate(leaf_specs)]
        in_specs = ([leaf_specs[i] for i in mine], others, spec_sh, spec_sh, P())
        out_specs = (P(AXIS), [leaf_specs[i] for i in mine], [leaf_specs[i] for i in shared] if first else [])
        return jax.jit(smap(step, in_specs, out_specs), donate_argnums=(0,), compiler_options=memory_schedule())

    # traced as inside shard_map: on one rank's shapes
    local_shards = {n: jax.ShapeDtypeStruct((layout[n].shard,), jnp.float32) for n in layout.names}
    return UnitwiseOptimizer(optimizer, local_shards, optimizer.local_state_shapes()[0],
                             lambda v: (lambda x: jax.lax.psum(x, AXIS)), axis_env=[(AXIS, world)],
                             compile=compile_unit, cuts=update_cuts(layout))


def update_cuts(layout) -> dict[str, tuple[tuple[int, int], ...]]:
    """The slices a per_leaf unit's updates are returned in (UnitwiseOptimizer's `cuts`): one per
    parameter, so that each is written where it is made; a tail of padding, if any, its own."""
    out = {}
    for n in layout.names:
        spec = layout[n]
        if not spec.per_leaf or len(spec.shapes) < 2:
            continue
        cuts = [(o, s) for o, s in spec.leaf_shards() if s]
        end = sum(s for _, s in cuts)
        out[n] = tuple(cuts) + (((end, spec.shard - end),) if spec.shard > end else ())
    return out


def collective_gather(axis: str = AXIS, exchanges: dict[str, UnitExchange] | None = None,
                      compute_dtype=jnp.float32, reduce_dtype=None) -> GatherFn:
    """all_gather forward, psum_scatter backward: the gradient of the local shard is the sum over ranks.

    The unit travels and is returned in `compute_dtype` (bf16 under mixed precision: half the
    bytes both ways); the cotangent is reduce-scattered in `reduce_dtype` (default: as it comes,
    `compute_dtype`; fp32 rounds no partial sum) and the shard's gradient comes back in fp32.

    A unit of the per_leaf sharding (train.units; the trainer's default) travels one parameter at
    a time: forward, each leaf's slice of the shard is all-gathered into a buffer of its own and
    the unit is returned cut into its leaves; backward, each leaf's cotangent is psum_scattered on
    its own and the slices are concatenated into the shard's gradient. Neither the flat unit nor
    its flat gradient is ever built: the copies are shard-sized (P/W), where a contiguous unit
    costs a gathered flat unit, copies of the leaves cut out of it and a concatenated flat
    cotangent. A contiguous unit travels flat.

    Units named in `exchanges` travel compressed in the backward pass (compress.collective). Their
    `shard` argument is the triple (shard, residual, carrier): the cotangent returned for the
    residual is this rank's next residual (it replaces the old one, never adds to it) and the one for
    the carrier float32 [3, 2] holds the owner's peeled and estimated counts and this rank's kept
    count (`_carrier_to_counts`). A per_leaf unit's cotangent is laid out flat for the compressed
    exchange (one unit-sized copy, as before).
    """

    def gather_flat(shard):
        return _all_gather_bits(shard.astype(compute_dtype), axis)

    def gather_leaves(spec):
        def run(shard):
            # the scope names the unit in the all-gathers' HLO metadata: `bench models` counts a
            # unit's run of per-leaf all-gathers as one gathered unit by it (GATHER_SCOPE)
            with jax.named_scope(f"{GATHER_SCOPE}{spec.index}"):
                x, out = shard.astype(compute_dtype), []
                for (_, n), (off, s) in zip(spec.leaf_pieces(), spec.leaf_shards()):
                    if n == 0:  # an empty parameter: nothing travels
                        out.append(jnp.zeros((0,), compute_dtype))
                        continue
                    g = _all_gather_bits(x[off:off + s], axis)
                    out.append(g if g.shape[0] == n else g[:n])
                return tuple(out)
        return run

    def scatter_leaves(spec, cts):
        parts = []
        for ct, (_, n), (_, s) in zip(cts, spec.leaf_pieces(), spec.leaf_shards()):
            if n == 0:
                continue
            ct = ct if ct.shape[0] == spec.world * s else jnp.pad(ct, (0, spec.world * s - n))
            parts.append(jax.lax.psum_scatter(ct.astype(reduce_dtype or ct.dtype), axis, scatter_dimension=0,
                                              tiled=True).astype(jnp.float32))
        tail = spec.shard - sum(s for _, s in spec.leaf_shards())
        if tail:
            parts.append(jnp.zeros((tail,), jnp.float32))
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0] if parts else jnp.zeros((0,), jnp.float32)

    def dense(spec):
        forward = gather_leaves(spec) if spec.per_leaf else gather_flat

        @jax.custom_vjp
        def gather(shard):
            return forward(shard)

        def fwd(shard):
            return gather(shard), None

        def bwd(_, ct):
            if spec.per_leaf:
                return (scatter_leaves(spec, ct),)
            return (jax.lax.psum_scatter(ct.astype(reduce_dtype or ct.dtype), axis, scatter_dimension=0,
                                         tiled=True).astype(jnp.float32),)

        gather.defvjp(fwd, bwd)
        return gather

    def compressed(spec, ex: UnitExchange):
        forward = gather_leaves(spec) if spec.per_leaf else gather_flat

        @jax.custom_vjp
        def cgather(shard, residual, carrier):
            return forward(shard)

        def cfwd(shard, residual, carrier):
            return cgather(shard, residual, carrier), residual

        def cbwd(residual, ct):
            flat = flat_from_pieces(spec, [c.astype(jnp.float32) for c in ct]) if spec.per_leaf else ct.astype(jnp.float32)
            grad, residual, counts = compressed_reduce_scatter(flat, residual, ex, axis)
            return grad, residual, _counts_to_carrier(counts)

        cgather.defvjp(cfwd, cbwd)
        return cgather

    per_unit: dict = {}

    def gather(shard, spec, ctx):
        if spec.name not in per_unit:  # built per unit at trace time (the spec is static)
            ex = (exchanges or {}).get(spec.name)
            per_unit[spec.name] = compressed(spec, ex) if ex is not None else dense(spec)
        fn = per_unit[spec.name]
        return fn(*shard) if spec.name in (exchanges or {}) else fn(shard)

    return gather


class CollectiveTrainer(ShardedTrainer):
    """comm="collective": one jitted shard_map step per microbatch over a 1-D mesh of all
    processes' devices (one device per process), all_gather / psum_scatter per unit; every rank
    must run the same number of microbatches per minibatch (checked, clear error).

    `compress`: a CompressionPlan (`Compression(...).plan(trainer.layout)`, or of `make_layout(params,
    world, order=model.unit_names)`) to exchange its pieces TAGC-compressed (compress.collective),
    every rank the same (checked). Each rank then keeps an error-feedback residual per compressed
    unit; checkpoints keep it (train.checkpoint), so a restored run continues bit-exactly.
    StepResult.wire_bytes and, with compression, wire_bytes_selected / peeled / estimated report
    each minibatch's exchange; `gradient_wire` holds the per-unit, per-microbatch bytes they are
    counted from.

    `transport`: "gloo" (jax's collectives) or "jaxodc": every per-unit all-gather / reduce-scatter,
    the loss and optimizer all-sums and `allgather_bytes` (the per-minibatch agreement checks) run
    over a `jaxodc.comm.lockstep.LockstepGroup` (shm on one host, tcp across hosts; `lockstep`:
    its keyword arguments, e.g. link="tcp", timeout_s). jax.distributed is still needed (the mesh,
    and setting the group up). Compression runs on jax's collectives only.

    `straggle`: straggler injection (train.straggle.Straggle), None for none; settable later as
    `trainer.straggle`. A slowed rank holds every rank up at the next collective.

    `sharding`: how a unit is cut into the ranks' shards (train.units) when the trainer builds the
    layout (a `Program` brings its own): "per_leaf" (default; FSDP2's per-parameter sharding: each
    parameter is gathered into a buffer of its own and its gradient reduce-scattered on its own,
    see `collective_gather`) or "contiguous" (ODC's layout; the unit travels flat). Checkpoints
    record it: one of the other kind does not load."""

    comm = "collective"

    def __init__(self, model, optimizer: optax.GradientTransformation, params: dict, *, check: bool = True,
                 compress: CompressionPlan | None = None, transport: str = "gloo", lockstep: dict | None = None,
                 example_batch=None, precision: str | MixedPrecision = "fp32", straggle: Straggle | None = None,
                 sharding: str = "per_leaf", **unit_policy):
        if transport not in TRANSPORTS:
            raise ValueError(f"CollectiveTrainer: transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "jaxodc" and compress is not None:
            raise ValueError("CollectiveTrainer: TAGC compression (compress=) runs on jax's collectives only; "
                             "use transport='gloo' with it, or drop compress for transport='jaxodc'")
        if jax.local_device_count() != 1:
            raise ValueError(f"CollectiveTrainer wants one device per process, this process has {jax.local_device_count()}")
        self.model, self.optimizer = model, optimizer
        self.precision = policy = precision_of(precision)
        compute_dtype = policy.compute_dtype
        self.world, self.rank = jax.device_count(), jax.process_index()
        self.straggle = straggle
        if straggle is not None:
            straggle.check_world(self.world)
        devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.mesh = Mesh(np.array(devs), (AXIS,))
        # model: a unit-staged model, a loss_fn(params, batch) (with example_batch) or a Program
        self.program = program_of(model, params, self.world, example_batch=example_batch, sharding=sharding,
                                  **unit_policy)
        self.layout = self.program.layout
        self._sh = NamedSharding(self.mesh, P(AXIS))
        self.consts = tuple(self._replicated(c) for c in self.program.consts)
        names = self.layout.names
        spec_sh = {n: P(AXIS) for n in names}
        smap = lambda f, i, o: jax.shard_map(f, mesh=self.mesh, in_specs=i, out_specs=o, check_vma=False)

        self._gather_ints = jax.jit(smap(lambda x: jax.lax.all_gather(x, AXIS, tiled=True), (P(AXIS),), P()))
        self.transport, self.group = transport, None
        if check:
            self.check_same({"layout fingerprint": self.layout.fingerprint()}, "parameter layout")
            self.check_same({"transport": transport}, "collective transport")
            self.check_same({**setting_of(compress), "precision": str(policy)}, "compression and precision setting")
        self.compress = compress
        self.exchanges = exchanges = self._exchanges(compress)  # unit name -> its static compressed exchange
        self.gradient_wire = {n: exchanges[n].wire if n in exchanges else
                              WireBytes(0, dense_wire_bytes(self.layout[n]), 0) for n in names}
        # Without compression, the bytes the default setting would compress (records' wire_bytes_selected).
        track = tracking_plan(self.layout) if compress is None else None
        self._tracked_wire = sum(unit_exchange(self.layout[n], track).wire.selected_dense
                                 for n in names if track is not None and track.selected(n))

        local = self.program.shard(params, self.rank)
        self.shards = {n: self._global(local[n]) for n in names}
        # the user's chain, meaning on this rank's shards what it means on the whole tree; inside
        # shard_map the rank is traced, one program for every rank (contiguous shards cut a
        # parameter into pieces whose lengths differ from rank to rank: each is padded to the
        # longest, so the state can exceed 1/W of the whole then; per_leaf pieces need no padding)
        self.optimizer = optimizer = place(optimizer, self.program.param_tree(), self.layout, None,
                                           rank_fn=lambda: jax.lax.axis_index(AXIS), serial_gathers=True)
        state_shapes = optimizer.local_state_shapes()[0]
        state_specs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state_shapes),
                                                   [P(AXIS) if s else P() for s in optimizer.state_sharded])

        def init(shards):
            with global_reduction(lambda x: jax.lax.psum(x, AXIS)):
                return optimizer.init(shards)
        self.opt_state = jax.jit(smap(init, (spec_sh,), state_specs))(self.shards)

        self.residuals = self._zero_residuals()
        if transport == "jaxodc":
            # the units' channels carry the compute dtype (bf16 under mixed precision), as gloo's do
            gather, new_sum = self._lockstep(lockstep or {}, jnp.dtype(compute_dtype).name)
        else:
            gather = collective_gather(AXIS, exchanges, compute_dtype, policy.grad_dtype)
            new_sum = lambda _: (lambda x: jax.lax.psum(x, AXIS))  # noqa: E731
        grad_fn = self.program.grad(gather, compute_dtype, cast=policy.cast_inputs)
        no_counts = jnp.zeros((3, 2), jnp.float32)

        state = self.program.state

        def mb_step(shards, residuals, acc, counts, consts, batch, ntok, state_acc):
            """counts: int32 [3] (peeled, estimated, kept) of my slices so far this minibatch;
            state_acc: my weighted mutable state so far (train.state; [1] without)."""
            params = {n: (s, residuals[n], no_counts) if n in residuals else s for n, s in shards.items()}
            loss, g = grad_fn(params, consts, batch, ntok, None)
            if state is not None:
                loss, w = loss
                state_acc = state_acc + w
            grads = {n: g[n][0] if n in residuals else g[n] for n in shards}
            for n in residuals:
                counts = counts + _carrier_to_counts(g[n][2])
            return (jax.tree_util.tree_map(jnp.add, acc, grads), {n: g[n][1] for n in residuals}, counts,
                    new_sum("loss")(loss), state_acc)

        def opt_step(shards, state, acc):
            return optimizer_step(optimizer, shards, state, acc, new_sum("optimizer"))

        # One unit's updates alive at a time where the transformation allows it exactly
        # (train.unitwise, as ODC's owners do): one shard_map call per unit, each reading every
        # gradient (global norms stay exact: one scalar psum per unit) and donating the unit's state;
        # the whole-tree step otherwise, and over the lock-step transport (its sum channel is not
        # meant for a chain of separate executables).
        self.unitwise = None
        if transport == "gloo":
            self.unitwise = self._unitwise(optimizer, state_specs, spec_sh, smap)

        res_sh = {n: P(AXIS) for n in self.residuals}
        const_sh = tuple(P() for _ in self.consts)
        self._mb_step = jax.jit(smap(mb_step, (spec_sh, res_sh, spec_sh, P(AXIS), const_sh, P(AXIS), P(), P(AXIS)),
                                     (spec_sh, res_sh, P(AXIS), P(), P(AXIS))), donate_argnums=(1, 2, 3, 7))
        # The minibatch's state: every rank's weighted sums added once per minibatch (jax's psum on
        # either transport: a small vector, off the per-unit channels).
        self._state_size = 1 if state is None else state.size
        self._state_sum = jax.jit(smap(lambda x: jax.lax.psum(x, AXIS), (P(AXIS),), P()))
        self._opt_step = jax.jit(smap(opt_step, (spec_sh, state_specs, spec_sh), (spec_sh, state_specs)),
                                 donate_argnums=(0, 1, 2), compiler_options=memory_schedule())
        self.version = 0

    def _unitwise(self, optimizer, state_specs, spec_sh, smap):
        uw = unitwise_optimizer(optimizer, self.layout, self.world, state_specs, spec_sh, smap)
        # optax.apply_updates of one unit, in place; a unit's updates cut per parameter
        # (update_cuts) are joined on each rank's slices, inside shard_map
        self._add = jax.jit(smap(lambda s, u: s + (jnp.concatenate(u) if isinstance(u, tuple) else u),
                                 (P(AXIS), P(AXIS)), P(AXIS)), donate_argnums=(0,))
        return uw if uw.separable else None

    def _optimize(self, shards: dict, opt_state, acc: dict):
        """(new shards, new state): per unit (self.unitwise) or the whole-tree step; all donated."""
        if self.unitwise is None:
            return self._opt_step(shards, opt_state, acc)
        shards = dict(shards)

        def apply(name, upd):
            shards[name] = self._add(shards[name], upd)
        opt_state = self.unitwise.step(shards, opt_state, acc, jnp.int32(0), apply)
        return shards, opt_state

    def _lockstep(self, kwargs: dict, dtype: str = "float32"):
        """Builds the lockstep group (two gather channels and a scatter channel per unit, or per leaf of a
        per_leaf unit, in `dtype`, the loss
        and optimizer all-sums, allgather_bytes' channel, in float32); returns (the gather, sum name -> a fresh
        all-sum)."""
        from jaxodc.comm.lockstep import Channel, LockstepGroup
        channels, units = [], {}
        for n in self.layout.names:
            spec = self.layout[n]
            # a per_leaf unit travels one leaf at a time (lockstep_gather): three channels per leaf
            cuts = ([(f"{n}/{p}", s) for p, (_, s) in zip(spec.paths, spec.leaf_shards())] if spec.per_leaf
                    else [(n, spec.shard)])
            units[n] = []
            for name, s in cuts:
                s = max(s, 1)  # an empty parameter's channels are never called
                units[n].append((len(channels), len(channels) + 1, len(channels) + 2))
                channels += [Channel("gather", s, f"{name} all_gather", dtype),
                             Channel("gather", s, f"{name} all_gather (backward)", dtype),
                             Channel("scatter", s, f"{name} reduce_scatter", dtype)]
        sums = {"loss": len(channels), "optimizer": len(channels) + 1}
        channels += [Channel("reduce", 2, "loss all-sum"), Channel("reduce", 2, "optimizer all-sums")]  # lockstep_sum
        self._host_channel = len(channels)
        channels.append(Channel("gather", _HOST_WORDS, "allgather_bytes"))
        self.group = LockstepGroup(channels, rank=self.rank, world=self.world, allgather=self.allgather_bytes, **kwargs)
        return lockstep_gather(self.group, units), lambda name: lockstep_sum(self.group, sums[name])

    def close(self, barrier: bool = True) -> None:
        """Closes the lockstep group (transport="jaxodc")."""
        if self.group is not None:
            self.group.close()
            self.group = None

    def _exchanges(self, plan: CompressionPlan | None) -> dict[str, UnitExchange]:
        if plan is None:
            return {}
        unknown = sorted(set(plan.pieces) - set(self.layout.names))
        if unknown:
            raise ValueError(f"rank {self.rank}: the compression plan names units {unknown} that the model's "
                             f"layout lacks (units: {list(self.layout.names)}); plan it on this layout")
        return {n: unit_exchange(self.layout[n], plan) for n in self.layout.names if plan.selected(n)}

    def _zero_residuals(self) -> dict[str, jax.Array]:
        return {n: self._global(np.zeros(ex.residual_size, np.float32)) for n, ex in self.exchanges.items()}

    def _global(self, local: np.ndarray) -> jax.Array:
        local = np.asarray(local)
        return jax.make_array_from_process_local_data(self._sh, local, (self.world * local.shape[0],) + local.shape[1:])

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes (two collectives: the lengths, then the data padded to a power of two,
        so few shapes are ever compiled; with the lockstep group, one call of its host channel when
        every rank's bytes fit)."""
        if self.group is not None:
            words = np.zeros(_HOST_WORDS, np.float32)
            fits = len(data) <= 4 * (_HOST_WORDS - 1)
            words[0] = len(data) if fits else -1  # a float holds any length that fits exactly
            if fits:
                words[1:].view(np.uint8)[:len(data)] = np.frombuffer(data, np.uint8)
            got = self.group.run(self._host_channel, words).reshape(self.world, _HOST_WORDS)
            if (got[:, 0] >= 0).all():  # bit patterns travel untouched (copies, no arithmetic)
                return [got[r, 1:].view(np.uint8)[:int(got[r, 0])].tobytes() for r in range(self.world)]
        n = self._allgather_i32(np.array([len(data)], np.int32)).reshape(self.world)
        width = 1 << max(int(n.max()) - 1, 0).bit_length()
        buf = np.zeros(width, np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        got = self._allgather_i32(buf.astype(np.int32)).reshape(self.world, width)
        return [got[r, :n[r]].astype(np.uint8).tobytes() for r in range(self.world)]

    def _allgather_i32(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._gather_ints(self._global(x[None])).addressable_data(0))

    def train_minibatch(self, microbatches: Sequence[dict], global_tokens: float, check: bool = True,
                        sample_ids: Sequence[tuple[int, ...]] | None = None) -> StepResult:
        """One minibatch: this rank's microbatches (dicts of [1, T] arrays, same count and T on
        every rank -- pad with packing.empty), then the optimizer. `global_tokens`: loss tokens of
        the whole minibatch over all ranks. `sample_ids`: each microbatch's sample indices, where
        known (train_plan): what straggler injection keys on."""
        mbs = list(microbatches)
        if check:
            shapes = repr([sorted((k, np.shape(v)) for k, v in mb.items()) for mb in mbs])
            self.check_same({"microbatch count": len(mbs),
                             "microbatch shapes": hashlib.sha256(shapes.encode()).hexdigest()[:12],
                             "global token count": float(global_tokens)},
                            "minibatch (collective needs the same microbatch count and shapes on every rank, "
                            "pad with packing.empty; and the whole minibatch's token count)")
        if global_tokens <= 0:
            raise ValueError(f"rank {self.rank}: global_tokens must be positive, got {global_tokens}")
        res, cpu0 = StepResult(self.version, 0.0, time.perf_counter(), 0.0), time.process_time()
        res.straggle_s = None if self.straggle is None else []
        ntok = jnp.float32(global_tokens)
        acc = {n: self._global(np.zeros(self.layout[n].shard, np.float32)) for n in self.layout.names}
        counts = self._global(np.zeros(3, np.int32))
        state_acc = self._global(np.zeros(self._state_size, np.float32))
        loss = 0.0
        for m, mb in enumerate(mbs):
            t0, compiled0 = time.perf_counter(), compile_seconds()
            batch = jax.tree_util.tree_map(self._global, mb)
            acc, self.residuals, counts, l, state_acc = self._mb_step(self.shards, self.residuals, acc, counts,
                                                                      self.consts, batch, ntok, state_acc)
            loss += float(l)  # blocks: the interval covers this microbatch only
            stall(self.straggle, res, self.version, self.rank, microbatch_identity(self.rank, m, sample_ids), t0,
                  compiled0)
            res.microbatches.append((t0, time.perf_counter()))
        t0 = time.perf_counter()  # the end of the minibatch: the state's sum, the optimizer
        res.wire_bytes_units = {n: len(mbs) * w.total for n, w in self.gradient_wire.items()}
        res.wire_bytes = sum(res.wire_bytes_units.values())
        if self.compress is not None:
            res.wire_bytes_selected = len(mbs) * sum(w.compressed for w in self.gradient_wire.values())
            res.peeled, res.estimated, kept = (int(c) for c in np.asarray(counts.addressable_data(0)))
            selected = len(mbs) * sum(ex.residual_size for ex in self.exchanges.values())
            res.kept_fraction = kept / selected if selected else None
        else:
            res.wire_bytes_selected = len(mbs) * self._tracked_wire
        if self.program.state is not None:
            total = np.asarray(self._state_sum(state_acc).addressable_data(0))
            new = self.program.state.updated(self.consts, total)
            self.consts = tuple(c if c is old else self._replicated(c) for c, old in zip(new, self.consts))
        self.shards, self.opt_state = self._optimize(self.shards, self.opt_state, acc)
        jax.block_until_ready((self.shards, self.opt_state))
        res.opt = (t0, time.perf_counter())
        res.end_s = res.opt[1] - t0
        res.loss, res.t_end, res.cpu = loss, res.opt[1], time.process_time() - cpu0
        self.version += 1
        return res

    def warmup(self, row_lengths: Sequence[int], fields: Sequence[str] = ()) -> None:
        """Compile the microbatch step for each row length (e.g. every bucket) by running it on an
        all-padding microbatch whose gradient is discarded, and the optimizer step on copies;
        parameters and optimizer state are untouched. Every rank must call it with the same
        lengths (it runs collectives). `fields`: the per-token fields training batches carry."""
        for T in row_lengths:
            self.discard_microbatch(pack([], int(T), fields=fields).as_dict())
        # the optimizer step too, on copies (it donates its inputs)
        jax.block_until_ready(self._optimize(self._copy(self.shards), self._copy(self.opt_state), self._zeros()))

    def discard_microbatch(self, microbatch: dict) -> None:
        """One microbatch step whose gradient is dropped (residuals on copies: even a padding
        microbatch sends part of them); shards and state are untouched. It compiles or times the
        step. Every rank must call it with the same shapes (it runs collectives)."""
        jax.block_until_ready(self._mb_step(self.shards, self._copy(self.residuals), self._zeros(),
                                            self._global(np.zeros(3, np.int32)), self.consts,
                                            jax.tree_util.tree_map(self._global, microbatch), jnp.float32(1.0),
                                            self._global(np.zeros(self._state_size, np.float32))))

    def _replicated(self, x) -> jax.Array:
        """A value every rank holds the same of, as a replicated global array (PRNG keys too)."""
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(x)
            return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl))(self._replicated(jax.random.key_data(x)))
        return jax.make_array_from_process_local_data(NamedSharding(self.mesh, P()), np.asarray(x))

    _const = _replicated

    def _zeros(self) -> dict:
        return {n: self._global(np.zeros(self.layout[n].shard, np.float32)) for n in self.layout.names}

    @functools.cached_property
    def _copy(self):
        return jax.jit(lambda t: jax.tree_util.tree_map(jnp.copy, t))

    def train_plan(self, plan: Plan, samples: Sequence[np.ndarray], min_bucket: int | Sequence[int] | None = None) -> StepResult:
        """One minibatch from a static plan (LB-Micro, LocalSort, ...), padded to equal counts.
        `min_bucket`: bucketed row lengths (packing.bucket), the same on all ranks per step."""
        if plan.world != self.world:
            raise ValueError(f"plan for world {plan.world}, trainer world {self.world}")
        mbs = microbatches_for(plan, self.rank, samples, pad_to=max(plan.counts()), min_bucket=min_bucket,
                               lockstep=True)
        mine = list(plan.ranks[self.rank])
        mbs = [with_key(mb, self.rng_seed, self.version, mine[m] if m < len(mine) else ()) for m, mb in enumerate(mbs)]
        res = self.train_minibatch(mbs, plan_divisor(plan, samples, self.normalize), sample_ids=plan.ranks[self.rank])
        res.ran = list(plan.ranks[self.rank])
        return res

    def local_shards(self) -> dict[str, np.ndarray]:
        return {n: np.asarray(a.addressable_data(0)) for n, a in self.shards.items()}

    def local_opt_state(self):
        leaves, treedef = jax.tree_util.tree_flatten(self.opt_state)
        return jax.tree_util.tree_unflatten(
            treedef, self.optimizer.held([np.asarray(a.addressable_data(0)) for a in leaves], self.rank))

    def load_local_state(self, shards: dict, opt_state, version: int) -> None:
        """Replace this rank's shards and optimizer state (local numpy values, the structure of
        local_shards() / local_opt_state()) and the step counter; every rank calls it together
        (checkpoint.restore does)."""
        self.shards = {n: self._global(np.asarray(shards[n], np.float32)) for n in self.layout.names}
        cur, treedef = jax.tree_util.tree_flatten(self.opt_state)
        local = self.optimizer.padded(jax.tree_util.tree_leaves(opt_state), self.rank)
        self.opt_state = jax.tree_util.tree_unflatten(treedef, [
            jax.make_array_from_process_local_data(c.sharding, np.asarray(x, c.dtype), c.shape)
            for c, x in zip(cur, local)])
        self.version = int(version)
        self.residuals = self._zero_residuals()

    def local_residuals(self) -> dict[str, np.ndarray]:
        """Per compressed unit, this rank's residual (ex.residual_size elements)."""
        return {n: np.array(a.addressable_data(0), np.float32) for n, a in self.residuals.items()}

    def load_residuals(self, residuals) -> None:
        if residuals is None:
            self.residuals = self._zero_residuals()
            return
        self.residuals = {n: self._global(np.asarray(residuals[n], np.float32)) for n in self.exchanges}
