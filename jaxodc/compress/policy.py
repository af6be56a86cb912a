"""Which parameters travel compressed, and how much.

TAGC's selective setting: the big non-attention matrices (MLP, embedding, LM head) are sparsified
and sent as an index bitmap + count sketch; attention, norms, biases and small leaves stay dense
(their exchange is cheap, and attention gradients lose most from sparsification). A
`Compression` names that choice and its two knobs:

- `fraction`: the kept fraction of every compressed slice (exact top-|g| selection, error
  feedback carries the rest to the next push of the same slice);
- `ratio`: how many times fewer bytes the count sketch holds than the slice sent densely in fp32
  (3 rows x width buckets = n / ratio); the bitmap adds n / 8 bytes. Peeling recovers every kept
  value while the sketch's 3 * width buckets are about 1.23 x the kept count or more (the 3-row
  peeling threshold): ratio <= about 0.8 / fraction. Above that, what does not peel is estimated.
  ODC's owner peels every push alone, so this is the sketch it sends. The collective sums W
  senders' sketches before peeling: there the sketch is widened to peel the union of their
  supports, up to W x the kept count (compress.collective.UnitExchange.width), and the ratio is a
  floor on its width.

`Compression.plan(layout)` resolves the predicate against a trainer's unit layout into a
`CompressionPlan`: per unit, the (offset, size) pieces of its flat vector that travel compressed.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the trainers' layouts, only described here: compress sits below train
    from jaxodc.modeling.units import Layout


# Path components that mark attention parameters (TAGC keeps them dense).
_ATTENTION = re.compile(r"(^|[/_.])(attn|attention|self_attn|qkv|query|key|value|[qkvo]_proj|w[qkvo])($|[/_.0-9])",
                        re.IGNORECASE)

Predicate = Callable[[str, tuple], bool]


def default_selects(path: str, shape: tuple, min_elems: int) -> bool:
    """TAGC's selective default: matrices (ndim >= 2) of at least `min_elems` elements whose path
    names no attention part."""
    return len(shape) >= 2 and math.prod(shape) >= min_elems and not _ATTENTION.search(path)


@dataclass(frozen=True)
class CompressionPlan:
    """The resolved policy: per unit name, the (offset, size) leaf pieces of its flat vector that
    travel compressed (possibly none), plus the knobs."""

    fraction: float
    ratio: float
    seed: int
    pieces: dict = field(default_factory=dict)  # unit name -> tuple[(offset, size), ...]
    paths: tuple = ()                            # "unit/leaf" of every selected leaf

    def selected(self, unit: str) -> tuple:
        return self.pieces.get(unit, ())

    def selected_elems(self) -> int:
        return sum(n for ps in self.pieces.values() for _, n in ps)

    def describe(self) -> dict:
        """What every rank must agree on (compared across ranks by the trainers)."""
        return {"fraction": self.fraction, "ratio": self.ratio, "seed": self.seed,
                "pieces": {u: [list(p) for p in ps] for u, ps in sorted(self.pieces.items())}}


@dataclass(frozen=True)
class Compression:
    """A compression setting (see the module docstring).

    Args:
      fraction: kept fraction per compressed slice, in (0, 1].
      ratio: dense fp32 bytes / sketch bytes, > 1.
      select: predicate (path "unit/leaf/...", shape) -> compress it; default: TAGC's selective
        setting (`default_selects` with `min_elems`).
      min_elems: the default predicate's size floor.
      seed: the sketch's hash seed.
      name: how records and logs name the setting.
    """

    fraction: float = 0.05
    ratio: float = 10.0
    select: Predicate | None = None
    min_elems: int = 16384
    seed: int = 0
    name: str = "default"

    def __post_init__(self):
        if not (isinstance(self.fraction, (int, float)) and 0.0 < self.fraction <= 1.0):
            raise ValueError(f"compression {self.name!r}: fraction must be in (0, 1], got {self.fraction!r}")
        if not (isinstance(self.ratio, (int, float)) and self.ratio > 1.0):
            raise ValueError(f"compression {self.name!r}: ratio must be > 1 (dense bytes / sketch bytes), "
                             f"got {self.ratio!r}")
        if self.min_elems < 1:
            raise ValueError(f"compression {self.name!r}: min_elems must be >= 1, got {self.min_elems}")

    def selects(self, path: str, shape: tuple) -> bool:
        if self.select is not None:
            return bool(self.select(path, tuple(shape)))
        return default_selects(path, tuple(shape), self.min_elems)

    def plan(self, layout: Layout) -> CompressionPlan:
        """Resolves the predicate on every leaf of `layout`; refuses a predicate that matches
        nothing (naming the parameters it saw)."""
        pieces, paths, seen = {}, [], []
        for u in layout.units:
            mine = []
            for path, shape, (offset, size) in zip(u.paths, u.shapes, u.leaf_pieces()):
                full = f"{u.name}/{path}"
                seen.append(f"{full}{list(shape)}")
                if size > 0 and self.selects(full, shape):
                    mine.append((offset, size))
                    paths.append(full)
            if mine:
                pieces[u.name] = tuple(mine)
        if not pieces:
            shown = ", ".join(seen[:12]) + (", ..." if len(seen) > 12 else "")
            raise ValueError(f"compression {self.name!r}: its predicate selects no parameter of the model "
                             f"(parameters: {shown})")
        return CompressionPlan(float(self.fraction), float(self.ratio), int(self.seed), pieces, tuple(paths))


def setting_of(plan: CompressionPlan | None) -> dict:
    """What ranks compare before training (trainers' check_same): compression off, or the plan."""
    return {"compression": "off"} if plan is None else {"compression": "on", **plan.describe()}


def tracking_plan(layout: Layout) -> CompressionPlan | None:
    """The default setting's plan, for counting in an uncompressed run the bytes that setting would
    compress (records' `wire_bytes_selected`); None when it selects nothing of this model."""
    try:
        return Compression().plan(layout)
    except ValueError:
        return None


def parse_compression(spec: str | None) -> Compression | None:
    """`--compress` values: "none" (or None / ""), "default", or "key=value,..." over fraction,
    ratio, min_elems, seed (the default predicate), e.g. "fraction=0.02,ratio=20"."""
    if spec is None or spec in ("", "none"):
        return None
    if spec == "default":
        return Compression()
    kwargs = {}
    for part in spec.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in ("fraction", "ratio", "min_elems", "seed"):
            raise ValueError(f"--compress {spec!r}: expected 'none', 'default' or key=value pairs over "
                             f"fraction, ratio, min_elems, seed; got {part!r}")
        try:
            kwargs[key] = int(value) if key in ("min_elems", "seed") else float(value)
        except ValueError:
            raise ValueError(f"--compress {spec!r}: {key} must be a number, got {value!r}") from None
    return Compression(name=spec, **kwargs)
