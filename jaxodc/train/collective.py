"""Sharded-parameter trainer core, the collective baseline (comm="collective") and the ODC hook.

Parameters live only as fp32 shards per unit (see units.py). One microbatch runs the model unit by
unit; each unit's stage is `remat_stage(gather -> unflatten -> apply)` (jax.checkpoint-like, with
ordering barriers), so a unit is gathered right before its stage, dropped after it, and gathered
again in the backward pass (FSDP semantics: only a couple of gathered units are alive at once). `gather` is the only thing the
communication mode changes:

- collective: a custom_vjp whose forward is `all_gather(tiled)` over the mesh axis and whose
  backward is `psum_scatter(scatter_dimension=0, tiled)` -- the gradient w.r.t. the local shard
  that jax.grad returns is the reduce-scattered sum over ranks;
- odc: `jaxodc.ops.odc_gather(shard, version, unit=..., numel=..., dtype=...)`, whose backward
  pushes the cotangent to the owners (scatter-accumulate) and returns zeros for the shard; the
  owner fetches the summed gradient from the runtime after the minibatch (`OdcTrainer`).

Loss of a microbatch = sum of per-token losses / global token count of the minibatch, so summing
the microbatch gradients of all ranks gives the exact minibatch gradient however it was split.

Exact global quantities. The optimizer runs on local shards, so anything that reduces over the
whole parameter tree must reduce over ranks too. Inside a trainer's optimizer step,
`global_sum(x)` sums a scalar over all ranks (collective: lax.psum; ODC: the runtime's
allgather_scalar; reference/single process: identity). Use `clip_by_global_norm` / `global_norm`
from this module instead of optax's (optax.clip_by_global_norm would clip by the local norm);
elementwise transformations (adam, sgd, weight decay, schedules) need nothing.
"""
from __future__ import annotations

import abc
import contextlib
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxodc.train.balance import Plan, iter_steal
from jaxodc.train.packing import bucket, loss_tokens, pack
from jaxodc.train.units import Layout, UnitSpec, make_layout, shard_params, unflatten_unit

AXIS = "d"

# --------------------------------------------------------------------------- exact global quantities

_LOCAL = threading.local()  # per thread: ranks run as threads in tests, each traces its own step


def _reducers() -> list:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


@contextlib.contextmanager
def global_reduction(fn: Callable[[jax.Array], jax.Array]):
    """While tracing inside this context, `global_sum` uses `fn` (a traceable scalar all-sum)."""
    _reducers().append(fn)
    try:
        yield
    finally:
        _reducers().pop()


def global_sum(x: jax.Array) -> jax.Array:
    """Sum of scalar x over all ranks (identity outside a trainer's optimizer step)."""
    st = _reducers()
    return st[-1](x) if st else x


def global_norm(tree) -> jax.Array:
    """L2 norm of a tree of local shards over all ranks (padding elements are zero)."""
    sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree))
    return jnp.sqrt(global_sum(sq))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm with the norm taken over all ranks' shards (same arithmetic)."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        g = global_norm(updates)
        trigger = jnp.squeeze(g < max_norm)
        return jax.tree_util.tree_map(
            lambda t: jax.lax.select(trigger, t, (t / g.astype(t.dtype)) * max_norm), updates), state

    return optax.GradientTransformation(init, update)


# --------------------------------------------------------------------------- shared trainer core

# gather(local_shard [Kp/W] fp32, spec, ctx) -> full unit [Kp], or the unit cut into its flat leaves
# (spec.leaf_pieces()); differentiable, its VJP delivers the cotangent to the owners. ctx: per-call
# traced data the comm needs (ODC: the version), or None.
GatherFn = Callable[[jax.Array, UnitSpec, Any], jax.Array]


def remat_stage(fn: Callable) -> Callable:
    """fn(shard, carry, batch, ctx) -> carry, with FSDP memory semantics.

    Like jax.checkpoint (only the stage inputs are kept for the backward pass; the gathered unit
    is recomputed there), plus ordering: a gather depends only on a parameter shard, so XLA is
    free to hoist every unit's gather to the start of the program (it does, on CPU), keeping all
    gathered units alive at once. Optimization barriers tie the forward gather to the previous
    stage's output and the backward re-gather to the incoming cotangent, so at most a couple of
    gathered units are alive at any time."""

    @jax.custom_vjp
    def stage(shard, carry, batch, ctx):
        shard, carry = jax.lax.optimization_barrier((shard, carry))
        return fn(shard, carry, batch, ctx)

    def fwd(shard, carry, batch, ctx):
        return stage(shard, carry, batch, ctx), (shard, carry, batch, ctx)

    def bwd(res, ct):
        shard, carry, batch, ctx = res
        shard, carry, ct = jax.lax.optimization_barrier((shard, carry, ct))
        _, vjp = jax.vjp(lambda s, c: fn(s, c, batch, ctx), shard, carry)
        d_shard, d_carry = vjp(ct)
        zeros = lambda t: jax.tree_util.tree_map(
            lambda x: jnp.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.inexact)
            else jnp.zeros_like(x), t)
        return d_shard, d_carry, zeros(batch), zeros(ctx)

    stage.defvjp(fwd, bwd)
    return stage


def sharded_loss(model, layout: Layout, gather: GatherFn, shards: dict, batch: dict, global_tokens,
                 ctx=None) -> jax.Array:
    """Loss of one microbatch from local shards: each unit gathered inside its own remat'd stage."""
    carry = None
    for spec in layout.units:
        def stage(shard, carry, batch, ctx, spec=spec):
            return model.apply_unit(spec.name, unflatten_unit(spec, gather(shard, spec, ctx)), carry, batch)

        carry = remat_stage(stage)(shards[spec.name], carry, batch, ctx)
    return jnp.sum(carry) / global_tokens


def microbatch_grad(model, layout: Layout, gather: GatherFn):
    """fn(shards, batch, global_tokens, ctx) -> (loss, grads w.r.t. local shards)."""
    return jax.value_and_grad(lambda s, b, n, c: sharded_loss(model, layout, gather, s, b, n, c))


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


def collective_gather(axis: str = AXIS) -> GatherFn:
    @jax.custom_vjp
    def gather(shard):
        return jax.lax.all_gather(shard, axis, tiled=True)

    def fwd(shard):
        return gather(shard), None

    def bwd(_, ct):
        return (jax.lax.psum_scatter(ct, axis, scatter_dimension=0, tiled=True),)

    gather.defvjp(fwd, bwd)
    return lambda shard, spec, ctx: gather(shard)


# --------------------------------------------------------------------------- results

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

    out = []
    for m, mb in enumerate(mine):
        if min_bucket is None:
            T = plan.max_tokens
        elif lockstep:
            T = max(size(r, m) for r in range(plan.world))
        else:
            T = size(rank, m)
        out.append(pack([samples[i] for i in mb], T).as_dict())
    return out


def plan_global_tokens(plan: Plan) -> int:
    """Loss tokens of the whole minibatch (what every microbatch loss is divided by)."""
    return loss_tokens(plan.lengths)


# --------------------------------------------------------------------------- collective baseline

class CollectiveTrainer:
    """comm="collective": one jitted shard_map step per microbatch over a 1-D mesh of all
    processes' devices (one device per process), all_gather / psum_scatter per unit; every rank
    must run the same number of microbatches per minibatch (checked, clear error)."""

    comm = "collective"

    def __init__(self, model, optimizer: optax.GradientTransformation, params: dict, *, check: bool = True):
        if jax.local_device_count() != 1:
            raise ValueError(f"CollectiveTrainer wants one device per process, this process has {jax.local_device_count()}")
        self.model, self.optimizer = model, optimizer
        self.world, self.rank = jax.device_count(), jax.process_index()
        devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.mesh = Mesh(np.array(devs), (AXIS,))
        self.layout = make_layout(params, self.world, order=model.unit_names)
        self._sh = NamedSharding(self.mesh, P(AXIS))
        names = self.layout.names
        spec_sh = {n: P(AXIS) for n in names}
        smap = lambda f, i, o: jax.shard_map(f, mesh=self.mesh, in_specs=i, out_specs=o, check_vma=False)

        self._gather_ints = jax.jit(smap(lambda x: jax.lax.all_gather(x, AXIS, tiled=True), (P(AXIS),), P()))
        if check:
            self._check_same(["layout fingerprint"], [int(self.layout.fingerprint()[:7], 16)])

        local = shard_params(self.layout, params, self.rank)
        self.shards = {n: self._global(local[n]) for n in names}
        shapes = {n: jax.ShapeDtypeStruct((self.layout[n].shard,), jnp.float32) for n in names}
        state_specs = jax.tree_util.tree_map(lambda s: P() if s.ndim == 0 else P(AXIS),
                                             jax.eval_shape(optimizer.init, shapes))
        self.opt_state = jax.jit(smap(optimizer.init, (spec_sh,), state_specs))(self.shards)

        grad_fn = microbatch_grad(model, self.layout, collective_gather(AXIS))

        def mb_step(shards, acc, batch, ntok):
            loss, g = grad_fn(shards, batch, ntok, None)
            return jax.tree_util.tree_map(jnp.add, acc, g), jax.lax.psum(loss, AXIS)

        def opt_step(shards, state, acc):
            return optimizer_step(optimizer, shards, state, acc, lambda x: jax.lax.psum(x, AXIS))

        self._mb_step = jax.jit(smap(mb_step, (spec_sh, spec_sh, P(AXIS), P()), (spec_sh, P())), donate_argnums=(1,))
        self._opt_step = jax.jit(smap(opt_step, (spec_sh, state_specs, spec_sh), (spec_sh, state_specs)),
                                 donate_argnums=(0, 1, 2))
        self.version = 0

    def _global(self, local: np.ndarray) -> jax.Array:
        local = np.asarray(local)
        return jax.make_array_from_process_local_data(self._sh, local, (self.world * local.shape[0],) + local.shape[1:])

    def allgather_ints(self, xs: Sequence[int]) -> np.ndarray:
        """Every rank's ints (int32) as an array [W, len(xs)] (one collective)."""
        out = self._gather_ints(self._global(np.array([list(xs)], np.int32)))
        return np.asarray(out.addressable_data(0))

    def _check_same(self, whats: Sequence[str], xs: Sequence[int]) -> None:
        got = self.allgather_ints(xs)
        for j, what in enumerate(whats):
            if np.any(got[:, j] != got[0, j]):
                raise ValueError(f"ranks disagree on {what}: "
                                 + ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(got[:, j])))

    def train_minibatch(self, microbatches: Sequence[dict], global_tokens: float, check: bool = True) -> StepResult:
        """One minibatch: this rank's microbatches (dicts of [1, T] arrays, same count and T on
        every rank -- pad with packing.empty), then the optimizer. `global_tokens`: loss tokens of
        the whole minibatch over all ranks."""
        mbs = list(microbatches)
        if check:
            shapes = repr([sorted((k, np.shape(v)) for k, v in mb.items()) for mb in mbs]).encode()
            self._check_same(["microbatch count (collective needs equal counts; pad with packing.empty)",
                              "microbatch shapes (collective steps need one shape per step on all ranks)"],
                             [len(mbs), zlib.crc32(shapes) & 0x7FFFFFFF])
        if global_tokens <= 0:
            raise ValueError(f"rank {self.rank}: global_tokens must be positive, got {global_tokens}")
        res, cpu0 = StepResult(self.version, 0.0, time.perf_counter(), 0.0), time.process_time()
        ntok = jnp.float32(global_tokens)
        acc = {n: self._global(np.zeros(self.layout[n].shard, np.float32)) for n in self.layout.names}
        loss = 0.0
        for mb in mbs:
            t0 = time.perf_counter()
            batch = {k: self._global(np.asarray(v)) for k, v in mb.items()}
            acc, l = self._mb_step(self.shards, acc, batch, ntok)
            loss += float(l)  # blocks: the interval covers this microbatch only
            res.microbatches.append((t0, time.perf_counter()))
        t0 = time.perf_counter()
        self.shards, self.opt_state = self._opt_step(self.shards, self.opt_state, acc)
        jax.block_until_ready(self.shards)
        res.opt = (t0, time.perf_counter())
        res.loss, res.t_end, res.cpu = loss, res.opt[1], time.process_time() - cpu0
        self.version += 1
        return res

    def warmup(self, row_lengths: Sequence[int]) -> None:
        """Compile the microbatch step for each row length (e.g. every bucket) by running it on an
        all-padding microbatch whose gradient is discarded, and the optimizer step on copies;
        parameters and optimizer state are untouched. Every rank must call it with the same
        lengths (it runs collectives)."""
        ntok = jnp.float32(1.0)
        zeros = lambda: {n: self._global(np.zeros(self.layout[n].shard, np.float32)) for n in self.layout.names}
        for T in row_lengths:
            batch = {k: self._global(v) for k, v in pack([], int(T)).as_dict().items()}
            jax.block_until_ready(self._mb_step(self.shards, zeros(), batch, ntok))
        # the optimizer step too, on copies (it donates its inputs)
        copy = jax.jit(lambda t: jax.tree_util.tree_map(jnp.copy, t))
        jax.block_until_ready(self._opt_step(copy(self.shards), copy(self.opt_state), zeros()))

    def train_plan(self, plan: Plan, samples: Sequence[np.ndarray], min_bucket: int | Sequence[int] | None = None) -> StepResult:
        """One minibatch from a static plan (LB-Micro, LocalSort, ...), padded to equal counts.
        `min_bucket`: bucketed row lengths (packing.bucket), the same on all ranks per step."""
        if plan.world != self.world:
            raise ValueError(f"plan for world {plan.world}, trainer world {self.world}")
        mbs = microbatches_for(plan, self.rank, samples, pad_to=max(plan.counts()), min_bucket=min_bucket,
                               lockstep=True)
        res = self.train_minibatch(mbs, plan_global_tokens(plan))
        res.ran = list(plan.ranks[self.rank])
        return res

    def local_shards(self) -> dict[str, np.ndarray]:
        return {n: np.asarray(a.addressable_data(0)) for n, a in self.shards.items()}

    def local_opt_state(self):
        return jax.tree_util.tree_map(lambda a: np.asarray(a.addressable_data(0)), self.opt_state)

    def load_local_state(self, shards: dict, opt_state, version: int) -> None:
        """Replace this rank's shards and optimizer state (local numpy values, the structure of
        local_shards() / local_opt_state()) and the step counter; every rank calls it together
        (checkpoint.restore does)."""
        self.shards = {n: self._global(np.asarray(shards[n], np.float32)) for n in self.layout.names}
        self.opt_state = jax.tree_util.tree_map(
            lambda cur, x: jax.make_array_from_process_local_data(cur.sharding, np.asarray(x, cur.dtype), cur.shape),
            self.opt_state, opt_state)
        self.version = int(version)

    def save(self, path: str) -> str:
        """Checkpoint (jaxodc.train.checkpoint); every rank calls it together."""
        from jaxodc.train.checkpoint import save
        return save(self, path)

    def restore(self, path: str) -> int:
        """Load a checkpoint saved by a trainer of the same world, layout and optimizer-state
        structure (jaxodc.train.checkpoint); returns the restored step."""
        from jaxodc.train.checkpoint import restore
        return restore(self, path)


# --------------------------------------------------------------------------- ODC hook

class OdcRuntime(abc.ABC):
    """What comm="odc" needs from the ODC runtime (jaxodc.odc / jaxodc.ops; not implemented here).

    Units are addressed by `UnitSpec.index`. Version v is the minibatch being computed; the shards
    published with version v are the parameters minibatch v reads."""

    rank: int
    world: int

    @abc.abstractmethod
    def gather(self, shard: jax.Array, spec: UnitSpec, version: jax.Array):
        """Traceable (inside jit): full unit [spec.padded] fp32 from every owner's shard of
        `version`, or the unit cut into its flat leaves (spec.leaf_pieces()); a custom_vjp whose
        backward scatter-accumulates the cotangent at the owners and returns zeros for `shard`.
        Expected: jaxodc.ops.odc_gather(shard, version, unit=spec.index, numel=spec.padded,
        dtype=jnp.float32), or odc_gather_pieces."""

    @abc.abstractmethod
    def publish(self, unit: int, shard: np.ndarray, version: int) -> None:
        """Make my shard of `unit` readable by gathers of `version` (v=0: initial parameters)."""

    @abc.abstractmethod
    def done(self, version: int) -> None:
        """All my pushes for minibatch `version` are issued (sent to every owner)."""

    @abc.abstractmethod
    def wait_complete(self, version: int) -> None:
        """Block until every rank's pushes of `version` are accumulated into my shards' gradients."""

    @abc.abstractmethod
    def fetch_grad(self, unit: int) -> np.ndarray:
        """Summed gradient of my shard of `unit` (fp32 [padded/world]); resets the accumulator."""

    @abc.abstractmethod
    def allgather_scalar(self, version: int, x: float) -> np.ndarray:
        """Every rank's x for this version, as float64 [world]; calls happen in the same order on
        every rank (the optimizer's global sums, then the loss)."""

    @abc.abstractmethod
    def claim(self, version: int, owner: int, count: int, steal: bool) -> int:
        """LB-Steal (balance.ClaimFn): one of `owner`'s `count` microbatches of minibatch
        `version`, the front for the owner, the back for a thief; -1 when none is left."""

    # Zero-copy owner path (optional; jaxodc.odc.Runtime has it): the optimizer reads the
    # gradient where it accumulated and rewrites the master shard in place.
    def master_view(self, unit: int) -> np.ndarray | None:
        """My master shard as a writable host array, or None when the runtime keeps no such copy."""
        return None

    def grad_view(self, unit: int) -> np.ndarray:
        """fetch_grad without the copy: valid until clear_grad(unit)."""
        return self.fetch_grad(unit)

    def clear_grad(self, unit: int) -> None:
        """Reset the gradient lent by grad_view (before publishing the next version)."""

    def publish_in_place(self, unit: int, version: int) -> None:
        """Announce `version` of the master shard written in place through master_view."""
        raise NotImplementedError


def _aliases(a: jax.Array, host: np.ndarray) -> bool:
    """Whether jax array `a` lives in `host`'s memory (a zero-copy view of it)."""
    try:
        return a.unsafe_buffer_pointer() == host.ctypes.data
    except Exception:  # noqa: BLE001 -- not a single-device buffer, or a platform without pointers
        return False


class OdcTrainer:
    """comm="odc" driver over an `OdcRuntime`: per minibatch v, run my microbatches (any count,
    including zero) -> done(v) -> wait_complete(v) -> fetch_grad per unit -> optimizer on local
    shards (global sums via allgather_scalar) -> publish(unit, new shard, v+1). Needs the
    runtime from jaxodc.odc to run across processes."""

    comm = "odc"

    def __init__(self, model, optimizer: optax.GradientTransformation, params: dict, runtime: OdcRuntime):
        self.model, self.optimizer, self.rt = model, optimizer, runtime
        self.world, self.rank = runtime.world, runtime.rank
        self.layout = make_layout(params, self.world, order=model.unit_names)
        shards = {n: jnp.asarray(s) for n, s in shard_params(self.layout, params, self.rank).items()}
        self.opt_state = optimizer.init(shards)
        grad_fn = microbatch_grad(model, self.layout, lambda s, spec, v: runtime.gather(s, spec, v))
        def mb_step(s, b, n, v):
            # The (zero) shard gradients carry the pushes' ordering tokens. One element of each is
            # returned so the backward pass stays live and ordered before the result, without
            # materialising shard-sized zeros every microbatch (the pushes themselves are
            # side-effecting custom calls, never dropped).
            loss, g = grad_fn(s, b, n, v)
            return loss, sum(x[0] for x in jax.tree_util.tree_leaves(g))

        self._mb_step = jax.jit(mb_step)

        def reduce_fn(version):
            # An ordered io_callback: the exchange has side effects and every rank must make the
            # same calls in the same order, so XLA may neither merge, drop nor reorder them.
            def f(x):
                cb = lambda v, y: np.float32(np.sum(runtime.allgather_scalar(int(v), float(y))))
                return io_callback(cb, jax.ShapeDtypeStruct((), jnp.float32), version, x, ordered=True)
            return f

        self._masters = self._master_views()
        if self._masters is None:
            # Shards and state donated: otherwise old and new coexist.
            self._opt_step = jax.jit(lambda s, st, g, v: optimizer_step(optimizer, s, st, g, reduce_fn(v)),
                                     donate_argnums=(0, 1))
        else:
            # The shards are the runtime's masters, memory XLA does not own and cannot write: the
            # step returns the updates, which _optimize adds into the masters in place, so the
            # optimizer phase holds no second copy of the shards.
            self._opt_step = jax.jit(lambda s, st, g, v: optimizer_updates(optimizer, s, st, g, reduce_fn(v)),
                                     donate_argnums=(1,))
        self.version = 0
        # Runtime versions count minibatches of this runtime; after restore the trainer's step
        # (self.version) runs ahead of them by this offset (see load_local_state).
        self._rt_base = 0
        self._publish(shards, 0)

    def _master_views(self) -> list[np.ndarray] | None:
        """The runtime's master shards, when jax can use them as its own arrays without a copy
        (host memory on the CPU backend); then the trainer keeps no second copy of its shards."""
        views = [self.rt.master_view(u.index) for u in self.layout.units]
        if any(v is None for v in views):
            return None
        probe = jax.device_put(views[0])
        return views if _aliases(probe, views[0]) else None

    def _publish(self, shards: dict, version: int) -> None:
        """Make `shards` readable by gathers of runtime `version` and the trainer's current
        shards. A shard already in the runtime's master (updated in place) is announced, not copied."""
        for u in self.layout.units:
            a = shards[u.name]
            if self._masters is not None and _aliases(a, self._masters[u.index]):
                self.rt.publish_in_place(u.index, version)
            else:
                self.rt.publish(u.index, np.asarray(a), version)
        if self._masters is not None:
            shards = {u.name: jax.device_put(self._masters[u.index]) for u in self.layout.units}
        self.shards = shards

    def _optimize(self, grads: dict, ver: jax.Array) -> dict:
        """The new shards. With the runtime's masters as shards they are the masters themselves,
        updated in place (every rank's pushes of this version have landed, so no gather reads
        them until the next version is announced)."""
        out, self.opt_state = self._opt_step(self.shards, self.opt_state, grads, ver)
        jax.block_until_ready((out, self.opt_state))
        if self._masters is None:
            return out
        for u in self.layout.units:  # optax.apply_updates, in place: shard + update, in fp32
            master = self._masters[u.index]
            np.add(master, np.asarray(out.pop(u.name)), out=master, casting="same_kind")
        return self.shards

    def train_minibatch(self, microbatches: Iterable[dict], global_tokens: float) -> StepResult:
        step, v = self.version, self.version - self._rt_base  # v: runtime version
        if global_tokens <= 0:
            raise ValueError(f"rank {self.rank}: global_tokens must be positive, got {global_tokens}")
        res, cpu0 = StepResult(step, 0.0, time.perf_counter(), 0.0), time.process_time()
        ntok, ver = jnp.float32(global_tokens), jnp.int32(v)
        loss = 0.0
        for mb in microbatches:
            t0 = time.perf_counter()
            l, _ = self._mb_step(self.shards, {k: jnp.asarray(x) for k, x in mb.items()}, ntok, ver)
            loss += float(l)
            res.microbatches.append((t0, time.perf_counter()))
        self.rt.done(v)
        self.rt.wait_complete(v)
        t0 = time.perf_counter()
        # The gradients are read where they accumulated (no copy on the CPU backend) ...
        grads = {u.name: jax.device_put(self.rt.grad_view(u.index)) for u in self.layout.units}
        shards = self._optimize(grads, ver)
        del grads
        # ... and cleared before the next version is announced: peers push into them right after.
        for u in self.layout.units:
            self.rt.clear_grad(u.index)
        self._publish(shards, v + 1)
        res.opt = (t0, time.perf_counter())
        res.loss = float(np.sum(self.rt.allgather_scalar(v, loss)))
        res.t_end, res.cpu = time.perf_counter(), time.process_time() - cpu0
        self.version = step + 1
        return res

    def train_plan(self, plan: Plan, samples: Sequence[np.ndarray], min_bucket: int | Sequence[int] | None = None) -> StepResult:
        """Static plans: my microbatches, no padding. lb_steal: my deque, then steals (iter_steal).
        `min_bucket`: each microbatch packed to its own bucket (packing.bucket)."""
        if plan.world != self.world:
            raise ValueError(f"plan for world {plan.world}, trainer world {self.world}")
        ran: list[tuple[int, ...]] = []
        if plan.balance == "lb_steal":
            claims = iter_steal(plan, self.rank, self.rt.claim, self.version - self._rt_base)
        else:
            claims = iter(plan.ranks[self.rank])

        def packed():
            for mb in claims:
                ran.append(mb)
                T = plan.max_tokens if min_bucket is None else bucket(plan.microbatch_tokens(mb), plan.max_tokens, min_bucket)
                yield pack([samples[i] for i in mb], T).as_dict()

        res = self.train_minibatch(packed(), plan_global_tokens(plan))
        res.ran = ran
        return res

    def local_shards(self) -> dict[str, np.ndarray]:
        # Copies: the shards may be the runtime's masters, which the next minibatch rewrites.
        return {n: np.array(a, np.float32) for n, a in self.shards.items()}

    def local_opt_state(self):
        return jax.tree_util.tree_map(np.asarray, self.opt_state)

    def allgather_ints(self, xs: Sequence[int]) -> np.ndarray:
        """Every rank's ints as an int64 array [W, len(xs)] (runtime scalar exchange; exact
        below 2**53). Every rank must make the same calls in the same order."""
        rv = self.version - self._rt_base
        return np.array([[int(y) for y in self.rt.allgather_scalar(rv, float(x))] for x in xs],
                        np.int64).T.reshape(self.world, len(xs))

    def load_local_state(self, shards: dict, opt_state, version: int) -> None:
        """Replace this rank's shards, optimizer state and step, and publish the shards so
        gathers of the restored step read them. Every rank calls it together, between
        minibatches: it closes the runtime's current minibatch with no pushes (done ->
        wait_complete) and publishes at the next runtime version, which becomes the runtime
        version of step `version` (runtime versions only move forward)."""
        rv = self.version - self._rt_base
        new_shards = {n: jnp.asarray(np.asarray(shards[n], np.float32)) for n in self.layout.names}
        self.opt_state = jax.tree_util.tree_map(lambda cur, x: jnp.asarray(np.asarray(x, cur.dtype)),
                                                self.opt_state, opt_state)
        self.rt.done(rv)
        self.rt.wait_complete(rv)
        for u in self.layout.units:
            g = np.asarray(self.rt.fetch_grad(u.index))
            if np.any(g != 0):
                raise RuntimeError(f"rank {self.rank}: unit {u.name!r} received gradients for minibatch {rv} "
                                   "while restoring; every rank must restore between minibatches, together")
        self._publish(new_shards, rv + 1)
        self.version = int(version)
        self._rt_base = self.version - (rv + 1)

    def save(self, path: str) -> str:
        """Checkpoint (jaxodc.train.checkpoint); every rank calls it together."""
        from jaxodc.train.checkpoint import save
        return save(self, path)

    def restore(self, path: str) -> int:
        """Load a checkpoint (jaxodc.train.checkpoint) and republish the shards at the restored
        step; returns it."""
        from jaxodc.train.checkpoint import restore
        return restore(self, path)


def train_loop(trainer, samples, minibatch_indices: Iterable[Sequence[int]], balance: str, max_tokens: int,
               cost=None, progress: bool = False, estimate_busy: bool = False,
               min_bucket: int | Sequence[int] | None = None) -> list:
    """Run `trainer` (collective or ODC) over global minibatches (each a sequence of indices into
    `samples`, the same on every rank), planning each with `balance`. Returns this rank's
    metrics.MinibatchRecord list. `estimate_busy` (collective): set each record's busy time to
    the cost model's prediction (cost in seconds, e.g. from calibrate(ReferenceTrainer.timing_fn))
    plus the optimizer time, because the measured microbatch intervals include collective waits.
    `min_bucket`: bucketed microbatch shapes (packing.bucket), so compute follows the content."""
    from jaxodc.train.balance import make_plan
    from jaxodc.train.cost import CostModel
    from jaxodc.train.metrics import MinibatchRecord, Progress
    cost = cost or CostModel()
    if trainer.comm == "collective" and balance == "lb_steal":
        raise ValueError("lb_steal claims microbatches at run time; it needs comm='odc'")
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


def make_trainer(model, optimizer: optax.GradientTransformation, params: dict, comm: str = "collective",
                 runtime: OdcRuntime | None = None):
    """The sharded trainer for `comm` ("collective" or "odc"; odc needs the runtime)."""
    if comm == "collective":
        return CollectiveTrainer(model, optimizer, params)
    if comm == "odc":
        if runtime is None:
            raise ValueError('comm="odc" needs an OdcRuntime (jaxodc.odc)')
        return OdcTrainer(model, optimizer, params, runtime)
    raise ValueError(f"unknown comm {comm!r}; choose 'collective' or 'odc'")
