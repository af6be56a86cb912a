"""Small decoder-only LM (Flax linen) for packed byte-level sequences, written as a chain of units.

Units, in order: "embed", "block_0" ... "block_{L-1}", "head". Each unit is a separate linen module
applied with its own parameter subtree (`apply_unit`), so a sharded trainer can gather one unit's
parameters right before its stage and drop them after. Carry between units: hidden states
[B, T, d]. The "head" unit returns per-token losses (cross entropy x loss_mask, [B, T]); the
training loss is their sum divided by the global token count of the minibatch.

Attention is causal *within a packed sample only* (jaxodc.ops.segment_attention): token i attends
to token j iff j <= i and both lie in the same sample (a padding token, segment 0, sees only
itself). RoPE uses per-sample positions, so a packed sample computes exactly what it computes
alone. `LMConfig.attention` picks the implementation ("auto": the variable-length kernel on CPU,
the Pallas flash kernel on CUDA, both of whose cost follows the samples' lengths, not the row's)."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import flax.linen as nn

from jaxodc.ops.attention import IMPLS, segment_attention
from jaxodc.modeling.units import StagedModel


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    rope_base: float = 10000.0
    attention: str = "auto"  # segment_attention impl: "auto", "dense", "kernel" or "pallas"


def rope(x: jax.Array, pos: jax.Array, base: float) -> jax.Array:
    """Rotary embedding on the last dim of x [B, T, H, Dh] at positions pos [B, T]."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = pos.astype(jnp.float32)[..., None, None] * freq  # [B, T, 1, half]
    c, s = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)  # x's dtype (bf16 under mixed precision)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


class Embed(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens):
        return nn.Embed(self.cfg.vocab, self.cfg.d_model, embedding_init=nn.initializers.normal(0.02))(tokens)


class Block(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x, segment_ids, positions):
        cfg = self.cfg
        B, T, d = x.shape
        H, Dh = cfg.n_heads, d // cfg.n_heads
        init = nn.initializers.normal(0.02)
        h = nn.RMSNorm(name="attn_norm")(x)
        qkv = nn.Dense(3 * d, use_bias=False, kernel_init=init, name="qkv")(h).reshape(B, T, 3, H, Dh)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base)
        o = segment_attention(q, k, v, segment_ids, impl=cfg.attention).reshape(B, T, d)
        x = x + nn.Dense(d, use_bias=False, kernel_init=init, name="attn_out")(o)
        h = nn.RMSNorm(name="mlp_norm")(x)
        h = nn.Dense(cfg.mlp_ratio * d, kernel_init=init, name="up")(h)
        h = nn.Dense(d, kernel_init=init, name="down")(jax.nn.gelu(h))
        return x + h


class Head(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x, targets, loss_mask):
        x = nn.RMSNorm(name="norm")(x)
        logits = nn.Dense(self.cfg.vocab, use_bias=False, kernel_init=nn.initializers.normal(0.02), name="out")(x)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return nll * loss_mask


class LM(StagedModel):
    """Staged model: `unit_names`, `init(rng) -> {unit: params}`, `apply_unit(name, params, carry,
    batch) -> carry`; the last unit returns per-token losses. `batch` holds the packing arrays
    (tokens, targets, segment_ids, positions, loss_mask), each [B, T]."""

    def __init__(self, cfg: LMConfig = LMConfig()):
        if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
            raise ValueError(f"d_model={cfg.d_model} must split into n_heads={cfg.n_heads} heads of even size")
        if cfg.attention not in IMPLS:
            raise ValueError(f"attention={cfg.attention!r} must be one of {IMPLS}")
        self.cfg = cfg
        self.unit_names = ("embed",) + tuple(f"block_{i}" for i in range(cfg.n_layers)) + ("head",)
        self._embed, self._block, self._head = Embed(cfg), Block(cfg), Head(cfg)

    def init(self, rng: jax.Array, seq_len: int = 8) -> dict:
        # One jitted init: eager Flax init dispatches (and compiles) op by op, which is slow.
        out = jax.jit(self._init, static_argnums=1)(rng, seq_len)
        return {n: out[n] for n in self.unit_names}  # jit returns dicts key-sorted; keep unit order

    def _init(self, rng: jax.Array, seq_len: int) -> dict:
        ks = jax.random.split(rng, len(self.unit_names))
        tok = jnp.zeros((1, seq_len), jnp.int32)
        x = jnp.zeros((1, seq_len, self.cfg.d_model), jnp.float32)
        params = {"embed": self._embed.init(ks[0], tok)["params"]}
        for i in range(self.cfg.n_layers):
            params[f"block_{i}"] = self._block.init(ks[1 + i], x, tok, tok)["params"]
        params["head"] = self._head.init(ks[-1], x, tok, jnp.zeros((1, seq_len)))["params"]
        return params

    def apply_unit(self, name: str, params, carry, batch):
        if name == "embed":
            return self._embed.apply({"params": params}, batch["tokens"])
        if name == "head":
            return self._head.apply({"params": params}, carry, batch["targets"], batch["loss_mask"])
        return self._block.apply({"params": params}, carry, batch["segment_ids"], batch["positions"])
