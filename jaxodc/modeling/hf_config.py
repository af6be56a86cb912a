"""A Hugging Face `config.json` of the Llama family (Llama 2 / 3, Mistral, Qwen2 / 2.5) read into
`HFConfig`, the static description `modeling.llama` builds its model from, and written back out.

Anything the model cannot reproduce exactly is refused with the field that asks for it: another
architecture, an activation other than SiLU, a rope scaling other than Llama 3's, Qwen2's sliding
window when it is switched on. Mistral's `sliding_window` is kept: attention is exact for rows no
longer than the window, and the model refuses longer rows when traced.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from jaxodc.modeling.safetensors_io import CheckpointError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class HFConfig:
    """What the model needs of config.json (hashable: a linen module's attribute). `raw` is the
    file's JSON text, written back by the export with the dtype updated."""

    architecture: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rms_eps: float
    rope_theta: float
    rope_scaling: tuple = ()            # Llama 3's (factor, low_freq_factor, high_freq_factor, original_max), or ()
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    dtype: str = "float32"              # torch_dtype / dtype: the checkpoint's dtype
    raw: str = "{}"
    attention: str = "auto"             # segment_attention impl

    def to_json(self, dtype: str | None = None) -> dict:
        """config.json for an export whose tensors are in `dtype` (default: this one's)."""
        doc = json.loads(self.raw)
        doc["torch_dtype"] = dtype or self.dtype
        doc.pop("dtype", None)
        return doc


def _need(doc: dict, key: str, path: str, kind=int):
    if key not in doc or doc[key] is None:
        raise CheckpointError(f"{path}: field {key!r} is missing")
    try:
        return kind(doc[key])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: field {key!r} = {doc[key]!r} is not a {kind.__name__}") from e


def config_from_dict(doc: dict, path: str = "config.json") -> HFConfig:
    """The HFConfig of a parsed config.json (`path` names it in errors)."""
    archs = doc.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise CheckpointError(f"{path}: architectures {archs} (model_type {doc.get('model_type')!r}) is not supported; "
                              f"supported: {sorted(ARCHITECTURES)}")
    arch = known[0]
    family = ARCHITECTURES[arch]
    act = doc.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported (the Llama family uses 'silu')")
    hidden, heads = _need(doc, "hidden_size", path), _need(doc, "num_attention_heads", path)
    kv = int(doc.get("num_key_value_heads") or heads)
    head_dim = int(doc.get("head_dim") or hidden // heads)
    if heads % kv:
        raise CheckpointError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if head_dim % 2:
        raise CheckpointError(f"{path}: head_dim {head_dim} is odd; rotary embeddings need an even head size")
    scaling = ()
    rs = doc.get("rope_scaling")
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            try:
                scaling = (float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                           float(rs["original_max_position_embeddings"]))
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{path}: rope_scaling {rs!r} lacks a Llama 3 field ({e})") from e
        elif kind != "default":
            raise CheckpointError(f"{path}: rope_scaling type {kind!r} is not supported (only 'llama3')")
    window = None
    if family == "mistral":
        window = doc.get("sliding_window")
    elif family == "qwen2" and doc.get("use_sliding_window"):
        raise CheckpointError(f"{path}: use_sliding_window is true; sliding-window attention is not supported")
    attn_bias = bool(doc.get("attention_bias", False))
    dtype = str(doc.get("torch_dtype") or doc.get("dtype") or "float32")
    return HFConfig(arch, _need(doc, "vocab_size", path), hidden, _need(doc, "num_hidden_layers", path), heads, kv,
                    head_dim, _need(doc, "intermediate_size", path), float(doc.get("rms_norm_eps", 1e-6)),
                    float(doc.get("rope_theta", 10000.0)), scaling, bool(doc.get("tie_word_embeddings", False)),
                    qkv_bias=family == "qwen2" or attn_bias, o_bias=attn_bias, mlp_bias=bool(doc.get("mlp_bias", False)),
                    sliding_window=None if window is None else int(window), dtype=dtype,
                    raw=json.dumps(doc, sort_keys=True))


def read_config(directory: str) -> HFConfig:
    """The HFConfig of `directory`/config.json."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (a Hugging Face model directory holds config.json and "
                              f"*.safetensors)") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config_from_dict(doc, path)
