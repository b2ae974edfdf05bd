"""The host-side scheduler: continuous batching over the jitted programs (core.py), split by what
it does: admission and paging, launching calls, reading outputs back and stopping requests."""
from jaxspec.scheduler.core import DEFAULT_SPEC_MIN_GAIN, Scheduler
from jaxspec.scheduler.request import DraftRow, InFlight, Request

__all__ = ["DEFAULT_SPEC_MIN_GAIN", "DraftRow", "InFlight", "Request", "Scheduler"]
