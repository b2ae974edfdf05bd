"""The OpenAI API's request bodies (pydantic: a malformed field is a 400 naming it), their
sampling parameters, and the pieces of a response (choices, logprobs, usage)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, field_validator, model_validator

from jaxspec.sampling import SamplingParams


MAX_STOPS = 64  # each is matched against every step's new text


class StreamOptions(BaseModel):
    """OpenAI's stream_options; continuous_usage_stats (vLLM's): every chunk carries the counts so far,
    so a client can tell how many tokens each chunk brought. Other keys (OpenAI adds some, e.g.
    include_obfuscation) are ignored, as the body's unknown fields are."""
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class SamplingFields(BaseModel):
    """The fields a completion and a chat request share."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = 0
    min_p: float = 0.0
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: StrictBool = False

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if not 1 <= v <= 16:
            raise ValueError("n must be in [1, 16]")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        for s in stops:
            _unicode(s, "stop")
        return v


class CompletionBody(SamplingFields):
    prompt: str | list[StrictInt]
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        return _unicode(v, "prompt") if isinstance(v, str) else v


ROLES = ("system", "developer", "user", "assistant", "tool")


def _unicode(text: str, what: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"): no tokenizer can encode them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate at character {e.start})") from None
    return text


class Message(BaseModel):
    role: str
    content: str

    @field_validator("role")
    @classmethod
    def _role(cls, v):
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        return _unicode(v, "content")


class ChatBody(SamplingFields):
    messages: list[Message]
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


class APIError(Exception):
    def __init__(self, status, message, kind="invalid_request_error"):
        self.status, self.message, self.kind = status, message, kind



def sampling_params(body: SamplingFields, logprobs: int | None, model_name: str, vocab_size: int) -> SamplingParams:
    """A request body's SamplingParams; APIError (404 for another model, 400 for a bad value)."""
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"model {body.model!r} not found; this server serves {model_name!r}", "model_not_found")
    mt = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    p = SamplingParams(max_tokens=16 if mt is None else mt, temperature=body.temperature, top_p=body.top_p,
                       top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=stop,
                       stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
                       presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                       repetition_penalty=body.repetition_penalty, logprobs=logprobs)
    try:
        p.validate(vocab_size)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return p


def logprob_items(tok, req, start: int, end: int) -> list:
    """Output tokens start..end of a request with their logprobs and top alternatives."""
    out = []
    for j in range(start, end):
        t = req.output_ids[j]
        top = req.top_logprobs[j] if j < len(req.top_logprobs) else {}
        out.append({"token": tok.decode([t]), "logprob": req.logprobs[j],
                    "top_logprobs": [{"token": tok.decode([a]), "logprob": b} for a, b in top.items()]})
    return out


def choice(chat: bool, want_logprobs: bool, i: int, req, text: str, delta: bool, lp=None) -> dict:
    """One choice of a response (delta: a streamed chunk's), in the chat or the completions format."""
    ch: dict[str, Any] = {"index": i, "finish_reason": req.finish_reason if req.finished else None}
    if chat:
        ch["delta" if delta else "message"] = {"role": "assistant", "content": text}
        if want_logprobs:
            ch["logprobs"] = {"content": lp}
    else:
        ch["text"] = text
        if want_logprobs:
            ch["logprobs"] = {"tokens": [x["token"] for x in lp], "token_logprobs": [x["logprob"] for x in lp],
                              "top_logprobs": [{y["token"]: y["logprob"] for y in x["top_logprobs"]} for x in lp]}
    return ch
