"""The safetensors file format at the byte level: read a file's header, read any element range
of one tensor into a caller's buffer, and write a file whose header is fixed first and whose
tensors are then filled in place, range by range, by any number of writers.

Why not `safetensors.safe_open`: it memory-maps the file, and every page a rank touches stays in
its resident set until the file is closed, on top of the fp32 shard being filled; reading with
`readinto` straight into the shard (through a small staging buffer when the dtype changes) keeps a
rank's peak near its shard. Files written here are ordinary safetensors files (the header padded
to 8 bytes, tensors in offset order), which `safetensors` and Hugging Face's loaders read.

Format: 8 bytes little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the
data; offsets count from the end of the header.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Mapping, Sequence

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
          "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # config.json's torch_dtype -> ours
MAX_HEADER = 100 << 20          # the safetensors library's own bound on the header
STAGE_BYTES = 1 << 20           # staging buffer of a converting read (small: it stays in cache)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: `start` is its absolute byte offset in `file`."""

    name: str
    file: str
    dtype: str              # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str) -> tuple[dict[str, TensorEntry], dict]:
    """({name: TensorEntry}, metadata) of the safetensors file `path`, every entry checked against
    the file's size (a truncated file is named with the first tensor that lies past its end)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: header length {n} does not fit the file's {size} bytes "
                                      f"(truncated, or not a safetensors file)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: the header is not valid JSON ({e}); not a safetensors file?") from e
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    base, data = 8 + n, size - 8 - n
    out = {}
    for name, e in doc.items():
        try:
            dtype, shape, (b, end) = e["dtype"], tuple(int(d) for d in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {e!r}") from err
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, not one of {sorted(DTYPES)}")
        if any(d < 0 for d in shape) or not 0 <= b <= end or end - b != math.prod(shape) * DTYPES[dtype].itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} ({dtype}{list(shape)}) has data_offsets [{b}, {end}] "
                                  f"that do not hold it")
        if end > data:
            raise CheckpointError(f"{path}: tensor {name!r} ends at data byte {end} but the file holds only {data} "
                                  f"data bytes: the file is truncated")
        out[name] = TensorEntry(name, path, dtype, shape, base + b, end - b)
    return out, meta


def read_range(entry: TensorEntry, lo: int, hi: int, out: np.ndarray, f=None) -> None:
    """Elements [lo, hi) of the row-major flattened tensor into `out` (1-D, hi - lo elements,
    converted to out.dtype). `f`: an open binary file of entry.file to reuse."""
    if not 0 <= lo <= hi <= entry.numel or out.shape != (hi - lo,):
        raise ValueError(f"{entry.file}: tensor {entry.name!r}: elements [{lo}, {hi}) into a buffer of shape "
                         f"{out.shape} (the tensor has {entry.numel})")
    src = entry.np_dtype
    own = f is None
    try:
        if own:
            f = open(entry.file, "rb")
        f.seek(entry.start + lo * src.itemsize)
        if out.dtype == src and out.flags.c_contiguous:
            _read_exact(f, memoryview(out.view(np.uint8)), entry)
            return
        step = max(1, STAGE_BYTES // src.itemsize)
        stage = np.empty(min(step, hi - lo), src)
        # ml_dtypes' bf16 -> fp32 cast moves the bits (exact, NaN payloads kept) and measured
        # faster than a widening shift (0.14 vs 0.18 s per GB of fp32)
        for a in range(0, hi - lo, step):
            b = min(a + step, hi - lo)
            _read_exact(f, memoryview(stage[:b - a].view(np.uint8)), entry)
            out[a:b] = stage[:b - a]
    except OSError as e:
        raise CheckpointError(f"cannot read tensor {entry.name!r} from {entry.file}: {e.strerror or e}") from e
    finally:
        if own and f is not None:
            f.close()


def _read_exact(f, view: memoryview, entry: TensorEntry) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r}: the file ended early (truncated while "
                                  f"being read)")
        got += n


def layout_file(tensors: Sequence[tuple[str, str, tuple[int, ...]]],
                metadata: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """The header of a file holding `tensors` ((name, safetensors dtype, shape), in this order):
    (the 8-byte length + padded JSON, {name: (absolute start, nbytes)}, total file size)."""
    doc, off, spans = {}, 0, {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, dtype, shape in tensors:
        nb = math.prod(shape) * DTYPES[dtype].itemsize
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nb]}
        spans[name] = (off, nb)
        off += nb
    js = json.dumps(doc, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    head = struct.pack("<Q", len(js)) + js
    return head, {k: (len(head) + o, nb) for k, (o, nb) in spans.items()}, len(head) + off


def create_file(path: str, head: bytes, size: int) -> None:
    """Creates `path` at its full size with its header written; the data is filled in later."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def write_range(fd: int, start: int, lo: int, values: np.ndarray) -> None:
    """Writes `values` (already in the tensor's dtype) as elements [lo, lo + len) of the tensor
    whose bytes begin at `start` of the open file descriptor `fd`."""
    data = memoryview(np.ascontiguousarray(values).view(np.uint8))
    pos = start + lo * values.dtype.itemsize
    while len(data):
        n = os.pwrite(fd, data, pos)
        data, pos = data[n:], pos + n
