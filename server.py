"""A small OpenAI-compatible HTTP server over the jaxspec engine.

    python server.py --model smollm2-135m --speculative-algorithm NGRAM --port 8000

The routes and streaming are here; the request bodies and response pieces are
jaxspec/openai_api.py. The scheduler runs in a process of its own (jaxspec/engine_process.py: the
event loop then has this process's GIL to itself); tests serve from an engine thread in-process
(jaxspec/engine_thread.py). Handlers hear of new tokens through a Mailbox into the event loop. A
client that disconnects aborts its requests; a bad request gets a 4xx with a message.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from jaxspec.detokenize import IncrementalText
from jaxspec.engine_process import EngineProcess
from jaxspec.engine_thread import Engine
from jaxspec.generator import Generator, encode_prompt, streamable_text, text_of
from jaxspec.openai_api import (APIError, ChatBody, CompletionBody, SamplingFields, StreamOptions, choice,
                                logprob_items, sampling_params)
from jaxspec.sampling import SamplingParams

# Seconds an idle keep-alive connection stays open: longer than clients keep theirs (httpx and the
# openai client: 5 s), so that a client never sends on a connection the server is closing. At
# uvicorn's 5 s, 3 of 2000 fault-run requests got no answer at all (serve_faults-NVIDIA-H100-*.json).
KEEP_ALIVE_S = 30


class Mailbox:
    """The engine thread's token updates into the event loop. call_soon_threadsafe wakes the loop
    through a self-pipe write each time: at concurrency 32 that is a syscall per request per step.
    Here all updates posted between two turns of the loop cost one wake-up."""

    def __init__(self, loop):
        self.loop, self.items, self.lock, self.armed = loop, [], threading.Lock(), False

    def post(self, queue: asyncio.Queue, item):
        with self.lock:
            self.items.append((queue, item))
            if self.armed:
                return
            self.armed = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self):
        with self.lock:
            items, self.items, self.armed = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


def _error(status, message, kind="invalid_request_error"):
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


def create_app(engine: Generator | Engine | EngineProcess, model_name: str, max_queued_requests: int = 1024,
               request_timeout: float | None = None, stream_interval: int = 1) -> FastAPI:
    """engine: an EngineProcess, or a Generator (served from an engine thread in this process).
    max_queued_requests: requests waiting for a batch slot beyond which new ones get a 503 with
    Retry-After (app.state.max_queued_requests; a burst cannot grow the queue without bound).
    request_timeout: seconds a request may take, queued and running, before it is aborted and its
    pages freed (a 504, or a streamed error event); None: no limit. stream_interval: a stream's
    chunk waits for this many new tokens (its first and last do not), as SGLang's and vLLM's
    --stream-interval: fewer chunks, less of the event loop's time a token under load."""
    if stream_interval < 1:
        raise ValueError(f"stream_interval={stream_interval} must be at least 1")
    engine = Engine(engine) if isinstance(engine, Generator) else engine
    tok = engine.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()  # graceful: running requests are aborted, their pages returned

    app = FastAPI(title="jaxspec", lifespan=lifespan)
    app.state.engine = engine
    app.state.max_queued_requests = max_queued_requests
    app.state.request_timeout = request_timeout
    app.state.stream_interval = stream_interval
    started = int(time.time())
    mailboxes: dict = {}  # event loop -> its Mailbox (one loop in a server; tests may start others)

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
        if not engine.alive:
            return _error(503, "the engine has stopped", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started, "owned_by": "jaxspec"}]}

    @app.get("/metrics")
    def metrics():
        m = engine.snapshot()
        lines = [
            ("jaxspec_requests_total", m["requests"]), ("jaxspec_requests_rejected_total", m["requests_failed"]),
            ("jaxspec_prompt_tokens_total", m["prompt_tokens"]), ("jaxspec_generation_tokens_total", m["generation_tokens"]),
            ("jaxspec_queue_depth", m["queue_depth"]), ("jaxspec_running_requests", m["running_requests"]),
            ("jaxspec_kv_pages_in_use", m["kv_pages_in_use"]), ("jaxspec_kv_pages_total", m["kv_pages_total"]),
            ("jaxspec_verify_steps_total", m["verify_steps"]),
            ("jaxspec_preemptions_total", m["preemptions"]),
            ("jaxspec_late_compiles_total", m["late_compiles"]),  # a request waited for a compile
            ("jaxspec_accept_length", m["accept_length"]),
        ]
        text = "".join(f"# TYPE {k} {'counter' if k.endswith('_total') else 'gauge'}\n{k} {v}\n" for k, v in lines)
        return PlainTextResponse(text)

    @app.get("/server_info")
    def server_info():
        """/metrics' values with the scheduler's step counters and what the speculation policy
        learned and chose per batch bucket (SGLang's /get_server_info): for load benches and tuning."""
        return JSONResponse(dict(engine.snapshot(detail=True), model=model_name))

    def params_of(body: SamplingFields, logprobs: int | None) -> SamplingParams:
        return sampling_params(body, logprobs, model_name, engine.vocab_size)

    async def run(request: Request, prompt_ids, params: SamplingParams, n: int, chat: bool, stream: bool,
                  options: StreamOptions | None = None):
        loop = asyncio.get_running_loop()
        limit = app.state.request_timeout
        deadline = None if not limit else loop.time() + limit
        timed_out = f"request timed out after {limit:g} s (--request-timeout)" if limit else ""
        handles = []
        updates: asyncio.Queue = asyncio.Queue()  # (choice index, finished) as the engine emits
        mailbox = mailboxes.get(loop) or mailboxes.setdefault(loop, Mailbox(loop))
        try:  # a bad request hears what is wrong with it even while the queue is full
            engine.check(prompt_ids, params)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        waiting = engine.queue_depth()
        if waiting + n > app.state.max_queued_requests:
            raise APIError(503, f"server busy: {waiting} requests waiting (--max-queued-requests "
                                f"{app.state.max_queued_requests}); retry later", "server_busy")

        def make_cb(i):
            return lambda req, new: mailbox.post(updates, (i, req.finished))

        try:
            for i in range(n):
                p = SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else params.seed + i})
                try:
                    h = await asyncio.to_thread(engine.submit, prompt_ids, p, make_cb(i))
                except ValueError as e:
                    raise APIError(400, str(e)) from None
                except RuntimeError as e:  # the engine stopped or does not answer: nothing of this request runs
                    raise APIError(503, str(e), "server_error") from None
                handles.append(h)
        except APIError:
            for h in handles:
                engine.abort(h)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        want_lp = params.logprobs is not None

        def usage():
            gen_toks = sum(len(h.req.output_ids) for h in handles)
            return {"prompt_tokens": len(prompt_ids) * n, "completion_tokens": gen_toks,
                    "total_tokens": len(prompt_ids) * n + gen_toks}

        if not stream:
            try:
                while not all(h.req.finished for h in handles):
                    if deadline is not None and loop.time() > deadline:
                        raise APIError(504, timed_out, "timeout")
                    try:
                        await asyncio.wait_for(updates.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            raise asyncio.CancelledError
            except (asyncio.CancelledError, APIError):
                for h in handles:
                    engine.abort(h)
                raise
            choices = []
            for i, h in enumerate(handles):
                if h.req.error:
                    raise APIError(500, h.req.error, "server_error")
                lp = logprob_items(tok, h.req, 0, len(h.req.logprobs)) if want_lp else None
                choices.append(choice(chat, want_lp, i, h.req, text_of(tok, h.req), False, lp))
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                                 "choices": choices, "usage": usage()})

        async def events():
            sent_text = [0] * n
            sent_tok = [0] * n
            streamed = [0] * n  # output tokens when each choice's last chunk went out
            interval = app.state.stream_interval
            readers = [IncrementalText(tok) for _ in range(n)]
            closed = [False] * n
            try:
                done = 0
                while done < n:
                    try:
                        left = None if deadline is None else max(deadline - loop.time(), 0.0)
                        got = [await asyncio.wait_for(updates.get(), timeout=left)]
                    except asyncio.TimeoutError:
                        err = {"error": {"message": timed_out, "type": "timeout", "code": 504}}
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    while not updates.empty():  # what came while the last chunk was sent: one chunk a choice
                        got.append(updates.get_nowait())
                    for i in dict.fromkeys(i for i, _ in got):
                        req = handles[i].req
                        if 0 < streamed[i] and len(req.output_ids) - streamed[i] < interval and not req.finished:
                            continue  # (the next update takes these tokens along)
                        streamed[i] = len(req.output_ids)
                        text = streamable_text(tok, req, readers[i])
                        end = max(sent_text[i], len(text))
                        piece = text[sent_text[i]:end]
                        lp = None
                        if params.logprobs is not None:
                            lp = logprob_items(tok, req, sent_tok[i], len(req.logprobs))
                            sent_tok[i] = len(req.logprobs)
                        if (piece or req.finished) and not closed[i]:
                            closed[i] = req.finished
                            sent_text[i] = max(sent_text[i], end)
                            chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                     "model": model_name, "choices": [choice(chat, want_lp, i, req, piece, True, lp)]}
                            if options and options.continuous_usage_stats:
                                chunk["usage"] = usage()
                            yield f"data: {json.dumps(chunk)}\n\n"
                            if req.finished and req.error:  # the engine failed it: say why
                                err = {"error": {"message": req.error, "type": "server_error", "code": 500}}
                                yield f"data: {json.dumps(err)}\n\n"
                    done = sum(closed)
                if options and options.include_usage:  # a last chunk with no choices, the counts
                    last = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                            "model": model_name, "choices": [], "usage": usage()}
                    yield f"data: {json.dumps(last)}\n\n"
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
            ids = encode_prompt(tok, body.prompt)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return await run(request, ids, params, body.n, False, body.stream, body.stream_options)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        lp = None
        if body.logprobs:
            lp = body.top_logprobs or 0
        params = params_of(body, lp)
        if not body.messages:
            raise APIError(400, "messages must not be empty")
        try:
            ids = encode_prompt(tok, [m.model_dump() for m in body.messages])
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return await run(request, ids, params, body.n, True, body.stream, body.stream_options)

    return app


def start_in_thread(app, host="127.0.0.1"):
    """Serve app on a free loopback port in a daemon thread; returns (url, uvicorn server, thread).
    For tests and benchmarks; set server.should_exit = True to stop it."""
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S))
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
    from jaxspec.speculative import add_flags, config_from_flags, verify_budget
    add_flags(ap)
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--max-queued-requests", type=int, default=1024,
                    help="waiting requests beyond which new ones get 503 + Retry-After")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="new tokens a streamed chunk waits for (its first and last do not): fewer, larger chunks")
    # 2, not vLLM's 0: one prefill call takes several newcomers and fewer chained decode calls break,
    # 1.01-1.31x plain's output tok/s at concurrency 32 and 128, for TTFT p50 up to 1.7x, p99 2.4x (serve-pool-*.json)
    ap.add_argument("--scheduler-delay-factor", type=float, default=2.0,
                    help="vLLM's: a running batch admits waiting requests once the oldest has waited this many "
                         "times the last prefill's time, or they fill its free rows (0: at once)")
    ap.add_argument("--request-timeout", type=float, default=0,
                    help="seconds a request may take, queued and running, before it is aborted (0: no limit)")
    ap.add_argument("--context-length", "--max-seq-len", dest="max_seq_len", type=int,
                    help="longest sequence, prompt and output (default: the model's context)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.8,
                    help="share of the device memory free after the weights that the KV pool takes, where the "
                         "device reports its memory (GPU), up to twice what the running requests hold at full "
                         "length; --num-pages overrides")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="weights and KV (default: bfloat16 on GPU)")
    ap.add_argument("--tp-size", type=int, default=1, help="devices to split the model over (tensor parallel)")
    ap.add_argument("--num-pages", type=int)
    ap.add_argument("--skip-warmup", action="store_true",
                    help="serve at once and compile each program when a request first needs it")
    args = ap.parse_args(argv)
    if args.scheduler_delay_factor < 0:
        ap.error(f"--scheduler-delay-factor must be >= 0, got {args.scheduler_delay_factor}")
    if not 0 < args.mem_fraction_static < 1:
        ap.error(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")
    try:  # bad flags fail here, before the engine process starts
        spec, budget = config_from_flags(args), verify_budget(args)
    except ValueError as e:
        ap.error(str(e))
    kw = dict(speculative=spec, max_batch=args.max_running_requests, dtype=args.dtype, max_seq_len=args.max_seq_len,
              page_size=args.page_size, num_pages=args.num_pages, mem_fraction=args.mem_fraction_static,
              spec_policy=args.speculative_policy, tp_size=args.tp_size, **budget,
              scheduler_delay_factor=args.scheduler_delay_factor,
              warmup=False if args.skip_warmup else "progress")  # before the port opens
    engine = EngineProcess(_generator, args.model, kw)
    pages = engine.snapshot()["kv_pages_total"]
    print(f"KV pool: {pages} pages of {args.page_size} tokens ({pages * args.page_size} tokens), "
          f"{args.max_running_requests} running requests at most", flush=True)
    return create_app(engine, args.served_model_name or args.model, args.max_queued_requests,
                      args.request_timeout or None, args.stream_interval), args


def _generator(model: str, kw: dict) -> Generator:
    """The engine process's Generator (server.py's flags as from_pretrained's arguments)."""
    import jax.numpy as jnp
    return Generator.from_pretrained(model, **{**kw, "dtype": getattr(jnp, kw["dtype"]) if kw["dtype"] else None})


def main(argv=None):
    app, args = build_app(argv)
    gc.collect()  # (as the engine process does: see engine_process._child)
    gc.freeze()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10,
                timeout_keep_alive=KEEP_ALIVE_S)


if __name__ == "__main__":
    main()
