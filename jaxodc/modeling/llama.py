"""The Llama family (Llama 2 / 3, Mistral, Qwen2) as a flax linen model whose parameters are a
Hugging Face checkpoint's tensors one for one: the tree mirrors the tensor names
(`model.layers.3.self_attn.q_proj.weight` is params/model/layers_3/self_attn/q_proj/weight, see
`hf_name`) and every matrix keeps HF's [out, in] orientation, so a rank's flat range of a unit is
one contiguous byte range of the file (modeling.hf_load reads it, modeling.hf_export writes it).

Batch: the packed arrays of jaxodc.balance.packing (tokens, targets, segment_ids, positions,
loss_mask, each [B, T]), as models/llama.py takes them, so every trainer path runs it unchanged
(one unit per decoder layer, found by train.discover). `__call__` returns per-token losses
(cross entropy x loss_mask); `logits` and `token_logprobs` are the other outputs. No dtype is
pinned: the model computes in the dtype its parameters arrive in (fp32, or bf16 under the
trainers' mixed precision), softmax statistics in fp32.
"""
from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxodc.modeling.hf_config import HFConfig
from jaxodc.ops.attention import segment_attention

_INIT = nn.initializers.normal(0.02)


def inv_freq(cfg: HFConfig) -> np.ndarray:
    """RoPE inverse frequencies [head_dim / 2] (fp32), with Llama 3's scaling when configured
    (transformers' `_compute_llama3_parameters`)."""
    d = cfg.head_dim
    f = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_scaling:
        factor, low, high, old = cfg.rope_scaling
        low_wl, high_wl = old / low, old / high
        wl = 2 * np.pi / f
        scaled = np.where(wl > low_wl, f / factor, f)
        smooth = (old / wl - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wl < high_wl) & ~(wl > low_wl)
        f = np.where(medium, smoothed, scaled)
    return f.astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, freq: np.ndarray) -> jax.Array:
    """HF's rotary embedding (rotate_half) on x [B, T, H, Dh] at positions [B, T]."""
    ang = positions.astype(jnp.float32)[..., None, None] * jnp.asarray(freq)  # [B, T, 1, Dh/2]
    c, s = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


class Linear(nn.Module):
    """torch.nn.Linear's layout: weight [out, in], optional bias [out]."""

    features: int
    bias: bool = False

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", _INIT, (self.features, x.shape[-1]))
        y = jnp.einsum("...i,oi->...o", x, w)
        return y + self.param("bias", nn.initializers.zeros, (self.features,)) if self.bias else y


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return w * h.astype(x.dtype)


class Attention(nn.Module):
    cfg: HFConfig

    @nn.compact
    def __call__(self, x, segment_ids, positions):
        cfg = self.cfg
        B, T, _ = x.shape
        if cfg.sliding_window is not None and T > cfg.sliding_window:
            raise ValueError(f"rows of {T} tokens exceed the checkpoint's sliding_window {cfg.sliding_window}; "
                             f"sliding-window attention is not implemented (use --max-tokens <= the window)")
        H, K, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        freq = inv_freq(cfg)
        q = rope(Linear(H * D, cfg.qkv_bias, name="q_proj")(x).reshape(B, T, H, D), positions, freq)
        k = rope(Linear(K * D, cfg.qkv_bias, name="k_proj")(x).reshape(B, T, K, D), positions, freq)
        v = Linear(K * D, cfg.qkv_bias, name="v_proj")(x).reshape(B, T, K, D)
        k, v = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)  # grouped-query attention
        o = segment_attention(q, k, v, segment_ids, impl=cfg.attention)
        return Linear(cfg.hidden, cfg.o_bias, name="o_proj")(o.reshape(B, T, H * D))


class MLP(nn.Module):
    cfg: HFConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        gate = Linear(cfg.ffn, cfg.mlp_bias, name="gate_proj")(x)
        up = Linear(cfg.ffn, cfg.mlp_bias, name="up_proj")(x)
        return Linear(cfg.hidden, cfg.mlp_bias, name="down_proj")(jax.nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    cfg: HFConfig

    @nn.compact
    def __call__(self, x, segment_ids, positions):
        cfg = self.cfg
        x = x + Attention(cfg, name="self_attn")(RMSNorm(cfg.rms_eps, name="input_layernorm")(x), segment_ids, positions)
        return x + MLP(cfg, name="mlp")(RMSNorm(cfg.rms_eps, name="post_attention_layernorm")(x))


class Decoder(nn.Module):
    """HF's `model.*`: embed_tokens, layers, norm."""

    cfg: HFConfig

    @nn.compact
    def __call__(self, batch):
        cfg = self.cfg
        x = Embed(cfg, name="embed_tokens")(batch["tokens"])
        for i in range(cfg.layers):
            x = DecoderLayer(cfg, name=f"layers_{i}")(x, batch["segment_ids"], batch["positions"])
        return RMSNorm(cfg.rms_eps, name="norm")(x)


class Embed(nn.Module):
    cfg: HFConfig

    def setup(self):
        self.weight = self.param("weight", _INIT, (self.cfg.vocab, self.cfg.hidden))

    def __call__(self, tokens):
        return jnp.take(self.weight, tokens.astype(jnp.int32), axis=0)


class LlamaForCausalLM(nn.Module):
    """The causal LM (see the module docstring)."""

    cfg: HFConfig

    def setup(self):
        self.model = Decoder(self.cfg)
        if not self.cfg.tie_embeddings:
            self.lm_head = Linear(self.cfg.vocab, name="lm_head")

    def logits(self, batch) -> jax.Array:
        """[B, T, vocab] logits, in the compute dtype."""
        h = self.model(batch)
        if self.cfg.tie_embeddings:  # the head is the embedding matrix, HF's tie_word_embeddings
            return jnp.einsum("...i,vi->...v", h, self.model.variables["params"]["embed_tokens"]["weight"])
        return self.lm_head(h)

    def token_logprobs(self, batch) -> jax.Array:
        """[B, T] fp32 log-probability of each target token (unmasked)."""
        logp = jax.nn.log_softmax(self.logits(batch).astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(logp, batch["targets"][..., None].astype(jnp.int32), axis=-1)[..., 0]

    def __call__(self, batch) -> jax.Array:
        """[B, T] per-token losses: cross entropy x loss_mask."""
        return -self.token_logprobs(batch) * batch["loss_mask"]


def plain_batch(tokens) -> dict:
    """A batch of whole sequences [B, T] (one sample per row, positions from 0, every token's
    loss counted, the next token as target and the last one predicting token 0)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    return {"tokens": tokens, "targets": jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1),
            "segment_ids": jnp.ones((B, T), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
            "loss_mask": jnp.ones((B, T), jnp.float32)}


_LAYER = re.compile(r"(^|/)layers_(\d+)(/|$)")
_LAYER_HF = re.compile(r"(^|\.)layers\.(\d+)(\.|$)")


def hf_name(path: str) -> str:
    """The HF tensor name of a parameter path ("params/model/layers_3/mlp/up_proj/weight" ->
    "model.layers.3.mlp.up_proj.weight")."""
    p = path[len("params/"):] if path.startswith("params/") else path
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{m.group(2)}{m.group(3)}", p).replace("/", ".")


def param_path(name: str) -> str:
    """The parameter path of an HF tensor name (hf_name's inverse)."""
    return "params/" + _LAYER_HF.sub(lambda m: f"{m.group(1)}layers_{m.group(2)}{m.group(3)}", name).replace(".", "/")
