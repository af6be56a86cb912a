"""DiLoCo and async DiLoCo over the fault-tolerant :class:`~jaxodc.comm.Communicator`.

DiLoCo runs ``H`` inner steps of any Optax optimizer on each peer's local parameters θ_local,
then all-reduces (averages over the current world) the pseudo-gradient Δ = θ_global − θ_local and
lets an outer optimizer (Nesterov SGD by default) step θ_global; θ_local is reset to θ_global.
θ_global and the outer optimizer state are the *shared state*: bit-identical on every peer,
checked by hash at every ``sync_shared_state``.

Building blocks (Optax style)
-----------------------------
``PseudoGradientReducer(comm, quantize=None, tag=...)``
    Host-side pytree averaging over the communicator: ``reducer(tree)`` blocks; ``start(tree)`` /
    ``finish()`` overlap the all-reduce with other work. Leaves are packed into one contiguous
    buffer per dtype (one all-reduce per dtype). An all-reduce aborted by a peer's failure is
    re-run over the survivors (``update_topology(accept_new=False)`` and the communicator's
    ``run_with_retry``), so the average is always over the peers that finished it.

``diloco_outer(outer, reduce)`` → ``optax.GradientTransformation``
    ``update(pseudo_grads, state, global_params)`` averages ``pseudo_grads`` with ``reduce`` (the
    injected all-reduce; ``None`` = a single peer) and applies ``outer``. Its state is exactly
    ``outer``'s state::

        tx = diloco_outer(optax.sgd(0.7, momentum=0.9, nesterov=True), PseudoGradientReducer(comm))
        delta = jax.tree.map(jnp.subtract, global_params, local_params)
        updates, outer_state = tx.update(delta, outer_state, global_params)
        global_params = optax.apply_updates(global_params, updates)

``async_diloco_outer(outer, reducer)`` → ``optax.GradientTransformation``
    The one-step-delayed form: ``update(Δ_t, ...)`` finishes the all-reduce started by the
    previous call, starts the all-reduce of Δ_t (it overlaps the next H inner steps) and applies
    the outer step to the *previous* average (the first call applies a zero update).

Both transformations communicate, so they are not ``jax.jit``-able as a whole; the outer update
runs op by op on purpose: unfused IEEE operations give the same bits on every peer and platform
(a jitted update may contract ``a*b+c`` into FMAs differently per backend).

Driver
------
``DiLoCo(comm, inner_opt, outer_opt=None, inner_steps=H, loss_fn=..., asynchronous=False)``::

    comm = Communicator(addr, secret=...).connect()
    dl = DiLoCo(comm, optax.adamw(3e-4), optax.sgd(0.7, momentum=0.9, nesterov=True),
                inner_steps=50, loss_fn=loss_fn)      # loss_fn(params, batch) -> scalar
    dl.init(params)                                   # same params on every founding peer
    for batch in data:
        loss = dl.step(batch)                         # inner step; every H-th also the outer step
    dl.flush()                                        # async: apply the last in-flight average
    dl.global_params, dl.params, dl.outer_state, dl.state_hash()

Custom loops call ``begin_outer()``, update ``dl.params`` themselves H times, then ``outer_step()``.

Membership (every peer runs the same sequence of calls)
-------------------------------------------------------
A peer that is not yet accepted when its first ``begin_outer`` runs is a *newcomer*: it calls
``update_topology`` (blocking until the group votes it in) and takes part in the group's next sync
with strategy ``receive_only``, so its own (stale) state can never win the popularity vote however
many newcomers arrive at once. Accepted peers check ``are_peers_pending()`` at every
``begin_outer`` (the answer is the same on every peer); when peers wait they admit them with
``update_topology`` and sync (``enforce_popular``; the revision check also keeps newcomers out of
the vote). Every peer then resets θ_local ← θ_global; newcomers start a fresh inner optimizer state
(it is local, not shared). A peer that finds itself alone after its first ``update_topology``
founds the group and keeps its own state; so peers may simply be started one after another, or a
founding group may be formed before DiLoCo starts (all with the same initial parameters).

Synchronous DiLoCo (Algorithm 2 of the PCCL report) also syncs at the start of every
``sync_every``-th outer iteration (default 1): a no-op (0 bytes) when all peers advanced
identically, and a hash check of the shared state every time.

Async DiLoCo and newcomers
--------------------------
Outer iteration t: inner steps from θ_global; Δ_t = θ_global − θ_local; finish the all-reduce of
Δ_{t−1}; start the all-reduce of Δ_t (it runs during the next H inner steps); apply the outer step
to avg(Δ_{t−1}); θ_local ← θ_global. So a pseudo-gradient is computed against θ_global^{t−2} and
applied to θ_global^{t−1} (one step late), and the first iteration applies nothing.

At a membership change the established peers first *finish* the in-flight all-reduce of
Δ_{t−1} (keeping its average, not yet applied), admit the newcomers, then sync a state that holds
θ_global, the outer state **and the average of Δ_{t−1}** (keys ``pending/<dtype index>`` plus
``pending/flag``). The newcomer thus receives, in a single ``sync_shared_state``, both the
θ_global its inner steps must start from (weight-compatible with everyone's Δ_t) and the result of
the all-reduce it missed; it adopts that average as its own pending result, so its next outer step
applies exactly the update the others apply and all stay bit-identical. (The PCCL report instead
runs a second send_only / receive_only sync after the established peers applied the missed
update; carrying the pending average in the first sync needs one sync instead of two and no
second stall.) Every async-mode sync carries the pending keys (zeros with flag 0 when nothing is
pending). ``sync_every`` defaults to 0 in async mode (sync only on joins): a sync must wait for
the in-flight all-reduce, which costs the overlap of that outer step.

Failures: a peer that dies during an all-reduce aborts it everywhere; the survivors re-form the
ring and re-run it over themselves (the average is over the survivors). For async DiLoCo the retry
happens when the in-flight all-reduce is finished.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxodc.comm import shared_state as ss
from jaxodc.comm.communicator import RETRYABLE, Communicator

log = logging.getLogger("jaxodc.optim.diloco")

PyTree = Any

__all__ = ["PseudoGradientReducer", "diloco_outer", "async_diloco_outer", "default_outer_optimizer",
           "pseudo_gradient", "DiLoCo"]

DEFAULT_TAG = 0xD10C0  # all-reduce tag of pseudo-gradients (dtype group i uses DEFAULT_TAG + i)


def default_outer_optimizer(learning_rate: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformation:
    """Nesterov SGD, the DiLoCo paper's outer optimizer."""
    return optax.sgd(learning_rate, momentum=momentum, nesterov=True)


def pseudo_gradient(global_params: PyTree, local_params: PyTree) -> PyTree:
    """Δ = θ_global − θ_local (leaf by leaf)."""
    return jax.tree.map(jnp.subtract, global_params, local_params)


class _Layout:
    """How a pytree packs into one flat host buffer per dtype (leaves in tree_leaves order)."""

    def __init__(self, tree: PyTree):
        leaves, self.treedef = jax.tree.flatten(tree)
        self.dtypes: list[np.dtype] = []
        self.slots: list[tuple[int, int, int, tuple]] = []  # (group, offset, size, shape) per leaf
        sizes: list[int] = []
        for i, leaf in enumerate(leaves):
            dt, shape = np.dtype(leaf.dtype), tuple(np.shape(leaf))
            if dt.kind != "f" and dt.name != "bfloat16":
                raise TypeError(f"pseudo-gradient leaf {i} ({jax.tree_util.keystr(self._path(tree, i))}) has dtype "
                                f"{dt}; DiLoCo averages floating-point parameters only")
            if dt not in self.dtypes:
                self.dtypes.append(dt)
                sizes.append(0)
            g = self.dtypes.index(dt)
            n = int(np.prod(shape, dtype=np.int64))
            self.slots.append((g, sizes[g], n, shape))
            sizes[g] += n
        self.sizes = sizes

    @staticmethod
    def _path(tree, i):
        return jax.tree_util.tree_flatten_with_path(tree)[0][i][0]

    def matches(self, tree: PyTree) -> bool:
        leaves, treedef = jax.tree.flatten(tree)
        return treedef == self.treedef and all(
            np.dtype(l.dtype) == self.dtypes[g] and tuple(np.shape(l)) == shape
            for l, (g, _, _, shape) in zip(leaves, self.slots))

    def zeros(self) -> list[np.ndarray]:
        return [np.zeros(n, dt) for dt, n in zip(self.dtypes, self.sizes)]

    def pack(self, tree: PyTree) -> list[np.ndarray]:
        leaves = jax.tree.leaves(tree)
        bufs = self.zeros()
        for leaf, (g, off, n, _) in zip(leaves, self.slots):
            bufs[g][off:off + n] = np.asarray(leaf).reshape(-1)
        return bufs

    def unpack(self, bufs: list[np.ndarray]) -> PyTree:
        leaves = [jnp.asarray(bufs[g][off:off + n].reshape(shape)) for g, off, n, shape in self.slots]
        return jax.tree.unflatten(self.treedef, leaves)


class PseudoGradientReducer:
    """Averages pytrees over the communicator's current world, retrying with the survivors.

    ``reducer(tree)`` blocks and returns the average; ``start(tree)`` launches it in the
    background and ``finish()`` returns it (``None`` when nothing was started). Every peer must
    make the same calls in the same order. ``quantize`` ("uint8"/"uint16") shrinks the transfer;
    peers still end bit-identical."""

    def __init__(self, comm: Communicator, *, quantize: str | None = None, tag: int = DEFAULT_TAG,
                 max_attempts: int = 20):
        self.comm = comm
        self.quantize = quantize
        self.tag = int(tag)
        self.max_attempts = int(max_attempts)
        self.layout: _Layout | None = None
        self._inputs: list[np.ndarray] | None = None   # packed Δ of the in-flight all-reduce
        self._handles: list | None = None
        self._result: list[np.ndarray] | None = None   # finished average, not yet consumed
        self.retries = 0          # all-reduces re-run after a failure
        self.worlds: list[int] = []  # world size of every completed average, in order

    # --- layout ----------------------------------------------------------------------------------

    def bind(self, template: PyTree) -> None:
        """Fix the pytree layout (shapes, dtypes) of the pseudo-gradients."""
        self.layout = _Layout(template)

    def _pack(self, tree: PyTree) -> list[np.ndarray]:
        if self.layout is None or not self.layout.matches(tree):
            if self._inputs is not None or self._result is not None:
                raise ValueError(f"{self._who()}: pseudo-gradient structure changed while an average is pending")
            self.layout = _Layout(tree)
        return self.layout.pack(tree)

    def _who(self) -> str:
        c = self.comm
        return f"peer {c.peer_id} (rank {c.rank}/{c.world_size})"

    # --- blocking ------------------------------------------------------------------------------

    def _reduce_once(self, bufs: list[np.ndarray]) -> list[np.ndarray]:
        hs = [self.comm.all_reduce_async(b, op="avg", quantize=self.quantize, tag=self.tag + i)
              for i, b in enumerate(bufs)]
        return self._wait_all(hs)

    @staticmethod
    def _wait_all(handles) -> list[np.ndarray]:
        out, err = [], None
        for h in handles:  # wait for all, so none is left in flight when one failed
            try:
                out.append(h.wait())
            except BaseException as e:  # noqa: BLE001 - re-raised below
                err = err or e
        if err is not None:
            raise err
        return out

    def _reduce_retry(self, bufs: list[np.ndarray]) -> list[np.ndarray]:
        attempts = [0]

        def once():
            attempts[0] += 1
            return self._reduce_once(bufs)

        out = self.comm.run_with_retry(once, max_attempts=self.max_attempts)
        self.retries += attempts[0] - 1
        self.worlds.append(self.comm.world_size)
        return out

    def __call__(self, tree: PyTree) -> PyTree:
        if self._inputs is not None or self._result is not None:
            raise RuntimeError(f"{self._who()}: a blocking average was requested while one is pending; "
                               f"finish() it first")
        avg = self._reduce_retry(self._pack(tree))  # _pack binds the layout first
        return self.layout.unpack(avg)

    # --- overlapped ------------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """An average was started (or adopted) and not yet consumed by finish()."""
        return self._inputs is not None or self._result is not None

    def start(self, tree: PyTree) -> None:
        if self.pending:
            raise RuntimeError(f"{self._who()}: start() while the previous average is pending; finish() it first")
        bufs = self._pack(tree)
        self._inputs = bufs
        try:
            self._handles = [self.comm.all_reduce_async(b, op="avg", quantize=self.quantize, tag=self.tag + i)
                             for i, b in enumerate(bufs)]
        except RETRYABLE:  # could not even open (a peer just left): finish() re-runs it
            self._handles = []

    def wait_pending(self) -> list[np.ndarray] | None:
        """Complete the in-flight average (re-running it over the survivors after a failure) and
        keep it as the pending result; returns the packed average or None."""
        if self._inputs is not None:
            try:
                if not self._handles:
                    raise RETRYABLE[0]("the all-reduce could not be opened")
                self._result = self._wait_all(self._handles)
                self.worlds.append(self.comm.world_size)
            except RETRYABLE as e:
                log.info("%s: pseudo-gradient all-reduce failed (%s); re-running it over the survivors",
                         self._who(), e)
                self.comm.update_topology(accept_new=False)
                self.retries += 1
                self._result = self._reduce_retry(self._inputs)
            self._inputs, self._handles = None, None
        return self._result

    def finish(self) -> PyTree | None:
        """The average of the last start() (or adopted result), or None when there is none."""
        res = self.wait_pending()
        self._result = None
        return None if res is None else self.layout.unpack(res)

    def adopt(self, bufs: list[np.ndarray] | None) -> None:
        """Take a finished average received from other peers (newcomers in async DiLoCo)."""
        if self._inputs is not None:
            raise RuntimeError(f"{self._who()}: adopt() while an all-reduce is in flight")
        if bufs is not None:
            if self.layout is None:
                raise RuntimeError(f"{self._who()}: adopt() before the layout is bound")
            want = [(dt, n) for dt, n in zip(self.layout.dtypes, self.layout.sizes)]
            got = [(np.dtype(b.dtype), b.size) for b in bufs]
            if got != want:
                raise ValueError(f"{self._who()}: adopted average has buffers {got}, expected {want}")
            bufs = [np.array(b) for b in bufs]
        self._result = bufs


def diloco_outer(outer: optax.GradientTransformation,
                 reduce: Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
    """Synchronous DiLoCo outer step: average the pseudo-gradients with ``reduce`` (e.g. a
    :class:`PseudoGradientReducer`; None = no communication), then apply ``outer``.

    ``update(pseudo_grads, state, params)``: ``params`` is θ_global; the state is ``outer``'s."""

    def init_fn(params):
        return outer.init(params)

    def update_fn(updates, state, params=None):
        avg = updates if reduce is None else reduce(updates)
        return outer.update(avg, state, params)

    return optax.GradientTransformation(init_fn, update_fn)


def async_diloco_outer(outer: optax.GradientTransformation,
                       reducer: PseudoGradientReducer) -> optax.GradientTransformation:
    """Async DiLoCo outer step (one step late): ``update(Δ_t, state, params)`` finishes the
    average started by the previous call, starts the all-reduce of Δ_t, and applies ``outer`` to
    the previous average (zero updates and unchanged state on the first call). The pending
    all-reduce lives in ``reducer``; ``reducer.finish()`` drains it."""

    def init_fn(params):
        return outer.init(params)

    def update_fn(updates, state, params=None):
        prev = reducer.finish()
        reducer.start(updates)
        if prev is None:
            return jax.tree.map(jnp.zeros_like, updates), state
        return outer.update(prev, state, params)

    return optax.GradientTransformation(init_fn, update_fn)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _inner_update(loss_fn, inner_opt, params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = inner_opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


class _Keys(NamedTuple):
    treedef: Any
    keys: list[str]


def _keyed(prefix: str, tree: PyTree) -> tuple[_Keys, list]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return _Keys(treedef, [prefix + jax.tree_util.keystr(p) for p, _ in flat]), [l for _, l in flat]


class DiLoCo:
    """DiLoCo / async DiLoCo driver for one peer (see the module docstring).

    comm: a connected Communicator. inner_opt: any Optax optimizer (local, per peer).
    outer_opt: the outer optimizer (default Nesterov SGD, lr 0.7, momentum 0.9).
    inner_steps: H. loss_fn(params, batch) -> scalar, needed by step()/inner_step().
    asynchronous: one-step-delayed outer updates overlapping the all-reduce with inner steps.
    sync_every: sync shared state every k outer iterations (default 1 sync, 0 async = joins only).
    quantize: None / "uint8" / "uint16" transfer of pseudo-gradients."""

    def __init__(self, comm: Communicator, inner_opt: optax.GradientTransformation,
                 outer_opt: optax.GradientTransformation | None = None, inner_steps: int = 1, *,
                 loss_fn: Callable | None = None, asynchronous: bool = False, sync_every: int | None = None,
                 quantize: str | None = None, tag: int = DEFAULT_TAG):
        if int(inner_steps) < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        self.comm = comm
        self.inner_opt = inner_opt
        self.outer_opt = outer_opt if outer_opt is not None else default_outer_optimizer()
        self.inner_steps = int(inner_steps)
        self.loss_fn = loss_fn
        self.asynchronous = bool(asynchronous)
        self.sync_every = int((0 if asynchronous else 1) if sync_every is None else sync_every)
        self.reducer = PseudoGradientReducer(comm, quantize=quantize, tag=tag)
        self.outer_tx = (async_diloco_outer if asynchronous else diloco_outer)(self.outer_opt, self.reducer)
        self.global_params = self.outer_state = self.params = self.inner_state = None
        self.outer_steps = 0        # outer iterations completed on this peer
        self.inner_count = 0        # inner steps done in the current outer iteration
        self.revision: int | None = None
        self.last_sync: ss.SyncInfo | None = None
        self._begun = False
        self._started = False

    # --- state -----------------------------------------------------------------------------------

    def init(self, params: PyTree) -> "DiLoCo":
        params = jax.tree.map(jnp.asarray, params)
        self.global_params = params
        self.outer_state = self.outer_tx.init(params)
        self.params = params
        self.inner_state = self.inner_opt.init(params)
        self.reducer.bind(params)
        return self

    def _who(self) -> str:
        c = self.comm
        return f"peer {c.peer_id} (rank {c.rank}/{c.world_size}, outer step {self.outer_steps})"

    def shared_state(self, pending: bool | None = None) -> dict[str, np.ndarray]:
        """The shared state as a flat dict of host arrays (copies): θ_global, the outer optimizer
        state and (pending; default: in async mode) the pending average, which first completes
        the in-flight all-reduce."""
        self._check_init()
        gk, gl = _keyed("global", self.global_params)
        ok, ol = _keyed("outer", self.outer_state)
        d = {k: np.array(v) for k, v in zip(gk.keys + ok.keys, gl + ol)}
        if self.asynchronous if pending is None else pending:
            res = self.reducer.wait_pending() if self.reducer.pending else None
            bufs = res if res is not None else self.reducer.layout.zeros()
            for i, b in enumerate(bufs):
                d[f"pending/{i}"] = np.array(b)
            d["pending/flag"] = np.array([0 if res is None else 1], np.int32)
        return d

    def state_hash(self) -> int:
        """Combined hash of θ_global and the outer state (equal on every peer when they agree);
        never waits for an in-flight all-reduce."""
        return ss.combined_hash(ss.state_hashes(self.shared_state(pending=False)))

    def _load_shared(self, d: dict[str, np.ndarray], fetched: list[str]) -> None:
        gk, _ = _keyed("global", self.global_params)
        ok, _ = _keyed("outer", self.outer_state)
        if any(k in fetched for k in gk.keys):
            self.global_params = jax.tree.unflatten(gk.treedef, [jnp.asarray(d[k]) for k in gk.keys])
        if any(k in fetched for k in ok.keys):
            self.outer_state = jax.tree.unflatten(ok.treedef, [jnp.asarray(d[k]) for k in ok.keys])
        if self.asynchronous and any(k.startswith("pending/") for k in fetched):
            flag = int(np.asarray(d["pending/flag"]).reshape(-1)[0])
            self.reducer.adopt([d[f"pending/{i}"] for i in range(len(self.reducer.layout.sizes))] if flag else None)

    def _check_init(self) -> None:
        if self.global_params is None:
            raise RuntimeError("DiLoCo.init(params) must be called first")

    # --- membership and shared state -------------------------------------------------------------

    def _sync(self, strategy: str) -> ss.SyncInfo:
        state = self.shared_state()
        rev = 0 if self.revision is None else self.revision + 1
        info = self.comm.run_with_retry(self.comm.sync_shared_state, state, rev, strategy)
        if info.rejected:
            log.warning("%s: shared-state sync: %s", self._who(), info.rejected)
        if info.keys_fetched:
            log.info("%s: shared-state sync fetched %d keys (%d bytes)", self._who(), len(info.keys_fetched),
                     info.bytes_received)
            self._load_shared(state, info.keys_fetched)
        self.revision = info.revision
        self.last_sync = info
        return info

    def begin_outer(self) -> None:
        """Start an outer iteration: admit newcomers / join, sync shared state when due, reset
        θ_local ← θ_global. step() calls it before the first inner step of every iteration."""
        self._check_init()
        if self._begun:
            return
        comm = self.comm
        strategy = None
        if not comm.accepted:  # a newcomer: blocks until the group votes it in
            comm.update_topology()
            # alone in the group: it founds it, and its state is the one to keep
            strategy = "receive_only" if comm.world_size > 1 else "enforce_popular"
        elif comm.are_peers_pending():
            if self.reducer.pending:
                self.reducer.wait_pending()  # major operations never overlap collectives
            comm.update_topology()
            strategy = "enforce_popular"
        elif not self._started or (self.sync_every and self.outer_steps % self.sync_every == 0):
            strategy = "enforce_popular"
        if strategy is not None:
            self._sync(strategy)
        self._started = True
        self.params = self.global_params
        self.inner_count = 0
        self._begun = True

    # --- training --------------------------------------------------------------------------------

    def inner_step(self, batch) -> jax.Array:
        """One step of the inner optimizer on the local parameters."""
        if self.loss_fn is None:
            raise ValueError("DiLoCo needs loss_fn for inner_step()/step(); custom loops update .params")
        if not self._begun:
            self.begin_outer()
        self.params, self.inner_state, loss = _inner_update(self.loss_fn, self.inner_opt, self.params,
                                                            self.inner_state, batch)
        self.inner_count += 1
        return loss

    def outer_step(self) -> None:
        """Pseudo-gradient, (async: start its) all-reduce, outer optimizer step, θ_local reset."""
        if not self._begun:
            raise RuntimeError(f"{self._who()}: outer_step() without begin_outer()/inner steps")
        delta = pseudo_gradient(self.global_params, self.params)
        updates, self.outer_state = self.outer_tx.update(delta, self.outer_state, self.global_params)
        self.global_params = optax.apply_updates(self.global_params, updates)
        self.params = self.global_params
        self.outer_steps += 1
        self._begun = False

    def step(self, batch) -> jax.Array:
        """One inner step; after every H-th inner step also the outer step. Returns the loss."""
        loss = self.inner_step(batch)
        if self.inner_count >= self.inner_steps:
            self.outer_step()
        return loss

    def flush(self) -> None:
        """Async DiLoCo: finish the in-flight all-reduce and apply it (end of training)."""
        if not self.asynchronous:
            return
        prev = self.reducer.finish()
        if prev is not None:
            updates, self.outer_state = self.outer_opt.update(prev, self.outer_state, self.global_params)
            self.global_params = optax.apply_updates(self.global_params, updates)
            self.params = self.global_params
