"""comm="odc": the sharded trainer over the ODC runtime. Gathers read the owners' shards one-sided;
the backward pass pushes each unit's gradient to its owners (scatter-accumulate); each rank runs its
own number of microbatches and no global barrier separates minibatches."""
from __future__ import annotations

import time
from typing import Iterable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxodc.balance.packing import bucket, fields_of, pack
from jaxodc.balance.plan import Plan, iter_steal
from jaxodc.compress.policy import CompressionPlan, setting_of, tracking_plan
from jaxodc.ops import odc_gather, odc_gather_pieces
from jaxodc.train.core import ShardedTrainer, StepResult, plan_divisor, with_key
from jaxodc.modeling.staging import GatherFn
from jaxodc.modeling.precision import MixedPrecision, precision_of
from jaxodc.modeling.program import program_of
from jaxodc.train.straggle import Straggle, compile_seconds, microbatch_identity, stall
from jaxodc.optim.placement import place
from jaxodc.train.unitwise import EndStep


class OdcRuntime(Protocol):
    """What comm="odc" needs from the ODC runtime; `jaxodc.odc.Runtime` satisfies it.

    Units are addressed by `UnitSpec.index`. Version v is the minibatch being computed; the shards
    published with version v are the parameters minibatch v reads."""

    rank: int
    world: int

    def publish(self, unit: int, shard: np.ndarray, version: int) -> None:
        """Make my shard of `unit` readable by gathers of `version` (v=0: initial parameters)."""

    def done(self, version: int) -> None:
        """All my pushes for minibatch `version` are issued (sent to every owner)."""

    def wait_complete(self, version: int) -> None:
        """Block until every rank's pushes of `version` are accumulated into my shards' gradients."""

    def fetch_grad(self, unit: int) -> np.ndarray:
        """Summed gradient of my shard of `unit` (fp32 [padded/world]); resets the accumulator."""

    def allgather_scalar(self, version: int, x: float) -> np.ndarray:
        """Every rank's x for this version, as float64 [world]; calls happen in the same order on
        every rank (allgather_bytes)."""

    def allgather(self, version: int, values) -> np.ndarray:
        """Every rank's vector of values in one exchange, float64 [world, len(values)]; calls (this
        and allgather_scalar) happen in the same order on every rank: one per minibatch's end."""

    def claim(self, version: int, owner: int, count: int, steal: bool) -> int:
        """LB-Steal (balance.ClaimFn): one of `owner`'s `count` microbatches of minibatch
        `version`, the front for the owner, the back for a thief; -1 when none is left."""

    def master_view(self, unit: int) -> np.ndarray | None:
        """My master shard as a writable host array (the zero-copy owner path), or None."""

    def grad_view(self, unit: int) -> np.ndarray:
        """fetch_grad without the copy: valid until clear_grad(unit)."""

    def clear_grad(self, unit: int) -> None:
        """Reset the gradient lent by grad_view (before publishing the next version)."""

    def publish_in_place(self, unit: int, version: int) -> None:
        """Announce `version` of the master shard written in place through master_view."""

    def close(self, barrier: bool = True) -> None:
        """Shut the runtime down (all ranks together unless barrier=False)."""


def odc_gather_fn(runtime, compute_dtype=jnp.float32, per_leaf: bool | None = None) -> GatherFn:
    """The trainer's gather over an ODC runtime (`jaxodc.ops.odc_gather`).

    Args:
      runtime: the `jaxodc.odc.Runtime` whose units are the layout's units, registered padded.
      compute_dtype: the dtype the unit is gathered and computed in (fp32, or bf16 under mixed
        precision); its gradient is pushed in it too and accumulated in fp32 by the owner. (A
        bf16 unit's cotangent is bf16, so pushing it in fp32 would carry the same values in twice
        the bytes: the policy's reduce dtype does not apply to ODC, whose sums are fp32 anyway.)
      per_leaf: push each parameter's gradient on its own (`odc_gather_pieces`), never
        concatenating a unit's gradient (default: on the CPU backend, where range pushes exist).

    Returns:
      gather(shard, spec, version) -> the unit, flat or cut into its leaves.
    """
    per_leaf = jax.default_backend() == "cpu" if per_leaf is None else bool(per_leaf)

    def gather(shard, spec, version):
        if per_leaf and not spec.per_leaf:  # the runtime's pieces are ranges of the contiguous flat unit
            return odc_gather_pieces(shard, version, runtime=runtime, unit=spec.index, numel=spec.padded,
                                     pieces=spec.leaf_pieces(), dtype=compute_dtype)
        return odc_gather(shard, version, runtime=runtime, unit=spec.index, numel=spec.padded, dtype=compute_dtype)

    return gather


def _aliases(a: jax.Array, host: np.ndarray) -> bool:
    """Whether jax array `a` lives in `host`'s memory (a zero-copy view of it)."""
    try:
        return a.unsafe_buffer_pointer() == host.ctypes.data
    except Exception:  # noqa: BLE001 -- not a single-device buffer, or a platform without pointers
        return False


# _end_program's (head, version, exchange) for a run that skips the peers (warm-up, memory reports):
# a head of two float64 zeros, and exchange 0.
_NO_EXCHANGE = (np.zeros(4, np.uint32), np.int32(0), np.int32(0))


class OdcTrainer(ShardedTrainer):
    """comm="odc" driver over an `OdcRuntime`: per minibatch v, run my microbatches (any count,
    including zero) -> done(v) -> wait_complete(v) -> the end of the minibatch: the optimizer's
    partial sums, one exchange (allgather: loss, token count, partial sums), one optimizer program
    over my shards -- all three in one compiled program when the optimizer has global reductions
    -- -> publish every unit at v+1 (train.unitwise.EndStep; `_end`).

    Args:
      model: a unit-staged model (`unit_names`, `apply_unit`), a `loss_fn(params, batch)` returning
        the microbatch's summed loss or (that, new state) (then `example_batch` is needed), or a
        `program.Program`. With mutable state the runtime needs `Program.runtime_units()`.
      optimizer: any Optax transformation; it runs on the local shards.
      params: the full initial parameters, the same on every rank.
      runtime: the ODC runtime (`jaxodc.odc.Runtime` across processes).
      gather: how a unit is gathered inside jit; default `odc_gather_fn(runtime)`.
      owns_runtime: close the runtime when the trainer is closed.
      compress: a CompressionPlan of this layout (`Compression(...).plan(layout)`): its pieces
        travel to other ranks TAGC-compressed (bitmap + count sketch, decoded by the owner per push;
        csrc/odc/compress.h), every rank the same (checked). Error-feedback residuals live in the
        runtime, one per compressed range; checkpoints keep them (train.checkpoint).
      example_batch: a microbatch to trace a loss function on (program.traced_program).
      precision: "fp32", "bf16" or a `train.precision.MixedPrecision` (FSDP2's mixed precision:
        units gathered and computed in bf16, float inputs cast, gradients pushed in bf16 and
        accumulated in fp32 by the owners; masters and optimizer fp32).
      straggle: straggler injection (train.straggle.Straggle), None for none; settable later as
        `trainer.straggle`.
      **unit_policy: how a loss function's units are found (train.discover.discover_units).
    """

    comm = "odc"

    def __init__(self, model, optimizer: optax.GradientTransformation, params: dict, runtime: OdcRuntime, *,
                 gather: GatherFn | None = None, owns_runtime: bool = False, compress: CompressionPlan | None = None,
                 example_batch=None, precision: str | MixedPrecision = "fp32", straggle: Straggle | None = None,
                 **unit_policy):
        self.model, self.optimizer, self.rt, self._owns_runtime = model, optimizer, runtime, owns_runtime
        self.precision = policy = precision_of(precision)
        self.world, self.rank = runtime.world, runtime.rank
        self.straggle = straggle
        if straggle is not None:
            straggle.check_world(self.world)
        # (grads, global_tokens) -> grads, applied to the owner's complete gradient shards before
        # the optimizer: hybrid sharding averages them across sites (optim.sites); None: as they are.
        # Settable at any time between minibatches: it applies from the next minibatch's end on.
        self.grad_exchange = None
        self.program = program_of(model, params, self.world, example_batch=example_batch, **unit_policy)
        self.layout, self.consts = self.program.layout, self.program.consts
        self.compress = compress
        self._register_ranges(compress)
        self.version = 0
        # Runtime versions count minibatches of this runtime; after restore the trainer's step
        # (self.version) runs ahead of them by this offset (see load_local_state).
        self._rt_base = 0
        shards = {n: jnp.asarray(s) for n, s in self.program.shard(params, self.rank).items()}
        # the user's chain, meaning on this rank's shards what it means on the whole tree
        self.optimizer = optimizer = place(optimizer, self.program.param_tree(), self.layout, self.rank)
        self.opt_state = optimizer.init(shards)
        self._state_unit = self._check_state_unit()
        grad_fn = self.program.grad(gather or odc_gather_fn(runtime, policy.compute_dtype), policy.compute_dtype,
                                    cast=policy.cast_inputs)
        def mb_step(s, c, b, n, v):
            # The (zero) shard gradients carry the pushes' ordering tokens. One element of each is
            # returned so the backward pass stays live and ordered before the result, without
            # materialising shard-sized zeros every microbatch (the pushes themselves are
            # side-effecting custom calls, never dropped). out: the loss, or (loss, weighted state).
            out, g = grad_fn(s, c, b, n, v)
            return out, sum(x[0] for x in jax.tree_util.tree_leaves(g))

        self._mb_step = jax.jit(mb_step)

        # The end of a minibatch (train.unitwise.EndStep): the optimizer's global reductions found
        # by tracing it, their partial sums computed by one program and summed in the minibatch's
        # one exchange (with the loss and token count), then one program for the whole optimizer.
        # With the runtime's masters as shards it writes each unit's new shard into its master from
        # inside the program (odc_store_master), unit after unit, so no second copy of the shards
        # exists; otherwise the shards are replaced (donated).
        self._masters = self._master_views()
        store = token = None
        if self._masters is not None:
            from jaxodc.ops import new_token
            from jaxodc.ops.odc import odc_store_master
            index = {u.name: u.index for u in self.layout.units}
            store = lambda name, x, tok: odc_store_master(x, tok, runtime=runtime, unit=index[name])  # noqa: E731
            token = new_token
        self.end = EndStep(optimizer, shards, self.opt_state, store=store, token=token, agree=self.allgather_obj)
        self._unit_ids = [u.index for u in self.layout.units]  # the parameters' units (not the state's)
        # With global reductions to agree on, the exchange runs inside the optimizer's program
        # (odc_allgather): one dispatch for the whole end of a minibatch. With masters in place
        # (CPU) the program stores the new shards; otherwise (GPU) it returns them, to be published.
        self._end_program = None
        if self.end.rounds and getattr(runtime, "handle", None) is not None:  # a native runtime (not a test double)
            from jaxodc.ops.odc import odc_allgather
            # (loss, tokens) float64 as four words: the update applies only where the counts agree
            self._end_program = self.end.exchanged(
                lambda head, part, ver, on: odc_allgather(head, part, ver, on, runtime=runtime),
                keep=lambda rows: jnp.all(rows[:, 2:4] == rows[:1, 2:4]))
        self._grads = None  # zero-copy arrays of the runtime's accumulators, made once (_grad_arrays)
        self._global_tokens = 1.0  # the current minibatch's (grad_exchange's argument)
        self.check_same({**setting_of(compress), "precision": str(policy)}, "compression and precision setting")
        self._traffic_seen = self._traffic()
        self._publish(shards, 0)
        if self._state_unit is not None:
            self.rt.publish(self._state_unit, np.zeros(self._state_padded // self.world, np.float32), 0)

    def _check_state_unit(self) -> int | None:
        """The runtime unit that sums the weighted mutable state (train.state), after the layout's:
        one push per rank and one gather per minibatch (a reduce-scatter and an all-gather on the
        gradients' path, ordered by the done / wait_complete every minibatch makes anyway), where
        allgather_scalar would take a round trip per scalar."""
        if self.program.state is None:
            return None
        self._state_padded = self.program.runtime_units()[-1]
        want, got = self.program.runtime_units(), getattr(self.rt, "unit_sizes", None)
        if got is not None and list(got) != want:
            raise ValueError(f"rank {self.rank}: the runtime has units {list(got)}, the model needs {want} (its "
                             f"layout's, then one for the mutable state {list(self.program.state.paths)[:3]}...): "
                             "create it with Runtime.create(program.runtime_units(), ctx)")
        return len(self.layout.units)

    def _register_ranges(self, plan: CompressionPlan | None) -> None:
        """The plan's pieces travel compressed; without a plan the default setting's pieces are
        registered to be counted only (records' wire_bytes_selected)."""
        unknown = sorted(set(plan.pieces) - set(self.layout.names)) if plan is not None else []
        if unknown:
            raise ValueError(f"rank {self.rank}: the compression plan names units {unknown} that the model's "
                             f"layout lacks (units: {list(self.layout.names)}); plan it on this layout")
        track = plan if plan is not None else tracking_plan(self.layout)
        if track is None or not hasattr(self.rt, "add_range"):
            if plan is not None:
                raise TypeError(f"rank {self.rank}: compression needs a runtime with add_range (jaxodc.odc.Runtime)")
            return
        for u in self.layout.units:
            for offset, size in track.selected(u.name):
                self.rt.add_range(u.index, offset, size, fraction=track.fraction, ratio=track.ratio, seed=track.seed,
                                  compress=plan is not None)

    def _traffic(self) -> dict[str, dict] | None:
        if not hasattr(self.rt, "traffic"):
            return None
        return {u.name: self.rt.traffic(u.index) for u in self.layout.units}

    def _record_traffic(self, res: StepResult) -> None:
        """The minibatch's gradient traffic (counter deltas since the last minibatch) into `res`."""
        now, seen = self._traffic(), self._traffic_seen
        if now is None:
            return
        self._traffic_seen = now
        delta = {n: {k: now[n][k] - seen[n][k] for k in now[n]} for n in now}
        total = lambda key: sum(d[key] for d in delta.values())  # noqa: E731
        res.wire_bytes_units = {n: d["wire_bytes"] for n, d in delta.items()}
        res.wire_bytes, res.wire_bytes_selected = total("wire_bytes"), total("range_bytes")
        if self.compress is not None:
            res.peeled, res.estimated = total("peeled"), total("estimated")
            res.kept_fraction = total("kept_elems") / total("range_elems") if total("range_elems") else None

    def _master_views(self) -> list[np.ndarray] | None:
        """The runtime's master shards, when jax can use them as its own arrays without a copy
        (host memory on the CPU backend); then the trainer keeps no second copy of its shards."""
        views = [self.rt.master_view(u.index) for u in self.layout.units]
        if any(v is None for v in views):
            return None
        probe = jax.device_put(views[0])
        return views if _aliases(probe, views[0]) else None

    def _publish(self, shards: dict, version: int) -> None:
        """Copy `shards` into the runtime as `version` and make them the trainer's current shards:
        with the runtime's masters as shards, the zero-copy arrays of the masters (made once; the
        end of a minibatch writes the masters in place and announces them, _end)."""
        for u in self.layout.units:
            self.rt.publish(u.index, np.asarray(shards[u.name]), version)
        if self._masters is not None:
            if not (isinstance(getattr(self, "shards", None), dict) and
                    all(_aliases(self.shards[u.name], self._masters[u.index]) for u in self.layout.units)):
                self.shards = {u.name: jax.device_put(self._masters[u.index]) for u in self.layout.units}
            return
        self.shards = shards

    def _grad_arrays(self) -> dict:
        """The completed minibatch's gradients as jax arrays. grad_view is asked every minibatch
        (the runtime may finish its accumulation there); where jax can alias its memory, the
        zero-copy arrays made the first time are reused while the views stay where they were
        (read only until clear_grad). Otherwise copies; with a grad_exchange, its results, whenever
        it was installed (the cached arrays serve only while there is none)."""
        if self._grads is not None and self.grad_exchange is None:  # the accumulators never move (lend_grads)
            self.rt.lend_grads(self._unit_ids)
            return self._grads
        views = {u.name: self.rt.grad_view(u.index) for u in self.layout.units}
        if self.grad_exchange is not None:
            return {n: jax.device_put(g) for n, g in self.grad_exchange(views, self._global_tokens).items()}
        grads = {n: jax.device_put(g) for n, g in views.items()}
        if self._masters is not None and all(_aliases(grads[n], views[n]) for n in grads):
            self._grads = grads
        return grads

    def _end(self, v: int, loss: float, global_tokens: float) -> float:
        """The end of runtime minibatch v, after wait_complete(v): one exchange of the loss, the
        token count and the optimizer's partial sums (EndStep; an exchange per further level of
        sites that read other sites), one optimizer program, then version v + 1 published. With
        global reductions the exchange is an op of that program (`_end_program`): one dispatch, no
        host round trip; with masters in place (CPU) the program also stores the new shards, else
        they are published from its result. Ranks given different token counts raise before
        anything is applied or published. Returns the global loss."""
        end, grads = self.end, self._grad_arrays()
        leaves = jax.tree_util.tree_leaves(self.opt_state)
        head = np.array([loss, global_tokens], np.float64)
        if self._end_program is not None:
            out, rows = self._end_program(self.shards, leaves, grads, head.view(np.uint32), np.int32(v), np.int32(1))
            rows = np.asarray(rows).view(np.float64)  # checked below: the program applied nothing where they differ
        else:
            # with nothing else to exchange first, the counts are (one round trip before the update)
            rows, known = (self.rt.allgather(v, head) if not end.rounds else None), [None] * len(end.sites)
            for k in range(end.rounds):
                part = np.asarray(end.partials(k, self.shards, leaves, grads, end.fill(known)), np.float64)
                got = self.rt.allgather(v, np.concatenate([head, part]) if k == 0 else part)
                if k == 0:
                    rows, got = got[:, :2], got[:, 2:]
                end.split(k, got.sum(axis=0), known)
            self._check_tokens(v, rows, global_tokens)
            out = end.apply(self.shards, leaves, grads, end.fill(known))
        if self._masters is not None:
            new_leaves, token = out
            jax.block_until_ready(token)  # every unit's new shard is in its master
        else:
            shards, new_leaves = out
            jax.block_until_ready(shards)
        self.opt_state = end.state_tree(new_leaves)
        self._check_tokens(v, rows, global_tokens)
        # The gradients are cleared before the next version is announced: peers push into them
        # right after.
        if self._masters is not None:
            self.rt.clear_and_publish_in_place(self._unit_ids, v + 1)
        else:
            for u in self.layout.units:
                self.rt.clear_grad(u.index)
            self._publish(shards, v + 1)
        return float(np.sum(rows[:, 0]))

    def _check_tokens(self, v: int, rows: np.ndarray, global_tokens: float) -> None:
        """Every rank's (loss, token count) must agree on the count (the minibatch's global one)."""
        if np.any(rows[:, 1] != global_tokens):
            raise ValueError(f"rank {self.rank}: ranks were given different global token counts for minibatch "
                             f"{v + self._rt_base} (train_minibatch takes the whole minibatch's count, the same on "
                             f"every rank); nothing was applied: "
                             + ", ".join(f"rank {r}: {t:g}" for r, t in enumerate(rows[:, 1])))

    def end_programs(self, grads: dict):
        """(name, jitted program, its arguments) of the end of a minibatch, for compiled-memory
        reports (nothing runs)."""
        leaves = jax.tree_util.tree_leaves(self.opt_state)
        if self._end_program is None:
            yield from self.end.programs(self.shards, leaves, grads)
        else:
            yield "end", self._end_program, (self.shards, leaves, grads, *_NO_EXCHANGE)

    def warm_end(self) -> None:
        """Compiles and runs the end-of-minibatch programs once (benchmarks: before timing) on this
        minibatch's accumulated gradients, which it then drops, and on a copy of the optimizer
        state; shards and state stay as they were (masters written in place are restored). Call
        between wait_complete(v) and the publication of v + 1; it exchanges nothing."""
        end, grads, saved = self.end, self._grad_arrays(), self.local_shards()
        leaves = [jnp.copy(x) for x in jax.tree_util.tree_leaves(self.opt_state)]
        shards = self.shards if self._masters is not None else {n: jnp.copy(a) for n, a in self.shards.items()}
        if self._end_program is not None:
            jax.block_until_ready(self._end_program(shards, leaves, grads, *_NO_EXCHANGE))
        else:
            fed = end.fill([None] * len(end.sites))
            for k in range(end.rounds):
                jax.block_until_ready(end.partials(k, shards, leaves, grads, fed))
            jax.block_until_ready(end.apply(shards, leaves, grads, fed))
        if self._masters is not None:
            for u in self.layout.units:
                np.copyto(self._masters[u.index], saved[u.name])
        for u in self.layout.units:
            self.rt.clear_grad(u.index)

    def train_minibatch(self, microbatches: Iterable[dict], global_tokens: float,
                        sample_ids: Sequence[tuple[int, ...]] | None = None) -> StepResult:
        """`sample_ids`: each microbatch's sample indices, where known (train_plan): what straggler
        injection keys on (it may fill as `microbatches` is iterated)."""
        step, v = self.version, self.version - self._rt_base  # v: runtime version
        if global_tokens <= 0:
            raise ValueError(f"rank {self.rank}: global_tokens must be positive, got {global_tokens}")
        res, cpu0 = StepResult(step, 0.0, time.perf_counter(), 0.0), time.process_time()
        res.straggle_s = None if self.straggle is None else []
        ntok, ver = jnp.float32(global_tokens), jnp.int32(v)
        loss, state = 0.0, None
        for m, mb in enumerate(microbatches):
            t0, compiled0 = time.perf_counter(), compile_seconds()
            l, _ = self._mb_step(self.shards, self.consts, jax.tree_util.tree_map(jnp.asarray, mb), ntok, ver)
            if self._state_unit is not None:
                l, w = l
                state = np.asarray(w) if state is None else state + np.asarray(w)
            loss += float(l)
            # after the compute, before the next claim: a slowed rank steals less
            stall(self.straggle, res, step, self.rank, microbatch_identity(self.rank, m, sample_ids), t0, compiled0)
            res.microbatches.append((t0, time.perf_counter()))
        if state is not None:  # a rank that ran nothing adds nothing
            self.rt.scatter_accumulate(self._state_unit, v, np.pad(state, (0, self._state_padded - state.size)))
        self.rt.done(v)
        self.rt.wait_complete(v)
        self._record_traffic(res)  # my pushes and my shards' decoding of minibatch v are complete
        # Before any v + 1 publication: peers push the next minibatch's state right after it.
        state_sum = None if self._state_unit is None else self.rt.fetch_grad(self._state_unit)
        t0 = time.perf_counter()
        self._global_tokens = global_tokens
        res.loss = self._end(v, loss, global_tokens)
        if state_sum is not None:
            self.rt.publish(self._state_unit, state_sum, v + 1)
            new = self.program.state.updated(self.consts, self.rt.gather(self._state_unit, v + 1))
            self.consts = tuple(jnp.asarray(c) for c in new)
        res.opt = (t0, time.perf_counter())
        res.end_s = res.opt[1] - res.opt[0]
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

        fields = fields_of(samples)

        def packed():
            for mb in claims:
                ran.append(mb)
                T = plan.max_tokens if min_bucket is None else bucket(plan.microbatch_tokens(mb), plan.max_tokens, min_bucket)
                yield with_key(pack([samples[i] for i in mb], T, fields=fields).as_dict(), self.rng_seed, self.version, mb)

        res = self.train_minibatch(packed(), plan_divisor(plan, samples, self.normalize), sample_ids=ran)
        res.ran = ran
        return res

    def local_shards(self) -> dict[str, np.ndarray]:
        # Copies: the shards may be the runtime's masters, which the next minibatch rewrites.
        if self._masters is not None:
            return {u.name: np.array(self._masters[u.index], np.float32) for u in self.layout.units}
        return {n: np.array(a, np.float32) for n, a in self.shards.items()}

    def local_opt_state(self):
        return jax.tree_util.tree_map(np.asarray, self.opt_state)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes through the runtime's scalar all-gather: the length, then 6 bytes per
        float64 (exact below 2**53). Every rank must make the same calls in the same order."""
        rv = self.version - self._rt_base
        n = [int(x) for x in self.rt.allgather_scalar(rv, float(len(data)))]
        words = -(-max(n) // 6)
        padded = data.ljust(6 * words, b"\0")
        got = [self.rt.allgather_scalar(rv, float(int.from_bytes(padded[6 * i:6 * i + 6], "little")))
               for i in range(words)]
        return [b"".join(int(got[i][r]).to_bytes(6, "little") for i in range(words))[:n[r]]
                for r in range(self.world)]

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
        extra = [] if self._state_unit is None else [(self._state_unit, "mutable state")]
        for index, name in [(u.index, repr(u.name)) for u in self.layout.units] + extra:
            g = np.asarray(self.rt.fetch_grad(index))
            if np.any(g != 0):
                raise RuntimeError(f"rank {self.rank}: unit {name} received gradients for minibatch {rv} "
                                   "while restoring; every rank must restore between minibatches, together")
        self._publish(new_shards, rv + 1)
        if self._state_unit is not None:
            self.rt.publish(self._state_unit, np.zeros(self._state_padded // self.world, np.float32), rv + 1)
        self.version = int(version)
        self._rt_base = self.version - (rv + 1)

    def _compressed_ranges(self) -> dict[str, tuple[int, int, int]]:
        """"unit@offset" -> (unit index, offset, size) of every range whose pushes travel compressed."""
        if self.compress is None:
            return {}
        return {f"{u.name}@{off}": (u.index, off, size)
                for u in self.layout.units for off, size in self.compress.selected(u.name)}

    def local_residuals(self) -> dict[str, np.ndarray]:
        """Per compressed range ("unit@offset"), this rank's residual (the range's size)."""
        return {k: np.asarray(self.rt.residual(u, off), np.float32)
                for k, (u, off, _) in self._compressed_ranges().items()}

    def load_residuals(self, residuals) -> None:
        # between minibatches: this rank pushes nothing, so nothing else writes the residuals
        for k, (u, off, size) in self._compressed_ranges().items():
            self.rt.set_residual(u, off, np.zeros(size, np.float32) if residuals is None else residuals[k])

    def close(self, barrier: bool = True) -> None:
        """Closes the runtime when this trainer started it (all ranks together unless barrier=False)."""
        if self._owns_runtime:
            self._owns_runtime = False
            self.rt.close(barrier=barrier)
