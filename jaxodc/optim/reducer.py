"""Averaging pseudo-gradient pytrees over the fault-tolerant communicator (see docs/diloco.md)."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc.comm.communicator import Communicator

PyTree = Any

__all__ = ["DEFAULT_TAG", "PendingAverage", "PseudoGradientReducer"]

DEFAULT_TAG = 0xD10C0  # all-reduce tag of pseudo-gradients; dtype group i uses DEFAULT_TAG + i


class _PackedLayout:
    """Where each leaf of a pytree sits in one flat host buffer per dtype (one all-reduce each)."""

    def __init__(self, tree: PyTree):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.dtypes: list[np.dtype] = []
        self.sizes: list[int] = []
        self.slots: list[tuple[int, int, int, tuple]] = []  # (dtype group, offset, size, shape) per leaf
        for path, leaf in flat:
            dtype, shape = np.dtype(leaf.dtype), tuple(np.shape(leaf))
            if dtype.kind != "f" and dtype.name != "bfloat16":
                raise TypeError(f"pseudo-gradient leaf {jax.tree_util.keystr(path)} has dtype {dtype}; "
                                f"DiLoCo averages floating-point parameters only")
            if dtype not in self.dtypes:
                self.dtypes.append(dtype)
                self.sizes.append(0)
            group = self.dtypes.index(dtype)
            size = math.prod(shape)
            self.slots.append((group, self.sizes[group], size, shape))
            self.sizes[group] += size

    def pack(self, tree: PyTree) -> list[np.ndarray]:
        bufs = [np.empty(n, dtype) for dtype, n in zip(self.dtypes, self.sizes)]  # the slots cover every element
        for leaf, (group, offset, size, _) in zip(jax.tree.leaves(tree), self.slots):
            bufs[group][offset:offset + size] = np.asarray(leaf).reshape(-1)
        return bufs

    def unpack(self, bufs: list[np.ndarray]) -> PyTree:
        leaves = [jnp.asarray(bufs[group][offset:offset + size].reshape(shape))
                  for group, offset, size, shape in self.slots]
        return jax.tree.unflatten(self.treedef, leaves)


def _wait_all(handles) -> list[np.ndarray]:
    """Results of all handles (each wait is bounded by the communicator's timeout); the first error
    is raised only after every handle finished, so none is left in flight."""
    out, error = [], None
    for handle in handles:
        try:
            out.append(handle.wait())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            error = error or e
    if error is not None:
        raise error
    return out


class PendingAverage:
    """An average that may still be in flight, as returned by :meth:`PseudoGradientReducer.start`.

    Args:
      finish: called once, by the first :meth:`result`; blocks until the average is known.
    """

    def __init__(self, finish: Callable[[], PyTree]):
        self._finish: Callable[[], PyTree] | None = finish
        self._average: PyTree = None

    @classmethod
    def completed(cls, average: PyTree) -> "PendingAverage":
        """An average already known (e.g. received by a newcomer through shared-state sync)."""
        return cls(lambda: average)

    def result(self) -> PyTree:
        """Blocks until the all-reduce completes (re-run over the survivors if a peer failed).

        Returns:
          The average pytree; every later call returns the same one without communicating.
        """
        if self._finish is not None:
            self._average = self._finish()
            self._finish = None
        return self._average


class PseudoGradientReducer:
    """Averages pytrees over the communicator's current group, retrying with the survivors.

    Leaves are packed into one host buffer per dtype and all-reduced with ``op="avg"``. When a peer
    fails mid-way the all-reduce aborts everywhere; the survivors re-form the ring and re-run it, so
    the average is over the peers that finished it. Every peer must make the same calls in the same
    order, and at most one average per reducer may be in flight (they share the tags).

    Args:
      comm: a connected :class:`~jaxodc.comm.Communicator`, accepted into its group.
      quantize: None, ``"uint8"`` or ``"uint16"``: shrinks the transfer; peers still end
        bit-identical.
      tag: all-reduce tag of the first dtype group (group i uses ``tag + i``).
      max_attempts: how many times one average is tried before the error is raised.

    Attributes:
      retries: all-reduces re-run after a failure, over the reducer's lifetime.
      worlds: the group size of every completed average, in order.

    Example:
      >>> reducer = PseudoGradientReducer(comm)
      >>> average = reducer(delta)             # blocking
      >>> pending = reducer.start(delta)       # overlapped with other work ...
      >>> average = pending.result()           # ... until needed
    """

    def __init__(self, comm: Communicator, *, quantize: str | None = None, tag: int = DEFAULT_TAG,
                 max_attempts: int = 20):
        self.comm = comm
        self.quantize = quantize
        self.tag = int(tag)
        self.max_attempts = int(max_attempts)
        self.retries = 0
        self.worlds: list[int] = []

    def __call__(self, tree: PyTree) -> PyTree:
        """Averages ``tree`` over the group, blocking.

        Args:
          tree: a pytree of floating-point arrays, the same structure on every peer.

        Returns:
          The average, bit-identical on every peer.
        """
        return self.start(tree).result()

    def start(self, tree: PyTree) -> PendingAverage:
        """Starts averaging ``tree`` in the background.

        Args:
          tree: a pytree of floating-point arrays, the same structure on every peer.

        Returns:
          A :class:`PendingAverage`; its ``result()`` must be called before this reducer starts
          another average.
        """
        layout = _PackedLayout(tree)
        inputs = layout.pack(tree)
        return PendingAverage(functools.partial(self._finish, layout, inputs, self._open(inputs)))

    def _open(self, bufs: list[np.ndarray]) -> list:
        return [self.comm.all_reduce_async(buf, op="avg", quantize=self.quantize, tag=self.tag + group)
                for group, buf in enumerate(bufs)]

    def _finish(self, layout: _PackedLayout, inputs: list[np.ndarray], handles: list) -> PyTree:
        attempts = 0

        def wait():  # the first attempt is the one start() opened; retries open new ones
            nonlocal attempts
            attempts += 1
            return _wait_all(handles if attempts == 1 else self._open(inputs))

        bufs = self.comm.run_with_retry(wait, max_attempts=self.max_attempts)
        self.retries += attempts - 1
        self.worlds.append(self.comm.world_size)
        return layout.unpack(bufs)
