"""A decoder LM written the usual Flax linen way, not in the unit protocol: RMSNorm, rotary
positions, SwiGLU MLP, grouped-query attention, layers stacked with `nn.scan` (optionally under
`nn.remat`), an optional tied embedding / LM head and dropout. jaxodc trains it unchanged through
jaxodc.modeling.adapters.linen_loss_fn + discover + gather_on_use (units found from the parameter tree,
the scan-stacked layers sliced per layer).

Batch: the packing arrays of jaxodc.balance.packing (tokens, targets, segment_ids, positions,
loss_mask, each [B, T]); `Llama.__call__` returns per-token losses (cross entropy x loss_mask).
"""
from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxodc.ops.attention import segment_attention
from jaxodc.models.lm import rope


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 128
    rope_base: float = 10000.0
    dropout: float = 0.0
    tie_embeddings: bool = False
    scan_axis: int = 0          # where nn.scan stacks the layers' parameters (MaxText uses 1)
    remat: bool = True
    attention: str = "dense"    # segment_attention impl


class Attention(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x, segment_ids, positions):
        cfg = self.cfg
        B, T, d = x.shape
        Dh = d // cfg.n_heads
        dense = lambda n, name: nn.DenseGeneral((n, Dh), use_bias=False, name=name,
                                                kernel_init=nn.initializers.normal(0.02))
        q = rope(dense(cfg.n_heads, "q")(x), positions, cfg.rope_base)
        k = rope(dense(cfg.n_kv_heads, "k")(x), positions, cfg.rope_base)
        v = dense(cfg.n_kv_heads, "v")(x)
        group = cfg.n_heads // cfg.n_kv_heads  # grouped-query: each kv head serves `group` q heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        o = segment_attention(q, k, v, segment_ids, impl=cfg.attention)
        return nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, name="o",
                               kernel_init=nn.initializers.normal(0.02))(o)


class SwiGLU(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(0.02)
        gate = nn.Dense(self.cfg.ffn, use_bias=False, kernel_init=init, name="gate")(x)
        up = nn.Dense(self.cfg.ffn, use_bias=False, kernel_init=init, name="up")(x)
        return nn.Dense(x.shape[-1], use_bias=False, kernel_init=init, name="down")(jax.nn.silu(gate) * up)


class Layer(nn.Module):
    cfg: LlamaConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, segment_ids, positions):
        drop = nn.Dropout(self.cfg.dropout, deterministic=self.deterministic or self.cfg.dropout == 0)
        x = x + drop(Attention(self.cfg, name="attn")(nn.RMSNorm(name="attn_norm")(x), segment_ids, positions))
        x = x + drop(SwiGLU(self.cfg, name="mlp")(nn.RMSNorm(name="mlp_norm")(x)))
        return x, None


class Llama(nn.Module):
    cfg: LlamaConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, batch):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=nn.initializers.normal(0.02), name="embed")
        x = embed(batch["tokens"])
        layer = nn.remat(Layer) if cfg.remat else Layer
        stack = nn.scan(layer, variable_axes={"params": cfg.scan_axis}, split_rngs={"params": True, "dropout": True},
                        in_axes=(nn.broadcast, nn.broadcast), length=cfg.n_layers)
        x, _ = stack(cfg, self.deterministic, name="layers")(x, batch["segment_ids"], batch["positions"])
        x = nn.RMSNorm(name="final_norm")(x)
        if cfg.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(cfg.vocab, use_bias=False, kernel_init=nn.initializers.normal(0.02), name="head")(x)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None].astype(jnp.int32), axis=-1)[..., 0]
        return nll * batch["loss_mask"]
