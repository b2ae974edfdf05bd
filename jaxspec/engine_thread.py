"""The scheduler in its own thread: one thread owns the scheduler (it is not thread-safe) and
steps it while there is work; other threads submit and abort through a command queue and get
tokens back through the callbacks they pass. server.py's engine process (engine_process.py)
turns the same loop from its one thread (start=False); tests serve from the thread in-process.

What a server asks of an engine (this one and EngineProcess alike): submit / abort / check /
queue_depth / snapshot / shutdown, tokenizer, vocab_size, alive."""
from __future__ import annotations

import queue
import threading

from jaxspec.generator import Generator


class Engine:
    """The scheduler in its own thread. submit/abort are safe to call from any thread. With
    start=False no thread starts: the caller turns the loop itself (turn / finish)."""

    def __init__(self, gen: Generator, start: bool = True):
        self.gen, self.sched = gen, gen.scheduler
        self.commands: queue.Queue = queue.Queue()
        self.wake = threading.Event()
        self.stopping = False
        self.on_step = None  # called after each turn of the loop, from its thread (a place to send outputs)
        self.metrics = dict(requests=0, requests_failed=0, prompt_tokens=0, generation_tokens=0)
        self.thread = threading.Thread(target=self._loop, name="jaxspec-engine", daemon=True)
        if start:
            self.thread.start()

    @property
    def tokenizer(self):
        return self.gen.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.sched.cfg.vocab_size

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def check(self, prompt_ids, params):
        """A ValueError naming what the request gets wrong, before it is queued."""
        self.sched.check(prompt_ids, params)

    def queue_depth(self) -> int:
        return len(self.sched.waiting)

    def snapshot(self, detail: bool = False) -> dict:
        """The counters and gauges /metrics shows; detail adds the scheduler's step counters and
        what the speculation policy learned and chose (/server_info)."""
        s, pool = self.sched.stats, self.sched.pool
        out = dict(self.metrics, queue_depth=len(self.sched.waiting), running_requests=len(self.sched.running),
                   kv_pages_in_use=pool.in_use, kv_pages_total=pool.num_pages - 1, verify_steps=s["verify_steps"],
                   preemptions=s["preemptions"], late_compiles=len(self.sched.late_compiles),
                   accept_length=self.sched.mean_accept_length())
        if detail:
            policy = self.sched.spec_policy
            for _ in range(8):  # read while the loop's thread may add keys: again if one moved under it
                try:
                    out.update(scheduler=dict(s), spec_policy=None if policy is None else policy.summary())
                    break
                except RuntimeError:
                    continue
        return out

    def submit_nowait(self, prompt_ids, params, on_update, on_ready=None) -> "Handle":
        """Queue a request; on_ready(handle) is called from the loop's thread once it is added (or
        refused: handle.error)."""
        h = Handle(on_ready)
        self.commands.put(("add", prompt_ids, params, on_update, h))
        self.wake.set()
        return h

    def submit(self, prompt_ids, params, on_update) -> "Handle":
        h = self.submit_nowait(prompt_ids, params, on_update)
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
            self.turn(self._wait_for_wake)
        self.finish()

    def _wait_for_wake(self):
        self.wake.wait(timeout=0.5)
        self.wake.clear()

    def turn(self, idle):
        """The commands queued, then a scheduler step where there is work, else idle() (which
        returns when there may be commands)."""
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
                if h.on_ready:
                    h.on_ready(h)
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
            idle()
        if self.on_step:
            self.on_step()

    def finish(self):
        """Abort what is left (its pages returned)."""
        for r in list(self.sched.running) + list(self.sched.waiting):
            self.sched.abort(r)
        if self.on_step:
            self.on_step()


class Handle:
    def __init__(self, on_ready=None):
        self.ready, self.on_ready = threading.Event(), on_ready
        self.req = None
        self.error = None
