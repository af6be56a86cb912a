"""A tiny Hugging Face tokenizer directory written in-process (no download): a byte-level BPE
trained with the `tokenizers` library on a few sentences, its tokenizer_config.json with special
tokens and a chat template."""
from __future__ import annotations

import json
import os

from jaxodc.modeling.chat import CHATML  # noqa: F401 (the tests' plain template)

# The same conversation format with the assistant's text in {% generation %} blocks (what
# transformers' return_assistant_tokens_mask needs); system messages checked with raise_exception.
CHATML_GENERATION = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}{{ raise_exception('system message must come first') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
          "assistant user system tool: answer the question", "1 + 1 = 2 and 2 + 2 = 4; ünïcödé text too",
          "Paris is the capital of France.", "def f(x):\n    return x * 2\n"] * 20


def write_tokenizer(directory: str, template: str | None = CHATML, bos: bool = True) -> str:
    """Writes tokenizer.json and tokenizer_config.json into `directory`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    os.makedirs(directory, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", bos_id)])
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
                                                        "rstrip": False, "single_word": False, "special": True}, "pad_token": "<pad>",
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    if template is not None:
        config["chat_template"] = template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        json.dump(config, fh)
    return directory


def write_jsonl(path: str, records) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return path
