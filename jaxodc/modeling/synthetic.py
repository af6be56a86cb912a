"""Write a random Hugging Face checkpoint directory of the Llama family (config.json, safetensors
shards and their index, written with the `safetensors` library itself), for tests, benchmarks
and the README's copy-paste run; nothing is downloaded.

    python -m jaxodc.modeling.synthetic DIR [--family llama|mistral|qwen2] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import numpy as np

from jaxodc.modeling.safetensors_io import DTYPES, TORCH_DTYPES
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def tiny_config(family: str = "llama", *, vocab: int = 96, hidden: int = 32, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, ffn: int = 48, tie: bool = False, rope_theta: float = 10000.0,
                llama3_scaling: bool = False, dtype: str = "float32", **extra) -> dict:
    """A config.json of `family` (transformers' field names)."""
    doc: dict[str, Any] = {
        "architectures": [FAMILIES[family]], "model_type": family, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": rope_theta,
        "tie_word_embeddings": tie, "max_position_embeddings": 256, "torch_dtype": dtype,
        "bos_token_id": 1, "eos_token_id": 2}
    if llama3_scaling:
        doc["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}
    if family == "mistral":
        doc["sliding_window"] = None
    if family == "qwen2":
        doc["use_sliding_window"] = False
    doc.update(extra)
    return doc


def tensor_shapes(doc: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor of the config's model, in the order HF writes them."""
    h, f, L = doc["hidden_size"], doc["intermediate_size"], doc["num_hidden_layers"]
    H = doc["num_attention_heads"]
    K = doc.get("num_key_value_heads") or H
    D = doc.get("head_dim") or h // H
    qkv_bias = doc["architectures"][0] == "Qwen2ForCausalLM" or doc.get("attention_bias", False)
    out = [("model.embed_tokens.weight", (doc["vocab_size"], h))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,))]
        for n, rows in (("q", H * D), ("k", K * D), ("v", K * D)):
            out.append((p + f"self_attn.{n}_proj.weight", (rows, h)))
            if qkv_bias:
                out.append((p + f"self_attn.{n}_proj.bias", (rows,)))
        out.append((p + "self_attn.o_proj.weight", (h, H * D)))
        if doc.get("attention_bias", False):
            out.append((p + "self_attn.o_proj.bias", (h,)))
        out += [(p + "post_attention_layernorm.weight", (h,)), (p + "mlp.gate_proj.weight", (f, h)),
                (p + "mlp.up_proj.weight", (f, h)), (p + "mlp.down_proj.weight", (h, f))]
    out.append(("model.norm.weight", (h,)))
    if not doc.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (doc["vocab_size"], h)))
    return out


def write_checkpoint(directory: str, doc: dict, *, seed: int = 0, max_shard_bytes: int = 5 << 30,
                     scale: float = 0.5) -> None:
    """Writes config.json and random tensors (in doc["torch_dtype"]) to `directory`: one
    model.safetensors, or shards plus model.safetensors.index.json when they exceed
    `max_shard_bytes`, one shard in memory at a time. Norm weights are drawn around 1."""
    import safetensors.numpy
    dtype = DTYPES[TORCH_DTYPES[doc.get("torch_dtype", "float32")]]
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(doc, f, indent=1)
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(doc)
    groups, cur, size = [], [], 0
    for name, shp in shapes:
        nb = math.prod(shp) * dtype.itemsize
        if cur and size + nb > max_shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append((name, shp))
        size += nb
    groups.append(cur)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for fn, group in zip(names, groups):
        tensors = {}
        for name, shp in group:
            x = rng.standard_normal(shp, dtype=np.float32) * np.float32(scale / math.sqrt(shp[-1]))
            if name.endswith("norm.weight"):
                x = 1 + x
            tensors[name] = x.astype(dtype)
            weight_map[name] = fn
            total += tensors[name].nbytes
        safetensors.numpy.save_file(tensors, os.path.join(directory, fn), metadata={"format": "pt"})
        del tensors
    if len(groups) > 1:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxodc.modeling.synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    p.add_argument("--dtype", default="bfloat16", choices=sorted(TORCH_DTYPES))
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    write_checkpoint(a.directory, tiny_config(a.family, vocab=a.vocab, hidden=a.hidden, layers=a.layers,
                                              ffn=2 * a.hidden, dtype=a.dtype), seed=a.seed)
    print(a.directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
