"""The scheduler in a process of its own, for the HTTP server, as SGLang and vLLM split theirs.

In one process the engine's thread and uvicorn's event loop share the GIL: at concurrency 32 on
the H100 the event loop held it 67% of the time (server_gil-NVIDIA-H100-80GB-HBM3.json), and the
server streamed ~11.5k tok/s (serve-variants-) where the Generator ran the same batch size at
19.5k (spec-b8-). Here a child process builds the Generator (a picklable factory), turns
engine_thread.Engine's loop itself, and talks to the server over one pipe. The server sends add /
abort / stats; the child answers each add once the scheduler has it, and after each scheduler step
sends every request's new tokens in one message. The server keeps a RequestView per request: the
fields its responses read.
"""
from __future__ import annotations

import gc
import itertools
import multiprocessing
import threading
import traceback

from jaxspec.engine_thread import Engine, Handle
from jaxspec.scheduler.core import check_request

EXITED = "the engine process exited"


class RequestView:
    """What the server reads of a request, mirrored from the engine process's Request."""

    def __init__(self, params):
        self.params = params
        self.output_ids, self.logprobs, self.top_logprobs = [], [], []
        self.finish_reason = self.stop_text_len = self.error = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineProcess:
    """The same calls as engine_thread.Engine, served by a child process."""

    def __init__(self, factory, *args, start_timeout: float | None = None):
        """factory(*args) -> Generator, run in the child (a module-level function and picklable
        arguments). Returns once the child has built it (warm-up included, if the factory warms up)."""
        ctx = multiprocessing.get_context("spawn")  # a fork would copy a started JAX runtime
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_conn, factory, args), name="jaxspec-engine", daemon=True)
        self.proc.start()
        child_conn.close()
        try:
            kind, info = self.conn.recv() if self.conn.poll(start_timeout) else ("failed", f"no answer in {start_timeout} s")
        except EOFError:
            self.proc.join(5)
            kind, info = "failed", f"it exited with code {self.proc.exitcode}"
        if kind != "ready":
            self.proc.kill()
            raise RuntimeError(f"the engine process failed to start: {info}")
        self.tokenizer, self.vocab_size, self.max_seq_len = info["tokenizer"], info["vocab_size"], info["max_seq_len"]
        self.waiting = 0  # the child's queue depth, as its last message said
        self.handles: dict = {}  # id -> (Handle, on_update) of requests not finished
        self.replies: dict = {}  # stats query id -> [Event, snapshot]
        self.ids = itertools.count()
        self.send_lock = threading.Lock()
        self.dead = False
        self.reader = threading.Thread(target=self._read, name="jaxspec-engine-reader", daemon=True)
        self.reader.start()

    @property
    def alive(self) -> bool:
        return not self.dead and self.proc.is_alive()

    def _send(self, msg):
        with self.send_lock:
            self.conn.send(msg)

    def submit(self, prompt_ids, params, on_update) -> Handle:
        if not self.alive:
            raise RuntimeError(EXITED)
        h = Handle()
        h.hid, h.req = next(self.ids), RequestView(params)
        self.handles[h.hid] = (h, on_update)
        self._send(("add", h.hid, list(prompt_ids), params))
        if not h.ready.wait(timeout=60):
            self.handles.pop(h.hid, None)
            raise RuntimeError("engine did not answer")
        if h.error:
            raise ValueError(h.error)
        return h

    def abort(self, h: Handle):
        if self.alive and not h.req.finished:
            self._send(("abort", h.hid))

    def check(self, prompt_ids, params):
        check_request(prompt_ids, params, self.vocab_size, self.max_seq_len)

    def queue_depth(self) -> int:
        return self.waiting

    def snapshot(self, detail: bool = False, timeout: float = 10.0) -> dict:
        qid = next(self.ids)
        reply = self.replies[qid] = [threading.Event(), None]
        self._send(("stats", qid, detail))
        reply[0].wait(timeout)
        self.replies.pop(qid, None)
        if reply[1] is None:
            raise RuntimeError("engine did not answer")
        return reply[1]

    def shutdown(self):
        if self.proc.is_alive():
            try:
                self._send(("shutdown",))
            except OSError:
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()

    def _read(self):
        try:
            while True:
                msg = self.conn.recv()
                if msg[0] == "updates":
                    self.waiting = msg[1]
                    for item in msg[2]:
                        self._update(*item)
                elif msg[0] == "ack":
                    _, hid, error, self.waiting = msg
                    h, _ = self.handles[hid]
                    if error:
                        h.error = error
                        del self.handles[hid]
                    h.ready.set()
                elif msg[0] == "stats" and msg[1] in self.replies:
                    reply = self.replies[msg[1]]
                    reply[1] = msg[2]
                    reply[0].set()
        except (EOFError, OSError):
            pass
        self.dead = True
        for hid in list(self.handles):  # nothing more comes: every request ends with an error
            h, _ = self.handles[hid]
            h.error = h.error or EXITED
            h.ready.set()
            self._update(hid, [], [], [], "abort", None, EXITED)

    def _update(self, hid, tokens, logprobs, top_logprobs, finish_reason, stop_text_len, error):
        entry = self.handles.get(hid)
        if entry is None:
            return
        h, on_update = entry
        v = h.req
        v.output_ids.extend(tokens)
        v.logprobs.extend(logprobs)
        v.top_logprobs.extend(top_logprobs)
        v.stop_text_len, v.error = stop_text_len, error or v.error
        if finish_reason is not None:
            v.finish_reason = finish_reason
            del self.handles[hid]
        if on_update:
            on_update(v, tokens)


def _child(conn, factory, args):
    try:
        gen = factory(*args)
    except BaseException as e:  # the server says why (the traceback on this process's stderr) and exits
        traceback.print_exc()
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    # the model, tokenizer and drafter live as long as the engine: the collector's full passes
    # need not walk them (each pass pauses every request's stream)
    gc.collect()
    gc.freeze()
    engine = Engine(gen, start=False)  # this process's one thread turns its loop: no GIL handed over
    outbox, handles = [], {}

    def on_update_for(hid):
        sent = [0, 0, 0]  # output ids, logprobs, top logprobs already sent

        def on_update(req, new):
            n = len(req.output_ids), len(req.logprobs), len(req.top_logprobs)
            outbox.append((hid, req.output_ids[sent[0]:n[0]], req.logprobs[sent[1]:n[1]],
                           req.top_logprobs[sent[2]:n[2]], req.finish_reason, req.stop_text_len, req.error))
            first = sent[0] == 0 and n[0] > 0
            sent[:] = n
            if req.finished:
                handles.pop(hid, None)
            if first:  # now, not after the rest of the step: that launches a call and may wait for it
                flush()
        return on_update

    sent_depth = [0]

    def flush():  # after each turn of the loop: one message for every request's new tokens
        depth = engine.queue_depth()
        if outbox or depth != sent_depth[0]:  # (the server's 503s follow the queue: it must hear it drain)
            items = outbox[:]
            outbox.clear()
            sent_depth[0] = depth
            conn.send(("updates", depth, items))

    def acked_for(hid):
        def acked(h):
            if h.error:
                handles.pop(hid, None)
            sent_depth[0] = engine.queue_depth()
            conn.send(("ack", hid, h.error, sent_depth[0]))
        return acked

    def receive(timeout):
        """The server's messages that arrived (waiting up to timeout for the first), queued."""
        try:
            while conn.poll(timeout):
                timeout = 0
                msg = conn.recv()
                if msg[0] == "add":
                    _, hid, ids, params = msg
                    handles[hid] = engine.submit_nowait(ids, params, on_update_for(hid), acked_for(hid))
                elif msg[0] == "abort" and msg[1] in handles:
                    engine.abort(handles[msg[1]])
                elif msg[0] == "stats":
                    conn.send(("stats", msg[1], engine.snapshot(msg[2])))
                elif msg[0] == "shutdown":
                    engine.stopping = True
        except (EOFError, OSError):  # the server went away
            engine.stopping = True

    engine.on_step = flush
    conn.send(("ready", dict(tokenizer=gen.tokenizer, vocab_size=engine.vocab_size,
                             max_seq_len=gen.scheduler.max_seq_len)))
    while not engine.stopping:
        receive(0)
        engine.turn(lambda: receive(0.5))
    engine.finish()
