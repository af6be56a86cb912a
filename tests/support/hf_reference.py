"""A numpy float64 forward pass of Hugging Face's Llama / Mistral / Qwen2 causal LMs (the PyTorch
modeling code's math: RMSNorm, rotate-half RoPE with rope_theta and Llama 3's rope scaling,
grouped-query causal attention, q/k/v biases, SwiGLU, tied or untied head), written from the
transformers sources independently of jaxodc.modeling, over the checkpoint's tensors by name."""
import math

import numpy as np


def llama3_inv_freq(inv_freq, rs):
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def logits(config: dict, tensors: dict, tokens: np.ndarray) -> np.ndarray:
    """[B, T, vocab] logits of `tokens` [B, T] (positions 0..T-1, causal attention)."""
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    H, h = config["num_attention_heads"], config["hidden_size"]
    K = config.get("num_key_value_heads") or H
    D = config.get("head_dim") or h // H
    eps = config.get("rms_norm_eps", 1e-6)
    qwen = config["architectures"][0] == "Qwen2ForCausalLM"
    B, T = tokens.shape
    inv = 1.0 / config.get("rope_theta", 10000.0) ** (np.arange(0, D, 2) / D)
    rs = config.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        inv = llama3_inv_freq(inv, rs)
    ang = np.arange(T)[:, None] * inv[None]            # [T, D/2]
    emb = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(emb), np.sin(emb)

    def rot(x):  # x [B, n, T, D]
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    def norm(x, w):
        return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))

    def lin(x, name, bias=False):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if bias else y

    x = t["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = norm(x, t[p + "input_layernorm.weight"])
        bias = qwen or config.get("attention_bias", False)
        q = lin(a, p + "self_attn.q_proj", bias).reshape(B, T, H, D).transpose(0, 2, 1, 3)
        k = lin(a, p + "self_attn.k_proj", bias).reshape(B, T, K, D).transpose(0, 2, 1, 3)
        v = lin(a, p + "self_attn.v_proj", bias).reshape(B, T, K, D).transpose(0, 2, 1, 3)
        q, k = rot(q), rot(k)
        k, v = np.repeat(k, H // K, 1), np.repeat(v, H // K, 1)
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        x = x + lin(o.transpose(0, 2, 1, 3).reshape(B, T, H * D), p + "self_attn.o_proj",
                    config.get("attention_bias", False))
        m = norm(x, t[p + "post_attention_layernorm.weight"])
        g = lin(m, p + "mlp.gate_proj")
        x = x + lin(g / (1 + np.exp(-g)) * lin(m, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = norm(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else t["lm_head.weight"]
    return x @ head.T
