"""Load a Hugging Face model directory of the Llama family (config.json + one `model.safetensors`
or shards named by `model.safetensors.index.json`) as a linen model (modeling.llama) and the
program the sharded trainers run, each rank reading from the files only the element ranges of
the units it owns (modeling.shard_pieces) straight into its fp32 master shards; no rank ever
holds the whole model. Every tensor is checked against the config before anything is read; a
bad checkpoint gets one CheckpointError naming the file and the tensor.

    ckpt = load_hf("Llama-3.2-1B/")
    tr = Trainer(ckpt.program(ctx.world, comm="odc", max_tokens=1024), optimizer,
                 params=ckpt.abstract_params(), ctx=ctx, comm="odc", max_tokens=1024)
    logits = ckpt.model.apply(ckpt.params(), plain_batch(tokens), method="logits")  # one process, whole
"""
from __future__ import annotations

import dataclasses
import glob
import json
import mmap
import os
import sys
import threading
from contextlib import ExitStack
from typing import Any, Callable, Mapping

import jax
import numpy as np

from jaxodc.modeling.hf_config import HFConfig, read_config
from jaxodc.modeling.llama import LlamaForCausalLM, hf_name, plain_batch
from jaxodc.modeling.safetensors_io import CheckpointError, TensorEntry, read_header, read_range
from jaxodc.modeling.shard_pieces import owned_pieces
from jaxodc.modeling.program import Program
from jaxodc.modeling.units import Layout, _path_str

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
# tensors some checkpoints carry that the model does not need (old Llama 2 conversions' rope buffers)
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
CHUNK = 4 << 20                 # elements per read job of read_shards (16 MiB of fp32)
MAX_THREADS = 8
# Linux >= 5.14 (Python 3.11's mmap does not name it)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


@dataclasses.dataclass(frozen=True)
class HFProgram(Program):
    """A Program whose shards come from a Hugging Face checkpoint (its `shard` ignores the
    params it is given and reads the rank's ranges); `hf_config` is what the export writes back."""

    hf_config: HFConfig | None = None


def index_tensors(directory: str) -> dict[str, TensorEntry]:
    """{tensor name: TensorEntry} of every safetensors file of `directory` (through its index
    when there is one)."""
    idx = os.path.join(directory, INDEX)
    out: dict[str, TensorEntry] = {}
    if os.path.exists(idx):
        try:
            with open(idx) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{idx}: not a safetensors index with a weight_map ({type(e).__name__}: {e})") from e
        by_file: dict[str, list[str]] = {}
        for name, fn in weight_map.items():
            by_file.setdefault(fn, []).append(name)
        for fn, names in sorted(by_file.items()):
            path = os.path.join(directory, fn)
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: missing; {idx} maps {len(names)} tensor(s) to it, e.g. {names[0]!r}")
            header, _ = read_header(path)
            for name in names:
                if name not in header:
                    raise CheckpointError(f"{path}: tensor {name!r} is mapped to this file by {idx} but the file "
                                          f"does not hold it")
                out[name] = header[name]
        return out
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors file (and no {INDEX})")
    for path in files:
        for name, e in read_header(path)[0].items():
            if name in out:
                raise CheckpointError(f"{path}: tensor {name!r} is also in {out[name].file}; without {INDEX} "
                                      f"every tensor must be in one file")
            out[name] = e
    return out


class HFCheckpoint:
    """A checked Hugging Face checkpoint directory (see the module docstring).

    Attributes:
      config: the HFConfig of config.json.
      model: the linen LlamaForCausalLM.
      tensors: {HF tensor name: TensorEntry} of the tensors the model uses.
    """

    def __init__(self, directory: str, attention: str = "auto"):
        self.directory = os.path.abspath(directory)
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"{self.directory}: not a directory (a Hugging Face model directory holds "
                                  f"config.json and *.safetensors)")
        self.config = dataclasses.replace(read_config(self.directory), attention=attention)
        self.model = LlamaForCausalLM(self.config)
        self._abstract = jax.eval_shape(self.model.init, jax.random.key(0), plain_batch(np.zeros((1, 1), np.int32)))
        self.tensors = self._check(index_tensors(self.directory))

    def _check(self, found: Mapping[str, TensorEntry]) -> dict[str, TensorEntry]:
        where = os.path.join(self.directory, "config.json")
        need = {}
        for p, leaf in jax.tree_util.tree_leaves_with_path(self._abstract):
            name = hf_name(_path_str(p))
            e = found.get(name)
            if e is None:
                raise CheckpointError(f"{self.directory}: tensor {name!r} ({list(leaf.shape)}) is missing: no "
                                      f"safetensors file holds it, and {where} ({self.config.architecture}) needs it")
            if e.shape != tuple(leaf.shape):
                raise CheckpointError(f"{e.file}: tensor {name!r} has shape {list(e.shape)}, {where} asks for "
                                      f"{list(leaf.shape)}")
            if e.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{e.file}: tensor {name!r} has dtype {e.dtype}, not a float type {FLOAT_DTYPES}")
            need[name] = e
        for name, e in found.items():
            tied_head = name == "lm_head.weight" and self.config.tie_embeddings
            if name not in need and not tied_head and not name.endswith(IGNORED_SUFFIXES):
                raise CheckpointError(f"{e.file}: tensor {name!r} is not a parameter of {self.config.architecture} "
                                      f"as {where} describes it")
        return need

    def abstract_params(self) -> Any:
        """The model's variables as jax.ShapeDtypeStruct (fp32): what the trainers take as `params`
        with `program()` (shapes only; the shards are read from the files)."""
        return self._abstract

    def entry(self, path: str) -> TensorEntry:
        """The tensor of parameter path `path`."""
        return self.tensors[hf_name(path)]

    def read_shards(self, layout: Layout, rank: int, threads: int | None = None) -> dict[str, np.ndarray]:
        """Rank `rank`'s fp32 shard of every unit of `layout` (units of this model's parameter
        paths), read range by range from the files by `threads` threads (default load_threads())."""
        jobs, at = [], 0
        for spec in layout.units:
            for pc in owned_pieces(spec, rank):  # in chunks, so threads share even one large tensor
                e = self.entry(spec.paths[pc.leaf])
                jobs += [(e, lo, min(lo + CHUNK, pc.hi), at + pc.at + lo - pc.lo) for lo in range(pc.lo, pc.hi, CHUNK)]
            at += spec.shard
        threads = max(1, min(threads or load_threads(), len(jobs)))
        whole, at, out = _Fresh(at, threads), 0, {}
        for spec in layout.units:
            out[spec.name], at = whole.array[at:at + spec.shard], at + spec.shard
        # readinto and numpy's conversion release the GIL; this thread takes the first share
        errors: list[BaseException] = []

        def share(k: int) -> None:
            try:
                _read_jobs(whole, jobs[k::threads])
            except BaseException as e:  # raised in the caller below
                errors.append(e)
        helpers = [threading.Thread(target=share, args=(k,), daemon=True) for k in range(1, threads)]
        for t in helpers:
            t.start()
        share(0)
        for t in helpers:
            t.join()
        if errors:
            raise errors[0]
        return out

    def params(self) -> Any:
        """The whole model's variables (numpy fp32), read in one process."""
        def leaf(p, s):
            e = self.entry(_path_str(p))
            out = np.empty(e.numel, np.float32)
            read_range(e, 0, e.numel, out)
            return out.reshape(s.shape)
        return jax.tree_util.tree_map_with_path(leaf, self._abstract)

    def program(self, world: int, *, comm: str = "odc", max_tokens: int | None = None, example_batch=None,
                loss: Callable | None = None, sharding: str | None = None, fields: tuple = (),
                **policy) -> HFProgram:
        """The program of this model for `world` ranks (sharded as `comm`'s trainer shards:
        per_leaf for "collective", contiguous for "odc"), whose `shard(_, rank)` reads the rank's
        ranges. `loss(apply, batch)` is linen_loss_fn's (default: the sum of the per-token
        losses; `apply(batch, method="token_logprobs")` gives log-probabilities); it is traced on
        `example_batch` or an empty packed microbatch of `max_tokens` carrying the per-token
        `fields` the loss reads (e.g. rl.task_fields: GRPO's advantages)."""
        from jaxodc.modeling.adapters import linen_loss_fn
        from jaxodc.modeling.program import traced_program
        if example_batch is None:
            if max_tokens is None:
                raise ValueError("program() needs max_tokens= (the packed row length) or example_batch=")
            from jaxodc.balance.packing import pack
            example_batch = pack([], int(max_tokens), fields=fields).as_dict()
        sharding = sharding or ("per_leaf" if comm == "collective" else "contiguous")
        loss_fn = linen_loss_fn(self.model, loss or (lambda apply, batch: apply(batch).sum()))
        prog = traced_program(loss_fn, self._abstract, example_batch, world, sharding=sharding, **policy)
        fields = {f.name: getattr(prog, f.name) for f in dataclasses.fields(prog)}
        fields["shard"] = lambda _params, rank: self.read_shards(prog.layout, rank)
        return HFProgram(**fields, hf_config=self.config)


def load_threads() -> int:
    """Threads for one rank's read_shards: this process's cores shared among the ranks of its
    host (JAXODC_LOCAL_WORLD_SIZE / LOCAL_WORLD_SIZE, as the launcher sets them), at most
    MAX_THREADS (beyond a few, memory bandwidth is the limit)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        local = int(os.environ.get("JAXODC_LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        local = 1
    return max(1, min(MAX_THREADS, cores // max(1, local)))


def _read_jobs(whole: _Fresh, jobs) -> None:
    """read_range over (entry, lo, hi, offset in whole) jobs, with this thread's own open files
    (a file object's seek + readinto is not safe to share between threads)."""
    with ExitStack() as stack:
        files: dict[str, Any] = {}
        for e, lo, hi, at in jobs:
            if e.file not in files:
                try:
                    files[e.file] = stack.enter_context(open(e.file, "rb"))
                except OSError as err:
                    raise CheckpointError(f"cannot read tensor {e.name!r} from {e.file}: "
                                          f"{err.strerror or err}") from err
            whole.populate(at, hi - lo)
            read_range(e, lo, hi, whole.array[at:at + hi - lo], files[e.file])


class _Fresh:
    """n zeroed fp32 elements (`array`) for read_shards to fill, their pages mapped ahead.
    Fresh memory is most of a load's cost here (a VM whose freed pages go back to the host, so
    a first touch is a host fault too): page fault by page fault it cost about three times the
    read, mapping the pages in one call (MAP_POPULATE) a fraction of that. With `threads` > 1
    each thread maps the pages of its own ranges (`populate`: MADV_POPULATE_WRITE, Linux >=
    5.14) just before filling them, so the mapping is spread over the threads too. Transparent
    huge pages measured slower (2 CPU s more for 2 GiB: the kernel zeroes whole 2 MiB pages
    taken from the blocks that went back to the host), so the mapping does not ask for them."""

    def __init__(self, n: int, threads: int = 1):
        flags, self._map = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, None
        if threads > 1:
            try:
                self._map = mmap.mmap(-1, max(4 * n, 1), flags=flags)
                self._map.madvise(MADV_POPULATE_WRITE, 0, mmap.PAGESIZE)  # EINVAL where unsupported
                self.array = np.frombuffer(self._map, np.float32, count=n)
                return
            except (OSError, ValueError, AttributeError, TypeError):
                self._map = None
        try:
            m = mmap.mmap(-1, max(4 * n, 1), flags=flags | getattr(mmap, "MAP_POPULATE", 0))
        except (OSError, ValueError, AttributeError):  # no anonymous mappings here: plain memory
            self.array = np.zeros(n, np.float32)
            return
        self.array = np.frombuffer(m, np.float32, count=n)

    def populate(self, at: int, n: int) -> None:
        """Maps the pages of elements [at, at + n) (a no-op where __init__ mapped them all)."""
        if self._map is not None and n > 0:
            lo = (4 * at) & ~(mmap.PAGESIZE - 1)
            self._map.madvise(MADV_POPULATE_WRITE, lo, 4 * (at + n) - lo)


def load_hf(directory: str, attention: str = "auto") -> HFCheckpoint:
    """The checked checkpoint of `directory` (nothing but the headers is read yet)."""
    return HFCheckpoint(directory, attention)
