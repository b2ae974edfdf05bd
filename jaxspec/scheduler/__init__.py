"""The host-side scheduler: continuous batching over the jitted programs (core.py), split by what
it does: admission and paging, launching calls and chaining them, reading outputs back and stopping
requests, the tree a call verifies (trees.py), and the program set built at start-up with its step
costs (startup.py)."""
from jaxspec.scheduler.core import DEFAULT_SPEC_MIN_GAIN, Scheduler
from jaxspec.scheduler.request import DraftRow, InFlight, Request

__all__ = ["DEFAULT_SPEC_MIN_GAIN", "DraftRow", "InFlight", "Request", "Scheduler"]
