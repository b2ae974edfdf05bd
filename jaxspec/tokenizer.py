"""A GGUF model's tokenizer: HF `tokenizers` for the text, jinja2 for the chat template.

transformers is not needed for this: importing it took seconds of a start on the H100 host
(it scans the installed distributions and imports torch where torch is installed:
load_profile-*.json). The chat template renders as transformers renders it (sandboxed, blocks
trimmed, `raise_exception` and a `tojson` that keeps non-ASCII text).
"""
from __future__ import annotations

import datetime
import functools
import json


class ChatTokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer, chat_template: str | None = None, bos_token=None, eos_token=None,
                 unk_token=None, pad_token=None):
        self.backend, self.chat_template = tokenizer, chat_template
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.eos_token_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
        self.bos_token_id = None if bos_token is None else tokenizer.token_to_id(bos_token)

    def __len__(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True, **kwargs):
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        text = _compile(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
            eos_token=self.eos_token, unk_token=self.unk_token, pad_token=self.pad_token, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


@functools.cache
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)
