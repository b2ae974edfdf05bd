"""The engine's device programs: a small fixed set of jitted steps, compiled once at start-up.

`extend` feeds T new tokens per request (prefill chunks) and samples the token after the last
one. `decode` runs up to MAX_DECODE_STEPS plain decode steps in one call, each row stopping on the
device at a stop id or its token budget: the host launches and reads back once per call, so at
small batch, where launching a step costs the host about as long as the GPU takes to run it, the
GPU no longer waits for the host between steps. `verify_tree` runs a host-drafted tree through
the target, accepts the longest matching root path, compacts the accepted K/V and returns the
emitted tokens. With a device drafter (EAGLE heads, DFLASH) `extend` and `verify_steps` come
from the drafter's step module (drafters/eagle_step.py, dflash_step.py): they also keep the
drafter's cache in step and draft the next tree, and `verify_steps` runs up to
MAX_VERIFY_STEPS speculative steps a call. The cache is donated to every program; none syncs
with the host.

Shapes: the page table always has the engine's maximum width (the kernels stop at each
request's length), a batch is padded to a bucket of BATCH_BUCKETS, a prefill chunk to one of
three (rows, tokens) shapes and a tree to the size its batch bucket gets. So an engine has a few
dozen programs at most; `Programs.build` compiles them before the first request (in threads;
read back from the program store and JAX's persistent cache where a previous start left them:
program_store.py, program_workers.py), and a program compiled after that is counted in
`late_compiles` (tests fail on one; the server exports it).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import os
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import program_store, sampling, sharding
from jaxspec.compile_options import program_options
from jaxspec.verify import verify_and_accept

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TREE_BUCKETS = (2, 4, 8, 16, 32, 64)
MAX_DECODE_STEPS = 8  # a decode call's most steps (its outputs' width)
STOP_ID_SLOTS = 8  # stop ids a row's decode call checks on the device (the host checks them all)


# Programs whose one executable serves greedy and sampled batches (sampling.sample() draws behind a
# lax.cond): half the programs to build at start-up. verify_steps keeps a greedy program of its own:
# the cond's host sync exposes the launches of the draft loop after it, which cost an EAGLE-3 call
# 8% at batch 1 on the H200, against 0.6% for a plain decode call (sampler_probe-*.json).
SHARED_SAMPLER = ("extend", "decode", "verify_tree")


def program_flags(name: str, flags: sampling.SamplerFlags, shared: bool = True) -> sampling.SamplerFlags:
    """The flags the program serving a batch with `flags` is compiled with (shared: whether
    SHARED_SAMPLER's programs serve greedy and sampled batches alike)."""
    return flags._replace(sample=True, filter=True) if shared and name in SHARED_SAMPLER else flags


def bucket(n: int, buckets) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def prefill_shapes(chunk: int, rows_max: int) -> list:
    """(rows, tokens) of the prefill programs, no wider than rows_max rows: one long prompt, or
    several shorter ones, within a budget of `chunk` tokens a call; and where 64 rows fit, 64 rows
    of a few tokens (a wave of prompts that hit the prefix cache) and 64 rows of 4x the budget (a
    wave of new prompts). At batch 64 a call costs the small model about as much as a decode step
    whatever its width, and its 64 cached prompts took four (16, 32) calls, a 1-step decode call
    unchained after each (engine_gap-NVIDIA-H100-80GB-HBM3.json)."""
    shapes = {(min(r, rows_max), max(1, chunk // r)) for r in (1, 4, 16)}
    if rows_max >= 64:
        shapes |= {(64, max(1, chunk // 64)), (64, max(1, chunk // 16))}
    return sorted(shapes)


# -- the program table -------------------------------------------------------------------------------------
def _signature(tree) -> tuple:
    return tuple((x.shape, x.dtype) for x in jax.tree.leaves(tree))


# A chained call's inputs are the last call's outputs: donating them lets XLA write those outputs
# into the inputs' buffers, so a chain of calls runs on the same buffers and the command buffer
# (CUDA graph) XLA recorded for the program is replayed without updating its kernels' pointers.
_CARRIED = {"decode": ("tokens", "kv_lens", "budget", "sb")}
_CARRIED_DEVICE_DRAFTER = {**_CARRIED, "verify_steps": ("tokens", "parents", "kv_lens", "budget", "sb")}


class Programs:
    """One model's (and drafter's) step functions and the executables built for them, by shape."""

    def __init__(self, model, attn_impl: str = "auto", jit: bool = True, drafter=None, store: str | None = None,
                 mesh=None):
        """store: a folder for exported programs (program_store.py), or None to trace every one.
        mesh: the tensor-parallel mesh the weights are sharded over (traced under it)."""
        self.jit, self.store, self.mesh = jit, store, mesh
        # Under a tensor-parallel mesh the sampler's conditional holds collectives (its logits are
        # split by vocabulary), which no command buffer holds (compile_options.py): XLA runs it
        # from the host, whose launch then waits for the GPU mid-program. A TP-2 verify_tree call
        # (8B shape, 8 layers, batch 1, two H100s) took 3.56 ms for 1.39 ms of kernels, its launch
        # holding the host 3.13 ms (tp_step-NVIDIA-H100-80GB-HBM3.json, run at d6542d3). So there a
        # greedy batch gets a program without the sampler.
        self.shared_sampler = sharding.tp_size(mesh) == 1
        head = getattr(drafter, "head", None)
        self.tree = getattr(drafter, "tree", None)  # the tree a device drafter's programs draft
        # what the programs' code depends on beyond their argument shapes (an exported entry's name)
        # the shapes whose emitted counts verify_steps also returns, in its columns (another program)
        self.cut_shapes = cuts = drafter.cut_shapes() if head is not None else ()
        self.config_key = (repr(model.cfg), repr(getattr(head, "cfg", None)), repr(getattr(drafter, "tree", None)),
                           attn_impl) + ((repr(cuts),) if cuts else ())
        if head is None:
            graphdef, state = nnx.split(model)
            fns = {"extend": functools.partial(_extend, graphdef, attn_impl),
                   "decode": functools.partial(_decode, graphdef, attn_impl),
                   "verify_tree": functools.partial(_verify_tree, graphdef, attn_impl)}
            self.carried = _CARRIED
            graphs = (graphdef,)
        else:
            (g_target, s_target), (g_head, s_head) = nnx.split(model), nnx.split(head)
            state = (s_target, s_head)
            graphs = (g_target, g_head)
            fns = drafter.step_functions(graphs, attn_impl)
            self.carried = _CARRIED_DEVICE_DRAFTER
        # what a worker process needs to build these programs (program_workers.py): no weights
        self._recipe = (graphs, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state),
                        None if head is None else (type(drafter), drafter.tree, drafter.policy_shapes), attn_impl)
        # the weights as a flat list: flattening the module state's tree on every call cost the
        # host ~0.4 ms a call (SmolLM2, H100: host_probe-*.json, before_flat_weights)
        self.state, treedef = jax.tree.flatten(state)
        self._target_leaves = len(jax.tree.leaves(state[0])) if head is not None else len(self.state)
        self.fns = {name: _with_state(treedef, fn) for name, fn in fns.items()}
        self.table: dict[tuple, object] = {}
        self.build_seconds = {"lower": 0.0, "compile": 0.0}  # of build(): tracing + lowering, then compiling
        self.store_reads = 0  # programs read back from the store rather than traced
        self.executable_reads = 0  # of those, read back compiled
        self.warm = False  # set once the start-up set is built: compiles after it are late
        self.late_compiles: list[tuple] = []

    @property
    def recipe(self) -> tuple:
        """(graph definitions, weight shapes, draft tree, attention impl, store): see program_workers."""
        return self._recipe + (self.store,)

    def replace_head(self, head):
        """Take the drafter head's current weights (same shapes: the compiled programs serve them)."""
        leaves = jax.tree.leaves(nnx.split(head)[1])
        if _signature(leaves) != _signature(self.state[self._target_leaves:]):
            raise ValueError("the head's weights changed shape: its programs would need a recompile")
        self.state = self.state[:self._target_leaves] + leaves

    def extend(self, cache, tokens, next_tokens, page_table, kv_lens, q_lens, sb, *, flags):
        return self.run("extend", flags, cache, (tokens, next_tokens, page_table, kv_lens, q_lens, sb))

    def decode(self, cache, tokens, page_table, kv_lens, budget, stop_ids, num_steps, sb, *, flags):
        return self.run("decode", flags, cache, (tokens, page_table, kv_lens, budget, stop_ids, num_steps, sb))

    def verify_tree(self, cache, tokens, parents, page_table, kv_lens, num_nodes, sb, *, flags):
        return self.run("verify_tree", flags, cache, (tokens, parents, page_table, kv_lens, num_nodes, sb))

    def verify_steps(self, cache, tokens, parents, page_table, kv_lens, num_nodes, budget, stop_ids, num_steps,
                     next_nodes, sb, *, flags):
        return self.run("verify_steps", flags, cache, (tokens, parents, page_table, kv_lens, num_nodes, budget,
                                                       stop_ids, num_steps, next_nodes, sb))

    def flags_for(self, name, flags):
        """The flags of the program that serves `flags` (program_flags)."""
        return program_flags(name, flags, self.shared_sampler)

    def key(self, name, flags, cache, args) -> tuple:
        """The table's key of the program that serves `flags` on these arguments."""
        return name, self.flags_for(name, flags), _signature((cache, args))

    def run(self, name, flags, cache, args):
        if not self.jit:
            with self._traced():
                return self.fns[name](self.state, cache, *args, flags=self.flags_for(name, flags))
        key = self.key(name, flags, cache, args)
        flags = key[1]
        if key not in self.table:
            spec = (name, flags, cache, args)
            self.table[key] = self._count_read(self._read_executable(*spec)) or self._compile(*spec)
            if self.warm:
                self.late_compiles.append(key)
        return self.table[key](self.state, cache, *args)

    def _executable_name(self, name, flags, cache, args) -> str | None:
        return self.store and program_store.executable_name(self.entry(name, flags, cache, args), program_options(name, args))

    def _read_executable(self, name, flags, cache, args):
        """The program's executable as an earlier start kept it in the store, or None."""
        file = self._executable_name(name, flags, cache, args)
        return file and program_store.load_executable(self.store, file)

    def _count_read(self, exe):
        if exe is not None:
            self.store_reads += 1
            self.executable_reads += 1
        return exe

    def _compile(self, name, flags, cache, args, lowered=None):
        """Lowered (unless given) and compiled; kept in the store for the next start."""
        lowered = lowered or self._lower(name, flags, cache, args)
        if not self.store:
            return lowered.compile(program_options(name, args))
        exe, built_here = program_store.compile_lowered(lowered, program_options(name, args))
        if built_here:
            program_store.save_executable(self.store, self._executable_name(name, flags, cache, args), exe)
        return exe

    def stored(self, name, flags, cache, args) -> bool:
        """Whether the store holds this program (exported by an earlier start or a worker)."""
        return os.path.exists(os.path.join(self.store, self.entry(name, flags, cache, args)))

    def entry(self, name, flags, cache, args) -> str:
        """The file name of this program in the store."""
        return program_store.entry_name(self.config_key, name, self.flags_for(name, flags), _signature((self.state, cache, args)),
                                        str(jax.tree.structure((cache, args))))

    def _traced(self):
        """Under the mesh, if any: attention.py runs its kernels per shard (shard_map) inside it."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _lower(self, name, flags, cache, args):
        donated = ("cache",) + self.carried.get(name, ())
        if self.store is None:
            fn = jax.jit(self.fns[name], static_argnames=("flags",), donate_argnames=donated)
            with self._traced():
                return fn.lower(self.state, cache, *args, flags=flags)
        entry = self.entry(name, flags, cache, args)
        fn = jax.jit(self.fns[name], static_argnames=("flags",))
        exp, read = program_store.exported(self.store, entry, fn, (self.state, cache) + tuple(args), {"flags": flags})
        self.store_reads += read
        params = list(inspect.signature(self.fns[name]).parameters)
        call = jax.jit(exp.call, donate_argnums=tuple(i for i, p in enumerate(params) if p in donated))
        return call.lower(self.state, cache, *args)

    def build(self, specs, progress: bool = False, threads: int | None = None) -> float:
        """Compile every (name, flags, cache, args) of specs (arrays or jax.ShapeDtypeStructs) not
        built yet: traced one by one, compiled in threads. Returns the seconds it took."""
        t0 = time.perf_counter()
        todo = {}
        for name, flags, cache, args in specs:
            key = self.key(name, flags, cache, args)
            if key not in self.table and key not in todo:
                todo[key] = (name, key[1], cache, args)
        if self.jit and todo:
            bar = None
            if progress:
                from tqdm import tqdm
                bar = tqdm(total=len(todo), desc="compiling programs", unit="program")
            # executables kept by an earlier start are loaded in the threads; the rest are traced
            # and lowered here (Python: the GIL) and compiled there
            with concurrent.futures.ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
                kept = {key for key, spec in todo.items()
                        if self.store and os.path.exists(os.path.join(self.store, self._executable_name(*spec)))}
                futures = {pool.submit(self._read_executable, *spec): key for key, spec in todo.items() if key in kept}
                futures.update({pool.submit(self._compile, *spec, self._lower(*spec)): key
                                for key, spec in todo.items() if key not in kept})
                t1 = time.perf_counter()
                self.build_seconds["lower"] += t1 - t0
                for fut in concurrent.futures.as_completed(futures):
                    key = futures[fut]
                    exe = self._count_read(fut.result()) if key in kept else fut.result()
                    self.table[key] = exe or self._compile(*todo[key])  # an unreadable one is compiled again
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.close()
            self.build_seconds["compile"] += time.perf_counter() - t1
        self.warm = True
        return time.perf_counter() - t0

    def listing(self) -> list[str]:
        """One line a built program: its name, sampler flags and argument shapes."""
        out = []
        for name, flags, sig in sorted(self.table, key=str):
            shapes = " ".join("x".join(map(str, s)) or "()" for s, _ in sig)
            out.append(f"{name:12s} {flags_label(flags):24s} {shapes}")
        return out


def flags_label(flags: sampling.SamplerFlags) -> str:
    """A program's sampler flags as a word: the ones set, or 'greedy'."""
    return ",".join(k for k, v in flags._asdict().items() if v) or "greedy"


def _with_state(treedef, fn):
    """fn(state, ...) as a function of the state's leaves (same argument names after the first)."""
    @functools.wraps(fn)
    def with_leaves(leaves, *args, **kwargs):
        return fn(jax.tree.unflatten(treedef, leaves), *args, **kwargs)
    return with_leaves


def steps_while_alive(num_steps, body, init, alive):
    """lax.fori_loop(0, num_steps, body, init) left as soon as alive(carry) [B] holds no live row:
    steps after every row stopped (EOS, stop ids, max_tokens) would change nothing but cost a full
    step each, and a call chained after such a call now costs a launch, not its steps."""
    def cond(c):
        return (c[0] < num_steps) & jnp.any(alive(c[1]))

    def step(c):
        return c[0] + 1, body(c[0], c[1])
    return jax.lax.while_loop(cond, step, (jnp.int32(0), init))[1]


# -- the target-only step functions ----------------------------------------------------------------------
def _extend(graphdef, attn_impl, state, cache, tokens, next_tokens, page_table, kv_lens, q_lens, sb, flags):
    """tokens [B, T] at positions kv_len.. -> next token [B], its logprob [B], top-n, None (no
    draft tree), the next decode step's tokens [B, 1], cache. next_tokens serves device drafters only."""
    model = nnx.merge(graphdef, state)
    t = tokens.shape[1]
    positions = kv_lens[:, None] + jnp.arange(t)[None]
    h, cache, _ = model(tokens, positions, cache, page_table, kv_lens, q_lens, attn_impl=attn_impl)
    last = jnp.take_along_axis(h, jnp.maximum(q_lens - 1, 0)[:, None, None], axis=1)  # [B, 1, H]
    logits = model.logits(last)
    nxt = sampling.sample(logits, sb, flags)
    lp, top_v, top_i = sampling.logprobs_of(logits, nxt, flags.top_logprobs)
    squeeze = (lambda x: None if x is None else x[:, 0])
    return nxt[:, 0], lp[:, 0], squeeze(top_v), squeeze(top_i), None, nxt, cache


def _decode(graphdef, attn_impl, state, cache, tokens, page_table, kv_lens, budget, stop_ids, num_steps, sb, flags):
    """Up to num_steps (<= MAX_DECODE_STEPS, a device scalar) decode steps in one call: decode_loop's."""
    model = nnx.merge(graphdef, state)

    def forward(cache, tok, kv, q):
        h, cache, _ = model(tok, kv[:, None], cache, page_table, kv, q, attn_impl=attn_impl)
        return model.logits(h), cache, None
    return decode_loop(forward, None, cache, tokens, kv_lens, budget, stop_ids, num_steps, sb, flags)


def decode_loop(forward, keep, cache, tokens, kv_lens, budget, stop_ids, num_steps, sb, flags):
    """Up to num_steps (<= MAX_DECODE_STEPS, a device scalar) decode steps: forward(cache, tokens
    [B, 1], kv lengths [B], q_lens [B]) -> (logits [B, 1, V], cache, aux); keep(cache, aux, the
    sampled tokens [B, 1], kv lengths, q_lens) -> cache after each step's sample (a device drafter
    keeping its head in step), or None.

    tokens [B, 1]: each request's pending token (sampled, not yet cached). Row b emits at most
    budget[b] tokens (0: a padding row) and stops after a token in stop_ids[b] (-1 padded); a
    stopped row feeds no token (q_len 0), so its K/V and kv length stay put. Returns (tokens
    [B, MAX_DECODE_STEPS], count [B], logprobs [B, M], top-n values and ids [B, M, n] or None, None
    (no draft tree), (the last token [B, 1], kv lengths [B], the sampling batch a step on, tokens
    left [B]): the next call's inputs, in this call's donated input buffers, cache). The trip
    count is a device value, so one program serves every N; the token budget left comes back too,
    so that a call chained on this one needs nothing from the host."""
    b, m, k = tokens.shape[0], MAX_DECODE_STEPS, flags.top_logprobs
    out = jnp.zeros((b, m), jnp.int32)
    lps = jnp.zeros((b, m), jnp.float32)
    tops = (jnp.zeros((b, m, k), jnp.float32), jnp.zeros((b, m, k), jnp.int32)) if k else None

    def step(i, c):
        cache, tok, count, alive, out, lps, tops = c
        q = alive.astype(jnp.int32)
        # derived, not carried: at batch 1 XLA kept a copy of the carried lengths for the kernels
        # that read them inside the loop (cmdbuf_probe-NVIDIA-H200.json)
        kv = kv_lens + count
        logits, cache, aux = forward(cache, tok, kv, q)  # [B, 1, V]
        nxt = sampling.sample(logits, dataclasses.replace(sb, step=sb.step + count), flags)
        if keep is not None:
            cache = keep(cache, aux, nxt, kv, q)
        lp, top_v, top_i = sampling.logprobs_of(logits, nxt, k)
        out, lps = out.at[:, i].set(nxt[:, 0]), lps.at[:, i].set(lp[:, 0])
        if k:
            tops = (tops[0].at[:, i].set(top_v[:, 0]), tops[1].at[:, i].set(top_i[:, 0]))
        tok = jnp.where(alive[:, None], nxt, tok)
        count = count + q
        alive = alive & (count < budget) & ~jnp.any(nxt == stop_ids, axis=1)
        return cache, tok, count, alive, out, lps, tops

    count = jnp.zeros((b,), jnp.int32)
    init = (cache, tokens, count, budget > 0, out, lps, tops)
    cache, tok, count, alive, out, lps, tops = steps_while_alive(jnp.minimum(num_steps, m), step, init,
                                                                 lambda c: c[3])
    top_v, top_i = tops if k else (None, None)
    # a row that stopped has no budget left: a call chained on this one leaves it out at once
    return out, count, lps, top_v, top_i, None, (tok, kv_lens + count, dataclasses.replace(sb, step=sb.step + count),
                                                 jnp.where(alive, budget - count, 0)), cache


def _verify_tree(graphdef, attn_impl, state, cache, tokens, parents, page_table, kv_lens, num_nodes, sb, flags):
    """One speculative step over a draft tree (verify_and_accept); no next tree nor next step's
    inputs: the host drafts."""
    model = nnx.merge(graphdef, state)
    out, count, lp, top_v, top_i, _, _, _, cache = verify_and_accept(
        model, cache, tokens, parents, page_table, kv_lens, num_nodes, sb, flags, attn_impl)
    return out, count, lp, top_v, top_i, None, None, cache
