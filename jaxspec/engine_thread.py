"""The scheduler in its own thread, for servers: one thread owns the scheduler (it is not
thread-safe) and steps it while there is work; other threads submit and abort through a command
queue and get tokens back through the callbacks they pass."""
from __future__ import annotations

import queue
import threading

from jaxspec.generator import Generator


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
