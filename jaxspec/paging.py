"""Host-side page allocator with prefix reuse by hash-chained full pages.

A full page whose K/V belong to a known token prefix is registered under the hash of
(previous page's key, its tokens); a later request whose prompt starts with the same tokens takes
those pages instead of recomputing them. Pages are reference-counted: a registered page nobody
uses waits on an LRU list and is evicted only when the free list runs dry.

With a device drafter a page holds two caches' K/V, the target's and the drafter's; a request
decoded by the target alone leaves the drafter's part unwritten. Such pages are registered as
target-only: they serve requests that decode plainly, and a later page holding both caches for the
same tokens takes their place in the index.
"""
from __future__ import annotations

import collections
import os
import subprocess

import numpy as np

from jaxspec.kv_cache import TRASH_PAGE


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need num_pages >= 2 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.free = collections.deque(p for p in range(num_pages) if p != TRASH_PAGE)
        self.refs = [0] * num_pages
        self.cached: dict[tuple, int] = {}  # chain key -> page
        self.key_of: dict[int, tuple] = {}  # page -> chain key
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.target_only: set[int] = set()  # registered pages whose drafter K/V were never written
        self.hits = 0  # tokens served from the prefix cache

    @property
    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def in_use(self) -> int:
        return self.num_pages - 1 - self.available

    def alloc(self, n: int) -> list[int]:
        if n > self.available:
            raise OutOfPages(f"need {n} pages, {self.available} available")
        out = []
        for _ in range(n):
            if self.free:
                p = self.free.popleft()
            else:
                p, _ = self.evictable.popitem(last=False)
                del self.cached[self.key_of.pop(p)]
                self.target_only.discard(p)
            self.refs[p] = 1
            out.append(p)
        return out

    def _chain(self, tokens, n_pages):
        key, ps = None, self.page_size
        for i in range(n_pages):
            key = (hash(key), tuple(tokens[i * ps:(i + 1) * ps]))
            yield key

    def match_prefix(self, tokens, target_only_ok: bool = True) -> list[int]:
        """Pages holding a cached prefix of tokens (references taken). At least one token is left
        uncovered, since the last prompt token must run to produce logits. target_only_ok=False:
        only pages holding the drafter's K/V too."""
        pages = []
        for key in self._chain(tokens, (len(tokens) - 1) // self.page_size):
            p = self.cached.get(key)
            if p is None or (not target_only_ok and p in self.target_only):
                break
            if self.refs[p] == 0:
                del self.evictable[p]
            self.refs[p] += 1
            pages.append(p)
        self.hits += len(pages) * self.page_size
        return pages

    def full_prefix(self, pages: list[int]) -> int:
        """How many leading pages hold every cache's K/V (the drafter's too)."""
        return next((i for i, p in enumerate(pages) if p in self.target_only), len(pages))

    def release(self, pages: list[int], tokens=(), complete: int | None = None):
        """Drop one reference to each page. tokens: the tokens whose K/V the pages hold, in order;
        every full page among them is registered for reuse. complete: how many of those tokens
        have the drafter's K/V too (default: all); the pages past them are registered as
        target-only, and a page holding both replaces a target-only one of the same tokens."""
        full = min(len(tokens) // self.page_size, len(pages))
        complete = len(tokens) if complete is None else complete
        for i, key in enumerate(self._chain(tokens, full)):
            p = pages[i]
            if p in self.key_of:
                continue
            whole = (i + 1) * self.page_size <= complete
            old = self.cached.get(key)
            if old is not None:
                if not whole or old not in self.target_only:
                    continue
                del self.key_of[old]  # the page with both caches' K/V serves more requests
                self.target_only.discard(old)
                if self.refs[old] == 0:
                    del self.evictable[old]
                    self.free.append(old)
            self.cached[key] = p
            self.key_of[p] = key
            if not whole:
                self.target_only.add(p)
        for p in pages:
            self.refs[p] -= 1
            assert self.refs[p] >= 0, f"page {p} released twice"
            if self.refs[p] == 0:
                if p in self.key_of:
                    self.evictable[p] = None
                else:
                    self.free.append(p)

    def check(self):
        """Accounting invariant: every page but the trash page is exactly one of free, evictable, in use."""
        free, ev = set(self.free), set(self.evictable)
        used = {p for p in range(self.num_pages) if self.refs[p] > 0}
        assert len(free) == len(self.free), "duplicate page on the free list"
        assert not (free & ev) and not (free & used) and not (ev & used), "page in two states"
        assert free | ev | used == set(range(self.num_pages)) - {TRASH_PAGE}, "page lost"
        assert all(self.cached[self.key_of[p]] == p for p in self.key_of)
        assert self.target_only <= set(self.key_of), "unregistered page marked target-only"
        return True


def pages_that_fit(cfg, drafter, page_size, dtype, fraction, mesh=None) -> int | None:
    """KV pages (target and drafter caches) in `fraction` of the first device's free memory, or None
    where the device reports none (the CPU). Each device holds 1/tp of a page under a mesh."""
    import jax
    if not 0 < fraction < 1:
        raise ValueError(f"mem_fraction={fraction} must be in (0, 1)")
    free = device_free_bytes(jax.devices()[0])
    if free is None:
        return None
    itemsize = np.dtype(dtype).itemsize
    per_page = 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * itemsize
    if getattr(drafter, "head", None) is not None:
        layers, kv_heads, head_dim = drafter.cache_shape()
        per_page += 2 * layers * page_size * kv_heads * head_dim * itemsize
    tp = 1 if mesh is None else mesh.devices.size
    return int(fraction * free * tp // per_page)


def device_free_bytes(device) -> int | None:
    """Bytes of `device` a KV pool may take: what XLA's allocator may still hand out (bytes_limit
    less bytes_in_use); or, on a GPU whose allocator names no limit or one under half the GPU, the
    memory its driver reports free (SGLang sizes its pool from cudaMemGetInfo), within the share of
    the GPU a JAX client takes. The VMM allocator, which command-buffer updates use
    (compile_options.py), maps memory as it is asked for: on the H200 a server of 8 rows preempted
    requests at concurrency 8 (serve-plaindelay-c8-NVIDIA-H200.json), as a pool of the fallback
    size (1 + 16 pages a row) would. None where neither is known (the CPU)."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    gpu = gpu_memory(device) if device.platform == "gpu" else None
    used = stats.get("bytes_in_use", 0)
    if limit and (gpu is None or limit >= gpu[0] // 2):
        return limit - used
    if gpu is None:
        return None
    # no more than the share of the GPU a JAX client takes (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75)
    share = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    return int(min(gpu[1], share * gpu[0] - used))


def gpu_memory(device) -> tuple[int, int] | None:
    """(total, free) bytes of a GPU as nvidia-smi reports them, or None without it. nvidia-smi
    numbers GPUs physically: CUDA_VISIBLE_DEVICES (indices or UUIDs) maps the device's ordinal."""
    ordinal = getattr(device, "local_hardware_id", None)
    ordinal = device.id if ordinal is None else ordinal
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    which = visible[ordinal] if ordinal < len(visible) else str(ordinal)
    try:
        out = subprocess.run(["nvidia-smi", f"--id={which}", "--query-gpu=memory.total,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
        total, free = (int(x) * 2**20 for x in out.stdout.strip().split(","))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return total, free
