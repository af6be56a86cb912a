"""Mixed precision, as FSDP2's `MixedPrecisionPolicy` has it: fp32 master shards and optimizer
state; units gathered and computed in `param_dtype`; gradients pushed (ODC) in it, or
reduce-scattered (collective) in `reduce_dtype`, and accumulated in fp32 by their owners; the
microbatch's floating inputs cast to `param_dtype` (FSDP2's `cast_forward_inputs`).

Trainers take `precision=` as a policy or its short name: "fp32" (no mixed precision), "bf16"
(bf16 gathers, pushes and inputs), or a spec such as "bf16,reduce=fp32,keep_inputs" (what
`jaxodc train --precision` accepts; `str(policy)` writes it back).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@dataclass(frozen=True)
class MixedPrecision:
    """Attributes:
      param_dtype: "bf16" or "fp32": units are gathered and computed in it.
      reduce_dtype: "bf16" or "fp32" (None: `param_dtype`): the dtype the collective's
        reduce-scatter sums the ranks' gradients in; "fp32" sends twice the bytes and rounds no
        partial sum. ODC ignores it: a bf16 unit's cotangent is bf16, its pushes carry it exactly,
        and the owners sum in fp32 whatever it is -- what reduce_dtype="fp32" buys FSDP2 already.
      cast_inputs: cast the batch's floating leaves (images, features, masks) to `param_dtype`.
        Without it a float input promotes every layer it meets back to fp32 (flax computes in the
        promoted dtype of input and kernel), so bf16 would only round the weights. Keep it off
        when the batch carries float values the loss needs at full precision (e.g. RL advantages)
        and cast the model's inputs yourself. Integer leaves are never cast.
    """

    param_dtype: str = "bf16"
    reduce_dtype: str | None = None
    cast_inputs: bool = True

    def __post_init__(self):
        for field, value in (("param_dtype", self.param_dtype), ("reduce_dtype", self.reduce_dtype)):
            if value is not None and value not in DTYPES:
                raise ValueError(f"MixedPrecision.{field} must be one of {sorted(DTYPES)}, got {value!r}")
        if self.reduce_dtype == self.param_dtype:  # one spelling per policy: ranks compare str(policy)
            object.__setattr__(self, "reduce_dtype", None)

    @property
    def compute_dtype(self):
        return DTYPES[self.param_dtype]

    @property
    def grad_dtype(self):
        return DTYPES[self.reduce_dtype or self.param_dtype]

    def __str__(self) -> str:
        parts = [self.param_dtype]
        if self.reduce_dtype not in (None, self.param_dtype):
            parts.append(f"reduce={self.reduce_dtype}")
        if not self.cast_inputs and self.param_dtype != "fp32":
            parts.append("keep_inputs")
        return ",".join(parts)


def precision_of(precision: str | MixedPrecision) -> MixedPrecision:
    """The policy a trainer's `precision=` names (see the module docstring)."""
    if isinstance(precision, MixedPrecision):
        return precision
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a str or MixedPrecision, got {type(precision).__name__}")
    head, *rest = [p.strip() for p in precision.split(",")]
    if head not in DTYPES:
        raise ValueError(f"precision must start with one of {sorted(DTYPES)}, got {precision!r}")
    kw = {}
    for part in rest:
        if part == "keep_inputs":
            kw["cast_inputs"] = False
        elif part.startswith("reduce="):
            kw["reduce_dtype"] = part[len("reduce="):]
        else:
            raise ValueError(f"precision {precision!r}: unknown part {part!r} (reduce=fp32|bf16, keep_inputs)")
    return MixedPrecision(head, **kw)


def compute_dtype_of(precision: str | MixedPrecision):
    """The dtype units are gathered and computed in under `precision`."""
    return precision_of(precision).compute_dtype


def cast_inputs(batch, compute_dtype):
    """The microbatch as the loss sees it: its floating leaves in `compute_dtype` (a no-op for
    fp32); integer leaves (tokens, labels, positions) as they are."""
    if jnp.dtype(compute_dtype) == jnp.float32:
        return batch
    return jax.tree_util.tree_map(
        lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, batch)
