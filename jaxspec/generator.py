"""The Python API: `Generator.from_pretrained(...).generate(...)` and `.stream(...)`."""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

from jaxspec.detokenize import IncrementalText
from jaxspec.models.loading import load
from jaxspec.program_store import enable_compilation_cache
from jaxspec.speculative import SpecConfig
from jaxspec.sampling import SamplingParams
from jaxspec.scheduler import Request, Scheduler


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list
    prompt_token_ids: list
    finish_reason: str
    logprobs: list | None = None
    top_logprobs: list | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    accept_lengths: list | None = None

    @property
    def mean_accept_length(self) -> float | None:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None


def text_of(tokenizer, req: Request) -> str:
    if tokenizer is None:  # token-id-only use (tests, embedded models without a tokenizer)
        return ""
    text = tokenizer.decode(req.output_ids, skip_special_tokens=True)
    if req.stop_text_len is not None:
        text = text[:req.stop_text_len]
    return text


def streamable_text(tokenizer, req: Request, reader: IncrementalText | None = None) -> str:
    """The part of the output text that can be sent now: while the request runs, hold back what a
    stop string could still cut and a trailing incomplete multi-byte character. reader: the
    caller's own IncrementalText (the engine thread keeps another), so that each update decodes
    only the new tokens."""
    if req.finished or reader is None or tokenizer is None:
        text = text_of(tokenizer, req)
    else:
        reader.update(req.output_ids[:])  # a copy: the engine thread appends to the list
        text = reader.text
    if req.finished:
        return text
    hold = max((len(s) for s in req.params.stop), default=1) - 1
    end = len(text) - hold
    if text.endswith("\ufffd"):
        end = min(end, len(text) - 1)
    return text[:max(end, 0)]


def encode_prompt(tokenizer, prompt: str | list[int] | list[dict]) -> list[int]:
    """Token ids of a string, a list of token ids, or chat messages [{'role', 'content'}, ...]."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"chat message must have string 'role' and 'content', got {m!r}")
        if tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; pass plain text")
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ValueError(f"prompt must be a string, a list of token ids or a list of chat messages, got {type(prompt).__name__}")


def _completion(tokenizer, req: Request) -> Completion:
    return Completion(
        text=text_of(tokenizer, req), token_ids=list(req.output_ids), prompt_token_ids=list(req.prompt_ids),
        finish_reason=req.finish_reason, logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        top_logprobs=list(req.top_logprobs) if req.params.logprobs else None,
        ttft_s=None if req.first_token_time is None else req.first_token_time - req.arrival,
        latency_s=None if req.finish_time is None else req.finish_time - req.arrival,
        accept_lengths=list(req.accept_lengths) or None)


class Generator:
    def __init__(self, model, tokenizer, tp_size: int = 1, **scheduler_kwargs):
        """tp_size: devices the model is split over (tensor parallel, sharding.py); the drafter's
        head, if any, is replicated on each."""
        mesh = None
        if tp_size > 1:
            from jaxspec import sharding
            mesh = sharding.tp_mesh(tp_size)
            if model.cfg.shard_groups != tp_size:
                from jaxspec.models.loading import shard_model
                model = shard_model(model, mesh)
            head = getattr(scheduler_kwargs.get("drafter"), "head", None)
            if head is not None:
                sharding.replicate(head, mesh)
        self.model, self.tokenizer = model, tokenizer
        self.scheduler = Scheduler(model, tokenizer, mesh=mesh, **scheduler_kwargs)

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype=None, speculative: SpecConfig | None = None,
                        tp_size: int = 1, **scheduler_kwargs) -> Generator:
        """name_or_path: a short name of an embedded model (e.g. 'smollm2-135m'), a .gguf file, or an
        HF directory. speculative: a `jaxspec.SpecConfig` (None = plain decoding). tp_size: devices
        to split the model over, its shards loaded straight onto them."""
        if scheduler_kwargs.get("jit", True):  # before anything compiles: JAX looks at it once
            enable_compilation_cache(scheduler_kwargs.get("compile_cache"))
        mesh = None
        if tp_size > 1:
            from jaxspec.sharding import tp_mesh
            mesh = tp_mesh(tp_size)
        model, tokenizer = load(name_or_path, dtype, mesh)
        drafter = speculative.build(model, name_or_path) if speculative is not None else None
        return cls(model, tokenizer, drafter=drafter, tp_size=tp_size, **scheduler_kwargs)

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """A string, a list of token ids, or chat messages [{'role', 'content'}, ...]."""
        return encode_prompt(self.tokenizer, prompt)

    # -- generation ------------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, on_update=None) -> Request:
        return self.scheduler.add(self.encode(prompt), params or SamplingParams(), on_update)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> Completion | list[Completion]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict))
        batch = [prompts] if single else list(prompts)
        plist = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"{len(plist)} sampling params for {len(batch)} prompts")
        encoded = [self.encode(p) for p in batch]  # validate everything before queueing anything
        reqs, group = [], object()  # (a closed batch: the auto policy weighs when its last request ends)
        try:
            for ids, p in zip(encoded, plist):
                reqs.append(self.scheduler.add(ids, dataclasses.replace(p)))
                reqs[-1].group = group
        except Exception:
            for r in reqs:
                self.scheduler.abort(r)
            raise
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(reqs), desc="generate")
        done = 0
        while any(not r.finished for r in reqs):
            self.scheduler.step()
            if bar is not None:
                now = sum(r.finished for r in reqs)
                bar.update(now - done)
                done = now
        if bar is not None:
            bar.close()
        out = [_completion(self.tokenizer, r) for r in reqs]
        return out[0] if single else out

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text pieces as tokens arrive (held back while a stop string or a multi-byte
        character may still be forming). Closing the iterator early aborts the request."""
        req = self.submit(prompt, params)
        sent = 0
        reader = IncrementalText(self.tokenizer)
        try:
            while True:
                if not req.finished:
                    self.scheduler.step()
                text = streamable_text(self.tokenizer, req, reader)
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
                if req.finished:
                    return
        finally:
            if not req.finished:
                self.scheduler.abort(req)
