"""Chat templates rendered as the Hugging Face ecosystem renders them (transformers'
apply_chat_template): jinja2's sandboxed environment with trim_blocks / lstrip_blocks and the
loop-controls extension, `raise_exception`, `strftime_now` and the non-escaping `tojson`, the
tokenizer's special tokens (bos_token, eos_token, ...) by name, and `{% generation %}` blocks.

`render_spans` also says which characters are the assistant's: the template's `{% generation %}`
blocks where it has them, else each assistant turn as the text that rendering the conversation up
to that turn adds after rendering it up to the turn before with the generation prompt -- so the
role header the generation prompt writes is not trained on, and the turn's end-of-turn marker is.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Sequence

ROLES = ("system", "user", "assistant", "tool")

# The ChatML conversation format (Qwen's, without its tool handling): for generated examples on
# tokenizers that have no template of their own (bytes).
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _environment():
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("chat templates need jinja2: pip install jinja2") from e

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records the block's character span."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(span_log=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            log = self.environment.span_log
            if log is not None:
                start = len("".join(log["blocks"]))
                log["spans"].append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template with the special tokens it sees.

    Args:
      source: the jinja template text.
      context: the names it sees besides `messages` and `add_generation_prompt` (the
        tokenizer's template_context(): bos_token, eos_token, ...).
    """

    def __init__(self, source: str, context: dict | None = None):
        import jinja2
        self.source = source
        self.context = dict(context or {})
        self.has_generation = bool(re.search(r"\{%-?\s*generation\s*-?%\}", source))
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text (transformers' apply_chat_template(..., tokenize=False))."""
        return self._generate(messages, add_generation_prompt, None)

    def _generate(self, messages, add_generation_prompt, log) -> str:
        import jinja2
        env = self._template.environment
        blocks = [] if log is None else log["blocks"]
        env.span_log = log
        try:
            for block in self._template.generate(messages=list(messages), tools=None, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **self.context):
                blocks.append(block)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected the conversation: {e}") from None
        finally:
            env.span_log = None
        return "".join(blocks)

    def _prompt(self, messages: Sequence[dict]) -> str:
        """What precedes the assistant's next turn: the messages with the generation prompt (an
        empty conversation the template may refuse: then nothing)."""
        if messages:
            return self.render(messages, add_generation_prompt=True)
        try:
            return self.render([], add_generation_prompt=True)
        except ValueError:
            return ""

    def render_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the [start, end) character spans of the assistant's text)."""
        if self.has_generation:
            log = {"blocks": [], "spans": []}
            text = self._generate(messages, False, log)
            return text, log["spans"]
        text = self.render(messages)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._prompt(messages[:k])
            upto = self.render(messages[:k + 1])
            if not (text.startswith(upto) and upto.startswith(before)):
                raise ValueError(f"the chat template renders message {k} (assistant) differently once later messages "
                                 "follow, so its tokens cannot be told apart by prefix; mark the assistant text with "
                                 "{% generation %} ... {% endgeneration %} in the template")
            spans.append((len(before), len(upto)))
        return text, spans
