"""DiLoCo and async DiLoCo over the fault-tolerant communicator: the outer Optax transformation and
the per-peer driver. The algorithm, membership changes and the async semantics: docs/diloco.md."""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxodc.comm import shared_state as ss
from jaxodc.comm.communicator import Communicator, MasterUnavailable
from jaxodc.optim.reducer import DEFAULT_TAG, PendingAverage, PseudoGradientReducer

log = logging.getLogger("jaxodc.optim.diloco")

PyTree = Any

__all__ = ["DiLoCo", "PendingAverage", "PseudoGradientReducer", "default_outer_optimizer", "diloco_outer",
           "pseudo_gradient"]


def default_outer_optimizer(learning_rate: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformation:
    """The DiLoCo paper's outer optimizer, Nesterov SGD.

    Args:
      learning_rate: outer learning rate.
      momentum: Nesterov momentum.

    Returns:
      ``optax.sgd(learning_rate, momentum=momentum, nesterov=True)``.
    """
    return optax.sgd(learning_rate, momentum=momentum, nesterov=True)


def pseudo_gradient(global_params: PyTree, local_params: PyTree) -> PyTree:
    """The DiLoCo pseudo-gradient.

    Args:
      global_params: θ_global, the parameters the inner steps started from.
      local_params: θ_local after the inner steps.

    Returns:
      θ_global − θ_local, leaf by leaf.
    """
    return jax.tree.map(jnp.subtract, global_params, local_params)


def diloco_outer(outer: optax.GradientTransformation,
                 reduce: Callable[[PyTree], PyTree] | None = None) -> optax.GradientTransformation:
    """The synchronous DiLoCo outer step: average the pseudo-gradients, then apply ``outer``.

    ``update(pseudo_grads, state, params)`` returns ``outer``'s updates for the average and
    ``outer``'s new state; ``params`` is θ_global. It keeps nothing between calls: the same inputs
    on every peer give the same result. It communicates, so it is not ``jax.jit``-able; run op by
    op, the outer step gives the same bits on every peer and backend (no per-backend fusion).

    Args:
      outer: the outer optimizer, e.g. :func:`default_outer_optimizer`.
      reduce: averages a pytree over the peers, e.g. a :class:`PseudoGradientReducer`; None for a
        single peer, or for pseudo-gradients already averaged (async DiLoCo in a custom loop).

    Returns:
      An ``optax.GradientTransformation`` whose state is ``outer``'s state.

    Example:
      >>> tx = diloco_outer(default_outer_optimizer(), PseudoGradientReducer(comm))
      >>> state = tx.init(theta)
      >>> updates, state = tx.update(pseudo_gradient(theta, local), state, theta)
      >>> theta = optax.apply_updates(theta, updates)
    """

    def update_fn(pseudo_grads, state, params=None):
        average = pseudo_grads if reduce is None else reduce(pseudo_grads)
        return outer.update(average, state, params)

    return optax.GradientTransformation(outer.init, update_fn)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _inner_update(loss_fn, inner_opt, params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = inner_opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _keyed(prefix: str, tree: PyTree) -> dict[str, np.ndarray]:
    """Host copies of the leaves, keyed ``prefix + keystr(path)``: one shared-state key per leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {prefix + jax.tree_util.keystr(path): np.array(leaf) for path, leaf in flat}


def _unkeyed(prefix: str, like: PyTree, state: dict[str, np.ndarray]) -> PyTree:
    """The inverse of ``_keyed(prefix, like)``, reading the leaves from ``state``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree.unflatten(treedef, [jnp.asarray(state[prefix + jax.tree_util.keystr(path)]) for path, _ in flat])


class DiLoCo:
    """DiLoCo or async DiLoCo for one peer: inner steps, outer steps, membership and shared state.

    θ_global (``global_params``) and the outer optimizer state (``outer_state``) are the shared
    state, bit-identical on every peer; ``params`` (θ_local) and ``inner_state`` are local. Every
    peer makes the same sequence of calls. Newcomers join at their first outer step.

    Args:
      comm: a connected :class:`~jaxodc.comm.Communicator`.
      inner_opt: any Optax optimizer, run on θ_local; None for custom loops that train θ_local
        themselves (a sharded trainer, jaxodc.optim.sites).
      outer_opt: the outer optimizer; default :func:`default_outer_optimizer`.
      inner_steps: H, the inner steps per outer step.
      loss_fn: ``loss_fn(params, batch) -> scalar``, needed by :meth:`step` and :meth:`inner_step`.
      asynchronous: overlap each outer step's all-reduce with the next H inner steps and apply its
        average one outer step late.
      sync_every: sync the shared state at every k-th outer step; 0 syncs only when peers join.
        Default 1, or 0 when asynchronous (a sync must first wait for the in-flight all-reduce).
      quantize: None, ``"uint8"`` or ``"uint16"``: the pseudo-gradients' transfer format.
      tag: all-reduce tag of the pseudo-gradients (see :class:`PseudoGradientReducer`).
      agree: combines the group's "peers pending" answer with the answers of partners outside the
        group that must admit newcomers at the same outer step (a site's ranks, each in its own
        ring: jaxodc.optim.sites); every partner must make the same calls. None: the answer as is.
      admit: how this peer, a newcomer, gets voted in (None: ``comm.update_topology()``); a site
        joins all its rings or none (jaxodc.optim.sites).
      rejoin_s: a peer that lost the coordination service (a partition, its link down: the group
        drops it and goes on) registers again for up to this long and is voted back in as a
        newcomer at its next outer step, fetching θ_global and the outer state; the outer step it
        was in is then the group's without it (its pseudo-gradient is dropped, nothing is applied
        twice). 0: MasterUnavailable is raised (the default, as before).

    Example:
      >>> dl = DiLoCo(comm, optax.adamw(3e-4), inner_steps=50, loss_fn=loss_fn).init(params)
      >>> for batch in data:
      ...     loss = dl.step(batch)
      >>> dl.flush()   # the last partial outer step; async: also the average in flight
    """

    def __init__(self, comm: Communicator, inner_opt: optax.GradientTransformation | None,
                 outer_opt: optax.GradientTransformation | None = None, inner_steps: int = 1, *,
                 loss_fn: Callable | None = None, asynchronous: bool = False, sync_every: int | None = None,
                 quantize: str | None = None, tag: int = DEFAULT_TAG, agree: Callable[[bool], bool] | None = None,
                 admit: Callable[[], None] | None = None, rejoin_s: float = 0.0):
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
        self.agree = agree
        self.admit = admit
        self.rejoin_s = float(rejoin_s)
        self.rejoins = 0            # times this peer lost the service and registered again
        self.global_params = self.outer_state = self.params = self.inner_state = None
        self.outer_steps = 0        # outer steps completed on this peer
        self.inner_count = 0        # inner steps done in the current outer step
        self.revision: int | None = None  # shared-state revision of the last sync; None before the first
        self.last_sync: ss.SyncInfo | None = None
        self._begun = False         # begin_outer() ran and outer_step() has not yet
        self._pending: PendingAverage | None = None  # async: the average to apply at the next outer step

    # --- state -----------------------------------------------------------------------------------

    def init(self, params: PyTree) -> "DiLoCo":
        """Sets θ_global = θ_local = ``params`` and fresh optimizer states.

        Args:
          params: the initial parameters; the same on every founding peer (a newcomer's are
            replaced at its first sync).

        Returns:
          ``self``.
        """
        params = jax.tree.map(jnp.asarray, params)
        self.global_params = self.params = params
        self.outer_state = self.outer_opt.init(params)
        self.inner_state = None if self.inner_opt is None else self.inner_opt.init(params)
        return self

    def _who(self) -> str:
        c = self.comm
        return f"peer {c.peer_id} (rank {c.rank}/{c.world_size}, outer step {self.outer_steps})"

    def _check_init(self) -> None:
        if self.global_params is None:
            raise RuntimeError(f"{self._who()}: DiLoCo.init(params) must be called first")

    def _global_and_outer(self) -> dict[str, np.ndarray]:
        return {**_keyed("global", self.global_params), **_keyed("outer", self.outer_state)}

    def shared_state(self) -> dict[str, np.ndarray]:
        """The shared state as a flat dict of host copies.

        Returns:
          θ_global and the outer state; when asynchronous also the average not yet applied
          (``pending…`` keys, zeros when there is none, and ``has_pending``), which first waits
          for the in-flight all-reduce.
        """
        self._check_init()
        state = self._global_and_outer()
        if self.asynchronous:
            average = None if self._pending is None else self._pending.result()
            state.update(_keyed("pending", jax.tree.map(jnp.zeros_like, self.global_params)
                                if average is None else average))
            state["has_pending"] = np.array([average is not None], np.int32)
        return state

    def state_hash(self) -> int:
        """Combined hash of θ_global and the outer state, equal on peers that agree; never waits."""
        self._check_init()
        return ss.combined_hash(ss.state_hashes(self._global_and_outer()))

    def _load_shared(self, state: dict[str, np.ndarray], fetched: list[str]) -> None:
        def changed(prefix):  # no prefix starts another: global, outer, pending, has_pending
            return any(k.startswith(prefix) for k in fetched)

        if changed("global"):
            self.global_params = _unkeyed("global", self.global_params, state)
        if changed("outer"):
            self.outer_state = _unkeyed("outer", self.outer_state, state)
        if changed("pending") or changed("has_pending"):
            self._pending = (PendingAverage.completed(_unkeyed("pending", self.global_params, state))
                             if state["has_pending"][0] else None)

    # --- membership and shared state -------------------------------------------------------------

    def _sync(self, strategy: str) -> None:
        state = self.shared_state()
        revision = 0 if self.revision is None else self.revision + 1
        info = self.comm.run_with_retry(self.comm.sync_shared_state, state, revision, strategy)
        if info.keys_fetched:
            log.info("%s: shared-state sync fetched %d keys (%d bytes)", self._who(), len(info.keys_fetched),
                     info.bytes_received)
            self._load_shared(state, info.keys_fetched)
        self.revision, self.last_sync = info.revision, info

    def begin_outer(self) -> None:
        """Starts an outer step: join or admit newcomers, sync the shared state when due, and
        reset θ_local ← θ_global. :meth:`step` calls it; custom loops call it before their inner
        steps (then update ``params`` themselves and call :meth:`outer_step`)."""
        self._check_init()
        if self._begun:
            return
        try:
            self._membership()
        except MasterUnavailable as e:
            self._rejoin(e)
            self._membership()  # now as a newcomer
        self.params = self.global_params
        self.inner_count = 0
        self._begun = True

    def _rejoin(self, err: MasterUnavailable) -> None:
        """Registers again with the service (see ``rejoin_s``); raises `err` when not allowed."""
        if not self.rejoin_s:
            raise err
        log.warning("%s: lost the coordination service (%s); registering again", self._who(), err)
        deadline = time.monotonic() + self.rejoin_s
        while True:
            try:
                self.comm.reconnect()
                break
            except MasterUnavailable:
                if time.monotonic() > deadline:
                    raise err from None
                time.sleep(0.5)
        self._pending = None  # the group finishes (or retried) it without this peer
        self.rejoins += 1

    def _membership(self) -> None:
        comm = self.comm
        strategy = None
        if not comm.accepted:  # a newcomer: blocks until the group votes it in
            (self.admit or comm.update_topology)()
            # alone, it founds the group and keeps its state; otherwise its stale state must not win
            strategy = "receive_only" if comm.world_size > 1 else "enforce_popular"
        elif self._peers_pending():
            if self._pending is not None:
                self._pending.result()  # finish over the current group: newcomers have no part in it
            comm.update_topology()
            strategy = "enforce_popular"
        elif self.revision is None or (self.sync_every and self.outer_steps % self.sync_every == 0):
            strategy = "enforce_popular"
        if strategy is not None:
            self._sync(strategy)

    def _peers_pending(self) -> bool:
        pending = self.comm.are_peers_pending()
        return pending if self.agree is None else bool(self.agree(pending))

    # --- training --------------------------------------------------------------------------------

    def inner_step(self, batch) -> jax.Array:
        """One step of the inner optimizer on θ_local (begins the outer step when due).

        Args:
          batch: passed to ``loss_fn(params, batch)``.

        Returns:
          The loss before the step.
        """
        if self.loss_fn is None or self.inner_opt is None:
            raise ValueError(f"{self._who()}: DiLoCo needs loss_fn and inner_opt for inner_step()/step(); "
                             f"custom loops update .params themselves")
        self.begin_outer()
        self.params, self.inner_state, loss = _inner_update(self.loss_fn, self.inner_opt, self.params,
                                                            self.inner_state, batch)
        self.inner_count += 1
        return loss

    def outer_step(self) -> None:
        """Ends the outer step: averages the pseudo-gradient and steps θ_global with it
        (asynchronous: applies the previous step's average and starts this one's), then
        θ_local ← θ_global."""
        if not self._begun:
            raise RuntimeError(f"{self._who()}: outer_step() without begin_outer() or inner steps")
        delta = pseudo_gradient(self.global_params, self.params)
        try:
            if self.asynchronous:  # finish the previous average before starting this one: they share tags
                average = None if self._pending is None else self._pending.result()
                self._pending = self.reducer.start(delta)  # runs during the next H inner steps
            else:
                average = self.reducer(delta)
        except MasterUnavailable as e:  # the group steps without this peer; it fetches the result
            self._rejoin(e)
            average = None
        if average is not None:
            self._apply_outer(average)
        self.params = self.global_params
        self.outer_steps += 1
        self._begun = False

    def _apply_outer(self, average: PyTree) -> None:
        # not jitted: op by op, the outer step gives the same bits on every peer and backend
        updates, self.outer_state = self.outer_opt.update(average, self.outer_state, self.global_params)
        self.global_params = optax.apply_updates(self.global_params, updates)

    def step(self, batch) -> jax.Array:
        """One inner step, and after every H-th also the outer step.

        Args:
          batch: passed to ``loss_fn(params, batch)``.

        Returns:
          The inner step's loss.
        """
        loss = self.inner_step(batch)
        if self.inner_count >= self.inner_steps:
            self.outer_step()
        return loss

    def flush(self) -> None:
        """Ends training. A partial round (fewer than H inner steps by :meth:`inner_step` /
        :meth:`step` since the last outer step, e.g. ``len(data) % H`` of them) gets its outer step,
        as DiLoCo's last round does: its pseudo-gradient is the difference accumulated over the
        inner steps that ran, so they reach θ_global instead of being dropped. Asynchronous: then
        applies the average still in flight. θ_local ← θ_global. Every peer calls it (a partial
        round all-reduces, so every peer must be in one). Custom loops end a partial round with
        :meth:`outer_step` themselves."""
        if self._begun and self.inner_count > 0:
            self.outer_step()
        if self._pending is not None:
            self._apply_outer(self._pending.result())
            self._pending = None
            self.params = self.global_params
