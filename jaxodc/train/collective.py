"""comm="collective": the FSDP baseline with per-unit `all_gather` / `psum_scatter` (gloo on CPU,
NCCL on GPU) in lock-step over a 1-D mesh of all processes' devices."""
from __future__ import annotations

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
from jaxodc.train.core import (GatherFn, ShardedTrainer, StepResult, microbatch_grad, microbatches_for,
                               optimizer_step, plan_global_tokens)
from jaxodc.train.units import make_layout, shard_params

AXIS = "d"


def collective_gather(axis: str = AXIS) -> GatherFn:
    """all_gather forward, psum_scatter backward: the gradient of the local shard is the sum over ranks."""

    @jax.custom_vjp
    def gather(shard):
        return jax.lax.all_gather(shard, axis, tiled=True)

    def fwd(shard):
        return gather(shard), None

    def bwd(_, ct):
        return (jax.lax.psum_scatter(ct, axis, scatter_dimension=0, tiled=True),)

    gather.defvjp(fwd, bwd)
    return lambda shard, spec, ctx: gather(shard)


class CollectiveTrainer(ShardedTrainer):
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
            self.check_same({"layout fingerprint": self.layout.fingerprint()}, "parameter layout")

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

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes (two collectives: the lengths, then the data padded to a power of two,
        so few shapes are ever compiled)."""
        n = self._allgather_i32(np.array([len(data)], np.int32)).reshape(self.world)
        width = 1 << max(int(n.max()) - 1, 0).bit_length()
        buf = np.zeros(width, np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        got = self._allgather_i32(buf.astype(np.int32)).reshape(self.world, width)
        return [got[r, :n[r]].astype(np.uint8).tobytes() for r in range(self.world)]

    def _allgather_i32(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._gather_ints(self._global(x[None])).addressable_data(0))

    def train_minibatch(self, microbatches: Sequence[dict], global_tokens: float, check: bool = True) -> StepResult:
        """One minibatch: this rank's microbatches (dicts of [1, T] arrays, same count and T on
        every rank -- pad with packing.empty), then the optimizer. `global_tokens`: loss tokens of
        the whole minibatch over all ranks."""
        mbs = list(microbatches)
        if check:
            shapes = repr([sorted((k, np.shape(v)) for k, v in mb.items()) for mb in mbs])
            self.check_same({"microbatch count": len(mbs),
                             "microbatch shapes": hashlib.sha256(shapes.encode()).hexdigest()[:12]},
                            "minibatch (collective needs the same microbatch count and shapes on every rank; "
                            "pad with packing.empty)")
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
