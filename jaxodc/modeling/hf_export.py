"""Write a sharded trainer's parameters as a Hugging Face model directory (config.json,
safetensors shards, model.safetensors.index.json) in the checkpoint's dtype, rank by rank: every
rank computes the same file plan (names, headers, offsets) from the layout, rank 0 creates the
files at full size with their headers, then every rank writes the element ranges its own shards
hold straight to their places (modeling.shard_pieces; `os.pwrite`), so nothing is gathered and no
rank holds more than its shards. The ranks must share the export directory's filesystem (as they
share a checkpoint directory).

Values are cast from the fp32 masters to the dtype once, at the owner (bf16: round to nearest
even, as torch does), so loading the export gives back exactly the cast of the masters.
"""
from __future__ import annotations

import json
import os

import numpy as np

from jaxodc.modeling.hf_config import HFConfig
from jaxodc.modeling.hf_load import INDEX
from jaxodc.modeling.llama import hf_name
from jaxodc.modeling.safetensors_io import DTYPES, TORCH_DTYPES, create_file, layout_file, write_range
from jaxodc.modeling.shard_pieces import owned_pieces
from jaxodc.modeling.units import Layout

DEFAULT_SHARD_BYTES = 5 << 30   # transformers' default max_shard_size


def file_plan(layout: Layout, dtype: str, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[tuple[str, list]]:
    """[(file name, [(HF name, safetensors dtype, shape, unit, leaf)])]: the layout's tensors
    in unit order, cut into files of at most `max_shard_bytes` (a bigger tensor alone)."""
    st = TORCH_DTYPES[dtype]
    files, cur, size = [], [], 0
    for spec in layout.units:
        for j, (path, shape) in enumerate(zip(spec.paths, spec.shapes)):
            nb = int(np.prod(shape, dtype=np.int64)) * DTYPES[st].itemsize
            if cur and size + nb > max_shard_bytes:
                files.append(cur)
                cur, size = [], 0
            cur.append((hf_name(path), st, tuple(shape), spec.name, j))
            size += nb
    files.append(cur)
    n = len(files)
    if n == 1:  # one file keeps the plain name, which every loader (Flax's too) reads
        return [("model.safetensors", files[0])]
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", f) for i, f in enumerate(files)]


def export_hf(state, directory: str, config: HFConfig, dtype: str | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> str:
    """Writes the trainer `state`'s parameters to `directory` (see the module docstring);
    collective: every rank calls it. `dtype`: "bfloat16", "float16" or "float32" (default the
    checkpoint's, config.dtype). Returns the absolute directory. Every rank raises the same
    OSError if any rank failed to write."""
    directory = os.path.abspath(directory)
    dtype = dtype or config.dtype
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    plan = file_plan(state.layout, dtype, max_shard_bytes)
    heads = {fn: layout_file([t[:3] for t in ts], {"format": "pt"}) for fn, ts in plan}

    def agree(what: str, fn) -> None:
        err = ""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- every rank must learn of it, not wait forever
            err = f"rank {state.rank}: {what}: {type(e).__name__}: {e}"
        errors = [e for e in state.allgather_obj(err) if e]
        if errors:
            raise OSError(f"cannot export to {directory}: " + "; ".join(errors))

    def create():
        if state.rank == 0:
            os.makedirs(directory, exist_ok=True)
            for fn, (head, _, size) in heads.items():
                create_file(os.path.join(directory, fn), head, size)

    def fill():
        shards = state.local_shards()
        np_dtype = DTYPES[TORCH_DTYPES[dtype]]
        where = {(unit, leaf): (fn, name) for fn, ts in plan for name, _, _, unit, leaf in ts}
        fds = {}
        try:
            for spec in state.layout.units:
                local = shards[spec.name]
                for pc in owned_pieces(spec, state.rank):
                    fn, name = where[(spec.name, pc.leaf)]
                    if fn not in fds:
                        fds[fn] = os.open(os.path.join(directory, fn), os.O_WRONLY)
                    start = heads[fn][1][name][0]
                    write_range(fds[fn], start, pc.lo, local[pc.at:pc.at + pc.hi - pc.lo].astype(np_dtype))
        finally:
            for fd in fds.values():
                os.close(fd)

    def finish():
        if state.rank == 0:
            total = sum(nb for _, spans, _ in heads.values() for _, nb in spans.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: fn for fn, ts in plan for name, *_ in ts}}
            for target, doc in ((INDEX, index), ("config.json", config.to_json(dtype))):
                path = os.path.join(directory, target)
                with open(path + ".tmp", "w") as f:
                    json.dump(doc, f, indent=1, sort_keys=True)
                os.replace(path + ".tmp", path)

    agree("creating the files", create)
    agree("writing its shards", fill)
    agree("writing the index and config", finish)
    return directory
