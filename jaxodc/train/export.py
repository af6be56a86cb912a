"""Export: the whole, unsharded parameters in the model's own structure, written as a Flax msgpack
file (`flax.serialization.to_bytes`) that plain Flax code loads without jaxodc::

    import flax.serialization
    with open("model.msgpack", "rb") as f:
        variables = flax.serialization.msgpack_restore(f.read())
    Llama(cfg).apply(variables, batch)           # a linen model: the `variables` dict apply takes

For the unit-staged LM (models/lm.py) the tree is its `{unit: params}` dict. Leaves are numpy
arrays (fp32, as the trainer keeps them; constants such as int leaves keep their dtype; typed PRNG
keys are stored as their raw key data, `jax.random.wrap_key_data` restores them). Next to the file,
`<path>.json` says what it holds for people (step, world, units, leaf shapes); loading needs only
the msgpack file.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import jax
import numpy as np

FORMAT = "flax.serialization msgpack (load: flax.serialization.msgpack_restore)"


def full_params(state) -> Any:
    """The full parameters (numpy leaves, the model's own structure) of a sharded trainer
    (`sharded_step(...).init(...)`), assembled from every rank's shards; collective."""
    mine = {n: np.asarray(x, np.float32).tobytes() for n, x in state.local_shards().items()}
    got = state.allgather_obj(mine)
    return state.program.unshard([{n: np.frombuffer(b, np.float32) for n, b in g.items()} for g in got],
                                 state.local_consts())


def export(state, path: str, metadata: Mapping | None = None) -> str:
    """Writes the full parameters of a sharded trainer to `path` (see the module docstring).

    Collective: every rank calls it (assembling the parameters gathers every rank's shards); rank 0
    writes, and if that fails every rank raises the same OSError naming the path.

    Args:
      state: the trainer (`sharded_step(...).init(...)`, or `Trainer.state`).
      path: the msgpack file to write (its directory is created); metadata goes to `path + ".json"`.
      metadata: extra JSON-able fields for the sidecar.

    Returns:
      The absolute path written.
    """
    params = full_params(state)
    error = ""
    if state.rank == 0:
        info = {"step": int(state.version), "world": int(state.world), "comm": state.comm,
                "units": list(state.layout.names), **dict(metadata or {})}
        try:
            write(params, path, info)
        except OSError as e:
            error = str(e)
        except Exception as e:  # e.g. a leaf msgpack cannot hold: the others must not wait for rank 0
            error = f"cannot write the export {os.path.abspath(path)}: {type(e).__name__}: {e}"
    errors = state.allgather_obj(error)  # every rank learns whether rank 0 wrote it
    if errors[0]:
        raise OSError(f"rank 0: {errors[0]}" if state.rank else errors[0])
    return os.path.abspath(path)


def write(params: Any, path: str, metadata: Mapping | None = None) -> str:
    """Writes `params` (any pytree of arrays) as Flax msgpack to `path` and a JSON sidecar; one
    process, atomic (a reader never sees a half-written file). Returns the absolute path."""
    path = os.path.abspath(path)
    host = jax.tree_util.tree_map(_host, params)
    keys = ["/".join(_key_name(k) for k in p) for p, x in jax.tree_util.tree_leaves_with_path(params) if _is_key(x)]
    import flax.serialization
    import flax.traverse_util
    state = flax.serialization.to_state_dict(host)  # what to_bytes writes: nested dicts, string keys
    data = flax.serialization.msgpack_serialize(state)
    leaves = flax.traverse_util.flatten_dict(state, sep="/") if isinstance(state, dict) else {"": state}
    info = {"format": FORMAT, **dict(metadata or {}),
            "parameters": int(sum(np.size(x) for x in leaves.values())), "bytes": len(data),
            "leaves": {p: f"{x.dtype}{list(x.shape)}" for p, x in leaves.items()}}
    if keys:
        info["prng_key_data"] = keys
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        for target, blob in ((path, data), (path + ".json", json.dumps(info, indent=1).encode())):
            with open(target + ".tmp", "wb") as f:
                f.write(blob)
            os.replace(target + ".tmp", target)
    except OSError as e:
        raise OSError(f"cannot write the export {path}: {e.strerror or e}") from e
    return path


def read(path: str) -> Any:
    """The parameter tree of an export (nested dicts of numpy arrays), as plain Flax reads it."""
    import flax.serialization
    try:
        with open(path, "rb") as f:
            return flax.serialization.msgpack_restore(f.read())
    except OSError as e:
        raise OSError(f"cannot read the export {path}: {e.strerror or e}") from e


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_name(k) -> str:
    """A path entry as Flax's state dict spells it (dict key, sequence index, attribute name)."""
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def _host(x):
    return np.asarray(jax.random.key_data(x) if _is_key(x) else x)
