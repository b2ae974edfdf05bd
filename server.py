"""A small OpenAI-compatible HTTP server over the jaxspec engine.

    python server.py --model smollm2-135m --speculative-algorithm NGRAM --port 8000

One engine thread owns the scheduler (it is not thread-safe) and steps it while there is work; HTTP
handlers talk to it through a command queue and get tokens back through per-request asyncio
queues. A client that disconnects aborts its requests; a bad request gets a 4xx with a message.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import queue
import threading
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, field_validator

from jaxspec.generator import Generator, _text_of, streamable_text
from jaxspec.sampling import SamplingParams


class Engine:
    """The scheduler in its own thread. submit/abort are safe to call from any thread."""

    def __init__(self, gen: Generator):
        self.gen, self.sched = gen, gen.scheduler
        self.commands: queue.Queue = queue.Queue()
        self.wake = threading.Event()
        self.stopping = False
        self.metrics = dict(requests=0, requests_failed=0, prompt_tokens=0, generation_tokens=0)
        self.thread = threading.Thread(target=self._loop, name="jaxspec-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids, params, on_update) -> "Handle":
        h = Handle()
        self.commands.put(("add", prompt_ids, params, on_update, h))
        self.wake.set()
        if not h.ready.wait(timeout=60):
            raise RuntimeError("engine did not answer")
        if h.error:
            raise ValueError(h.error)
        return h

    def abort(self, h: "Handle"):
        self.commands.put(("abort", h))
        self.wake.set()

    def shutdown(self):
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)

    def _loop(self):
        while not self.stopping:
            while True:
                try:
                    cmd = self.commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    _, ids, params, cb, h = cmd
                    try:
                        h.req = self.sched.add(ids, params, cb)
                        self.metrics["requests"] += 1
                        self.metrics["prompt_tokens"] += len(ids)
                    except ValueError as e:
                        h.error = str(e)
                        self.metrics["requests_failed"] += 1
                    h.ready.set()
                elif cmd[0] == "abort" and cmd[1].req is not None:
                    self.sched.abort(cmd[1].req)
            if self.sched.has_work:
                try:
                    before = self.sched.stats["emitted"]
                    self.sched.step()
                    self.metrics["generation_tokens"] += self.sched.stats["emitted"] - before
                except Exception as e:  # never let one bad step kill the server: fail what is running
                    for r in list(self.sched.running) + list(self.sched.waiting):
                        r.error = f"engine error: {type(e).__name__}: {e}"
                        self.sched.abort(r)
            else:
                self.wake.wait(timeout=0.5)
                self.wake.clear()
        for r in list(self.sched.running) + list(self.sched.waiting):
            self.sched.abort(r)


class Handle:
    def __init__(self):
        self.ready = threading.Event()
        self.req = None
        self.error = None


# -- request bodies --------------------------------------------------------------------------------

class _Common(BaseModel):
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: StrictBool = False

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if not 1 <= v <= 16:
            raise ValueError("n must be in [1, 16]")
        return v


class CompletionBody(_Common):
    prompt: str | list[StrictInt]
    logprobs: StrictInt | None = None
    echo: StrictBool = False


class Message(BaseModel):
    role: str
    content: str


class ChatBody(_Common):
    messages: list[Message]
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


class APIError(Exception):
    def __init__(self, status, message, kind="invalid_request_error"):
        self.status, self.message, self.kind = status, message, kind


def _error(status, message, kind="invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_app(gen: Generator, model_name: str) -> FastAPI:
    engine = Engine(gen)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()  # graceful: running requests are aborted, their pages returned

    app = FastAPI(title="jaxspec", lifespan=lifespan)
    app.state.engine = engine
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        errs = exc.errors()
        if errs and errs[0].get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {errs[0].get('msg')}")
        parts = [f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errs]
        return _error(400, "invalid request: " + "; ".join(parts))

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error(exc.status, exc.message, exc.kind)

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started, "owned_by": "jaxspec"}]}

    @app.get("/metrics")
    def metrics():
        s, m, pool = engine.sched.stats, engine.metrics, engine.sched.pool
        acc = s["emitted"] / max(s["verify_steps"], 1)
        lines = [
            ("jaxspec_requests_total", m["requests"]), ("jaxspec_requests_rejected_total", m["requests_failed"]),
            ("jaxspec_prompt_tokens_total", m["prompt_tokens"]), ("jaxspec_generation_tokens_total", m["generation_tokens"]),
            ("jaxspec_queue_depth", len(engine.sched.waiting)), ("jaxspec_running_requests", len(engine.sched.running)),
            ("jaxspec_kv_pages_in_use", pool.in_use), ("jaxspec_kv_pages_total", pool.num_pages - 1),
            ("jaxspec_verify_steps_total", s["verify_steps"]),
            ("jaxspec_preemptions_total", s["preemptions"]),
            ("jaxspec_late_compiles_total", len(engine.sched.late_compiles)),  # a request waited for a compile
        ]
        text = "".join(f"# TYPE {k} {'counter' if k.endswith('_total') else 'gauge'}\n{k} {v}\n" for k, v in lines)
        accept = acc if s['verify_steps'] else 0
        return PlainTextResponse(text + f"# TYPE jaxspec_accept_length gauge\njaxspec_accept_length {accept}\n")

    def params_of(body: _Common, logprobs: int | None) -> SamplingParams:
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
            p.validate(gen.model.cfg.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return p

    async def run(request: Request, prompt_ids, params: SamplingParams, n: int, chat: bool, stream: bool):
        loop = asyncio.get_running_loop()
        queues, handles = [], []

        def make_cb(q):
            return lambda req, new: loop.call_soon_threadsafe(q.put_nowait, (list(new), req.finished))

        try:
            for i in range(n):
                p = SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else params.seed + i})
                q: asyncio.Queue = asyncio.Queue()
                try:
                    h = await asyncio.to_thread(engine.submit, prompt_ids, p, make_cb(q))
                except ValueError as e:
                    raise APIError(400, str(e)) from None
                queues.append(q)
                handles.append(h)
        except APIError:
            for h in handles:
                engine.abort(h)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        tok = gen.tokenizer

        def logprob_items(req, start, end):
            out = []
            for j in range(start, end):
                t = req.output_ids[j]
                top = req.top_logprobs[j] if j < len(req.top_logprobs) else {}
                out.append({"token": tok.decode([t]), "logprob": req.logprobs[j],
                            "top_logprobs": [{"token": tok.decode([a]), "logprob": b} for a, b in top.items()]})
            return out

        def choice(i, req, text, delta, lp=None):
            ch: dict[str, Any] = {"index": i, "finish_reason": req.finish_reason if req.finished else None}
            if chat:
                ch["delta" if delta else "message"] = {"role": "assistant", "content": text}
                if params.logprobs is not None:
                    ch["logprobs"] = {"content": lp}
            else:
                ch["text"] = text
                if params.logprobs is not None:
                    ch["logprobs"] = {"tokens": [x["token"] for x in lp], "token_logprobs": [x["logprob"] for x in lp],
                                      "top_logprobs": [{y["token"]: y["logprob"] for y in x["top_logprobs"]} for x in lp]}
            return ch

        def usage():
            gen_toks = sum(len(h.req.output_ids) for h in handles)
            return {"prompt_tokens": len(prompt_ids) * n, "completion_tokens": gen_toks,
                    "total_tokens": len(prompt_ids) * n + gen_toks}

        if not stream:
            try:
                for q, h in zip(queues, handles):
                    while not h.req.finished:
                        try:
                            await asyncio.wait_for(q.get(), timeout=0.5)
                        except asyncio.TimeoutError:
                            if await request.is_disconnected():
                                raise asyncio.CancelledError
            except asyncio.CancelledError:
                for h in handles:
                    engine.abort(h)
                raise
            choices = []
            for i, h in enumerate(handles):
                if h.req.error:
                    raise APIError(500, h.req.error, "server_error")
                lp = logprob_items(h.req, 0, len(h.req.logprobs)) if params.logprobs is not None else None
                choices.append(choice(i, h.req, _text_of(tok, h.req), False, lp))
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                                 "choices": choices, "usage": usage()})

        async def events():
            sent_text = [0] * n
            sent_tok = [0] * n
            closed = [False] * n
            try:
                merged: asyncio.Queue = asyncio.Queue()

                async def pump(i):
                    while True:
                        new, finished = await queues[i].get()
                        await merged.put((i, finished))
                        if finished:
                            return

                tasks = [asyncio.create_task(pump(i)) for i in range(n)]
                done = 0
                while done < n:
                    i, finished = await merged.get()
                    req = handles[i].req
                    text = streamable_text(tok, req)
                    end = max(sent_text[i], len(text))
                    piece = text[sent_text[i]:end]
                    lp = None
                    if params.logprobs is not None:
                        lp = logprob_items(req, sent_tok[i], len(req.logprobs))
                        sent_tok[i] = len(req.logprobs)
                    if (piece or req.finished) and not closed[i]:
                        closed[i] = req.finished
                        sent_text[i] = max(sent_text[i], end)
                        chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                 "model": model_name, "choices": [choice(i, req, piece, True, lp)]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                    if req.finished and finished:
                        done += 1
                for t in tasks:
                    t.cancel()
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we finished): abort whatever still runs
                for h in handles:
                    if not h.req.finished:
                        engine.abort(h)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        if body.logprobs is not None and not 0 <= body.logprobs <= SamplingParams.MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {SamplingParams.MAX_TOP_LOGPROBS}]")
        params = params_of(body, body.logprobs)
        try:
            ids = gen.encode(body.prompt)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return await run(request, ids, params, body.n, False, body.stream)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        lp = None
        if body.logprobs:
            lp = body.top_logprobs or 0
        params = params_of(body, lp)
        if not body.messages:
            raise APIError(400, "messages must not be empty")
        try:
            ids = gen.encode([m.model_dump() for m in body.messages])
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return await run(request, ids, params, body.n, True, body.stream)

    return app


def start_in_thread(app, host="127.0.0.1"):
    """Serve app on a free loopback port in a daemon thread; returns (url, uvicorn server, thread).
    For tests and benchmarks; set server.should_exit = True to stop it."""
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    url = f"http://{host}:{port}"
    import httpx
    for _ in range(200):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return url, server, th
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError("server did not start")


def build_app(argv=None):
    """The app that server.py's command-line flags describe: the model loaded and, unless
    --skip-warmup, its programs built. Returns (app, parsed flags)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--served-model-name")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--speculative-algorithm", default="NONE", help="NGRAM, EAGLE, EAGLE3, NAIVE_EAGLE or NONE")
    ap.add_argument("--speculative-draft-model-path", help="EAGLE head directory (default: the shipped one)")
    ap.add_argument("--speculative-num-steps", type=int)
    ap.add_argument("--speculative-eagle-topk", type=int, default=4)
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=8)
    ap.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=8)
    ap.add_argument("--speculative-ngram-match-type", default="BFS")
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int)
    ap.add_argument("--skip-warmup", action="store_true",
                    help="serve at once and compile each program when a request first needs it")
    args = ap.parse_args(argv)
    from jaxspec import SpecConfig
    spec = None
    if args.speculative_algorithm.upper() != "NONE":
        spec = SpecConfig(args.speculative_algorithm, num_draft_tokens=args.speculative_num_draft_tokens,
                          ngram_max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
                          ngram_match_type=args.speculative_ngram_match_type,
                          draft_model_path=args.speculative_draft_model_path, num_steps=args.speculative_num_steps,
                          eagle_topk=args.speculative_eagle_topk)
    gen = Generator.from_pretrained(args.model, speculative=spec, max_batch=args.max_running_requests,
                                    max_seq_len=args.max_seq_len, page_size=args.page_size, num_pages=args.num_pages,
                                    warmup=False if args.skip_warmup else "progress")  # before the port opens
    return create_app(gen, args.served_model_name or args.model), args


def main(argv=None):
    app, args = build_app(argv)
    # the model, tokenizer and drafter live as long as the server: the collector's full passes
    # need not walk them (each pass pauses every request's stream)
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)


if __name__ == "__main__":
    main()
