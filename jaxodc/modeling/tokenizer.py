"""Tokenizers: a Hugging Face `tokenizer.json` read with the `tokenizers` library (with its
`tokenizer_config.json`: special tokens and chat template), or jaxodc's byte-level one (the
examples' default, jaxodc.data). Both give token ids and, per token, the character span of the
text it came from -- what the loss masks are cut by (jaxodc.modeling.dataset)."""
from __future__ import annotations

import json
import os

import numpy as np

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A `tokenizer.json` (the `tokenizers` library) with its directory's tokenizer_config.json.

    Args:
      path: a directory holding tokenizer.json (and optionally tokenizer_config.json and
        chat_template.jinja), or the tokenizer.json file itself.
    """

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as e:
            raise ImportError("a tokenizer.json needs the tokenizers library: pip install tokenizers") from e
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file}: no tokenizer.json there (--tokenizer names its directory)")
        try:
            self._tok = _Tok.from_file(file)
        except Exception as e:
            raise ValueError(f"{file}: not a tokenizers tokenizer.json ({e})") from None
        self.path = file
        config = {}
        cfg_file = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            try:
                with open(cfg_file, encoding="utf-8") as fh:
                    config = json.load(fh)
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
        self.special_tokens = {k: _token_text(config.get(k)) for k in SPECIAL_NAMES}
        extra = config.get("additional_special_tokens") or []
        self.additional_special_tokens = [t for t in (_token_text(x) for x in extra) if t is not None]
        self.chat_template = _chat_template(config, directory, cfg_file)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.special_tokens["eos_token"])

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.special_tokens["bos_token"])

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """Token ids (int32) of `text`; `add_special_tokens` applies the tokenizer's post-processor
        (e.g. a leading BOS), as transformers' tokenizer(text) does."""
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """(ids, each token's [start, end) character span in `text`), no special tokens added
        (a rendered chat template carries its own)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, np.int32), [tuple(o) for o in enc.offsets]

    def template_context(self) -> dict:
        """The special tokens a chat template sees by name, as transformers passes them."""
        out = {k: v for k, v in self.special_tokens.items() if v is not None}
        out["additional_special_tokens"] = list(self.additional_special_tokens)
        return out


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (jaxodc.data.VOCAB); no special tokens; a chat template
    only when given one (e.g. chat.CHATML, for generated examples)."""

    vocab_size = 256
    eos_id = None
    bos_id = None
    path = "bytes"
    special_tokens = dict.fromkeys(SPECIAL_NAMES)

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        from jaxodc.data import encode
        return encode(text)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        spans = [(i, i + 1) for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8")))]
        return self.encode(text), spans

    def template_context(self) -> dict:
        return {}


def _chat_template(config: dict, directory: str, cfg_file: str) -> str | None:
    """The directory's chat template: chat_template.jinja, else tokenizer_config.json's
    "chat_template" (a string, or a list of {"name", "template"} whose "default" is used)."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            return fh.read()
    t = config.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"{cfg_file}: chat_template lists templates {sorted(map(str, named))} but none named 'default'")
    raise ValueError(f"{cfg_file}: chat_template must be a string or a list of named templates, got {type(t).__name__}")


def load_tokenizer(path: str | None):
    """`Tokenizer(path)`, or the byte-level tokenizer when `path` is None or "bytes"."""
    if path is None or path == "bytes":
        return ByteTokenizer()
    return Tokenizer(path)
