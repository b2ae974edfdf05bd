"""Training data for draft heads: the target writes its own prompts and answers them.

Generation here is a plain batched sampler: one dense cache page per request, fixed shapes so
it compiles once per run. It skips the serving engine on purpose: data generation is a
throughput job (thousands of sequences of the same length budget), where continuous batching,
paging and the per-step host bookkeeping buy nothing.
"""
from __future__ import annotations

import ast
import functools
import os
import sysconfig
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxspec.kv_cache import KVCache

# Generic openers for self-generated user prompts (diversity only; the target writes the rest). The
# seed-0 and seed-2 corpora in data/ were made with the first 30.
OPENERS = [
    "Write a Python function that", "Explain", "How do I", "What is the difference between", "Can you help me",
    "Give me a list of", "Write a short story about", "Summarize", "Why does", "Write an email to",
    "What are the benefits of", "Describe", "Write a poem about", "How can I improve", "Compare",
    "Write a JavaScript function to", "What happens when", "Plan a", "Translate into French:", "Solve:",
    "Write a SQL query that", "Give me tips for", "What is the best way to", "Tell me about", "Write a recipe for",
    "How does", "Write a bash script that", "List the steps to", "What should I know about", "Create a",
    # role play, extraction, rewriting, reasoning and maths: the kinds of request chat benchmarks hold,
    # as bare instruction verbs (the leak check in bench/probes/data_leak.py runs on every corpus)
    "Pretend you are", "Imagine you are", "Act as", "Compose", "Draft a", "Extract the", "Given the following",
    "Implement", "Calculate", "Suppose", "Rewrite", "Edit the following", "Analyze", "Evaluate", "Identify",
    "Which is", "Prove that", "Estimate", "Debug this", "Brainstorm",
]


# Subjects a system message names while the target invents a prompt (--topics): each opener meets
# each subject in turn, so that the invented prompts spread over more than the openers' few themes
# (the corpora before seed 4 were made without them). Written for this list, not taken from any
# benchmark; the leak check runs on the corpus as on the others.
TOPICS = [
    "photosynthesis", "black holes", "plate tectonics", "the immune system", "climate change", "volcanoes",
    "the water cycle", "DNA replication", "vaccines", "renewable energy", "the periodic table", "ocean currents",
    "the Roman Empire", "the Industrial Revolution", "ancient Egypt", "the Cold War", "the Renaissance",
    "the printing press", "the Silk Road", "the French Revolution", "medieval castles", "the Apollo program",
    "compound interest", "personal budgeting", "inflation", "the stock market", "starting a small business",
    "supply and demand", "cryptocurrency", "job interviews", "negotiating a salary", "remote work",
    "sorting algorithms", "binary search trees", "recursion", "REST APIs", "database indexes", "unit testing",
    "regular expressions", "memory leaks", "hash tables", "concurrency and threads", "git branches",
    "object-oriented design", "linked lists", "dynamic programming", "web accessibility", "password security",
    "prime numbers", "probability puzzles", "geometry of triangles", "linear equations", "percentages",
    "statistics and averages", "logic puzzles", "the Pythagorean theorem", "fractions", "matrices",
    "marathon training", "healthy breakfast ideas", "sleep habits", "meditation", "home workouts", "nutrition",
    "gardening tomatoes", "baking bread", "vegetarian cooking", "coffee brewing", "wine tasting", "spices",
    "travel in Japan", "a weekend in Paris", "hiking in the mountains", "camping gear", "road trips", "museums",
    "learning a new language", "public speaking", "time management", "writing a resume", "study techniques",
    "raising children", "adopting a dog", "caring for cats", "friendship", "moving to a new city", "weddings",
    "Shakespeare's plays", "poetry forms", "science fiction novels", "film noir", "jazz history",
    "classical music", "street photography", "oil painting", "video game design", "board games",
    "chess openings", "the Olympic Games", "soccer tactics", "basketball", "electric cars", "smartphones",
    "artificial intelligence", "social media", "online privacy", "space exploration", "robots",
    "philosophy of mind", "ethics of technology", "democracy", "human rights", "world religions", "mythology",
    "urban planning", "architecture", "fashion trends", "customer service", "marketing a product",
    "team leadership", "conflict at work", "email etiquette", "event planning", "volunteering",
]


def _pick(model, h, temperature, seeds, i, top_k: int):
    """Greedy where temperature is 0, else a Gumbel-max sample (top-k when top_k > 0); keyed by
    (seed, output position) so a row's sample does not depend on its batch."""
    logits = model.logits(h)
    if top_k:
        logits, ids = jax.lax.top_k(logits, top_k)
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), i))(seeds.astype(jnp.uint32))
    g = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:]))(keys)
    t = temperature[:, None]
    choice = jnp.argmax(jnp.where(t > 0, logits / jnp.maximum(t, 1e-6) + g, logits), axis=-1)
    return jnp.take_along_axis(ids, choice[:, None], 1)[:, 0] if top_k else choice.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k"), donate_argnames=("cache",))
def prefill(graphdef, state, cache, prompts, prompt_lens, temperature, seeds, *, top_k: int):
    """All prompts [B, P] (right-padded) into the cache (one page per request) -> (cache, first token)."""
    model = nnx.merge(graphdef, state)
    b, p = prompts.shape
    page_table = (1 + jnp.arange(b, dtype=jnp.int32))[:, None]
    positions = jnp.broadcast_to(jnp.arange(p)[None], (b, p))
    h, cache, _ = model(prompts, positions, cache, page_table, jnp.zeros(b, jnp.int32), prompt_lens, attn_impl="ref")
    last = jnp.take_along_axis(h, (prompt_lens - 1)[:, None, None], 1)[:, 0]
    return cache, _pick(model, last, temperature, seeds, 0, top_k)


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k"), donate_argnames=("cache",))
def decode(graphdef, state, cache, token, kv_lens, temperature, seeds, i, *, top_k: int):
    """One token per request at slot kv_lens -> (cache, the next token, output position i)."""
    model = nnx.merge(graphdef, state)
    b = token.shape[0]
    page_table = (1 + jnp.arange(b, dtype=jnp.int32))[:, None]
    h, cache, _ = model(token[:, None], kv_lens[:, None], cache, page_table, kv_lens, jnp.ones(b, jnp.int32),
                        attn_impl="ref")
    return cache, _pick(model, h[:, 0], temperature, seeds, i, top_k)


def generate_dense(target, prompts, prompt_lens, temperature, seeds, *, max_new_tokens: int, eos_ids, top_k=0):
    """prompts [B, P] right-padded, prompt_lens [B] (>= 1), temperature [B] (0: greedy), seeds [B]
    -> (new tokens [B, max_new_tokens], counts [B]: tokens up to and including the first EOS).

    A host loop of donated single-step programs, as the engine runs; dispatch is asynchronous, so
    the host does not wait between steps."""
    cfg = target.cfg
    graphdef, state = nnx.split(target)
    b, p = prompts.shape
    cache = KVCache.create(cfg.num_layers, b + 1, p + max_new_tokens, cfg.num_kv_heads, cfg.head_dim,
                           target.embed[...].dtype)
    cache, tok = prefill(graphdef, state, cache, prompts, prompt_lens, temperature, seeds, top_k=top_k)
    out = [tok]
    for i in range(1, max_new_tokens):  # dispatch is asynchronous: nothing waits on the device here
        cache, tok = decode(graphdef, state, cache, tok, prompt_lens + i - 1, temperature, seeds, i, top_k=top_k)
        out.append(tok)
    out = np.stack([np.asarray(t) for t in out], 1)
    is_eos = np.isin(out, np.asarray(eos_ids))
    counts = np.where(is_eos.any(1), np.argmax(is_eos, 1) + 1, max_new_tokens)
    return out, counts


def self_generate(target, prompts, temperatures, seed: int, max_new_tokens: int, eos_ids, batch: int,
                  top_k: int = 0, desc: str = "generate"):
    """Answer every prompt (lists of token ids) -> lists of new token ids (EOS kept, nothing after)."""
    plen = max(len(x) for x in prompts)
    plen = -(-plen // 32) * 32  # one prompt width for the whole run: one compile
    outs = []
    for s in tqdm(range(0, len(prompts), batch), desc=desc, mininterval=5):
        chunk = prompts[s:s + batch]
        toks = np.zeros((batch, plen), np.int32)
        lens = np.ones(batch, np.int32)
        temps = np.zeros(batch, np.float32)
        for i, x in enumerate(chunk):
            toks[i, :len(x)], lens[i], temps[i] = x, len(x), temperatures[s + i]
        seeds = np.arange(s, s + batch, dtype=np.uint32) + np.uint32(seed)
        out, counts = generate_dense(target, jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(temps),
                                     jnp.asarray(seeds), max_new_tokens=max_new_tokens, eos_ids=eos_ids, top_k=top_k)
        outs += [list(map(int, out[i, :counts[i]])) for i in range(len(chunk))]
    return outs


def eos_of(target, tokenizer):
    ids = set(target.cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def invent_prompts(target, tokenizer, n: int, seed: int, batch: int, max_tokens: int = 48,
                   topics: bool = False) -> list[str]:
    """User prompts written by the target: sampled (T=0.8) after the chat template's user header,
    each from an opener; with topics, after a system message naming one of TOPICS (opener i % O
    with topic (i // O) % len(TOPICS): every pair once before any twice). The prompt kept is the
    user text alone."""
    starts = [OPENERS[i % len(OPENERS)] for i in range(n)]
    subjects = [TOPICS[i // len(OPENERS) % len(TOPICS)] if topics else None for i in range(n)]
    headers = {t: user_header(tokenizer, t) for t in set(subjects)}
    ids = [tokenizer.encode(headers[t] + s, add_special_tokens=False) for s, t in zip(starts, subjects)]
    outs = self_generate(target, ids, np.full(n, 0.8), seed, max_tokens, eos_of(target, tokenizer), batch,
                         desc="invent prompts")
    eos = set(eos_of(target, tokenizer))
    texts = [(s + tokenizer.decode([t for t in o if t not in eos])).strip() for s, o in zip(starts, outs)]
    return [t for t, s in zip(texts, starts) if len(t) > len(s) + 8]


# Standard-library folders whose functions read as tests, demos or tooling rather than library code.
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages", "dist-packages",
              "__pycache__", "__phello__", "tkinter", "pydoc_data"}


def code_prompts(n: int, seed: int, root: str | None = None, max_chars: int = 600) -> list[str]:
    """Code-completion prompts from the running Python's standard library (root: another source tree):
    each function's or method's signature and docstring as its file has them, and again with the first
    half of a longer body, dedented (a completion model's prompt is a file's text, not a chat turn); at
    most n of them, distinct, shuffled by seed.
    The chat corpora never held raw code to complete, which the heads accepted least on."""
    root = root or sysconfig.get_paths()["stdlib"]
    texts = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                source = f.read()
            try:
                tree = ast.parse(source)
            except (SyntaxError, ValueError):
                continue
            lines = source.splitlines()
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(ast.get_docstring(node) or "") < 24:
                    continue
                # the docstring's end, and where the body has several statements its first half's too
                ends = [node.body[0].end_lineno] + ([node.body[len(node.body) // 2].end_lineno] if len(node.body) > 3 else [])
                for end in ends:
                    text = textwrap.dedent("\n".join(lines[node.lineno - 1:end])) + "\n"
                    if len(text) <= max_chars:
                        texts.add(text)
    texts = sorted(texts)
    order = np.random.default_rng(seed).permutation(len(texts))[:n]
    return [texts[i] for i in order]


def user_header(tokenizer, topic: str | None = None) -> str:
    """The chat template's text up to a user message's content (after a system message naming
    the topic, where one is given)."""
    marker = "\x00"
    system = [{"role": "system", "content": f"The user asks about {topic}."}] if topic else []
    templ = tokenizer.apply_chat_template(system + [{"role": "user", "content": marker}], tokenize=False,
                                          add_generation_prompt=False)
    return templ[:templ.index(marker)]


def answer_temperatures(n: int, sampled_fraction: float):
    """The temperature prompt i is answered at (0: greedy), spread evenly over the corpus."""
    return np.array([0.7 if (i * 7919 % 1000) / 1000 < sampled_fraction else 0.0 for i in range(n)])


def distill(target, prompts, max_new_tokens: int, sampled_fraction: float, seed: int, batch: int, eos_ids):
    """The target answers each prompt (token ids), greedily or at T=0.7 -> (sequences, prompt lengths)."""
    temps = answer_temperatures(len(prompts), sampled_fraction)
    outs = self_generate(target, prompts, temps, seed, max_new_tokens, eos_ids, batch, desc="answer prompts")
    return [p + o for p, o in zip(prompts, outs)], [len(p) for p in prompts]


def build_data(target, tokenizer, num_prompts: int, max_new_tokens: int, sampled_fraction: float, seed: int,
               batch: int, topics: bool = False, source: str = "chat"):
    """(sequences, prompt lengths) written by the target: chat prompts it invents (from openers, with
    topics from TOPICS too), or with source "code" the standard library's functions to complete
    (code_prompts, no chat template). Without a tokenizer (tests): random prompts."""
    if tokenizer is None:
        rng = np.random.default_rng(seed)
        prompts = [list(map(int, rng.integers(0, target.cfg.vocab_size, int(rng.integers(4, 16)))))
                   for _ in range(num_prompts)]
    elif source == "code":
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in code_prompts(num_prompts, seed)]
    else:
        texts = invent_prompts(target, tokenizer, num_prompts, seed, batch, topics=topics)
        prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                                  add_generation_prompt=True),
                                    add_special_tokens=False) for t in texts]
    return distill(target, prompts, max_new_tokens, sampled_fraction, seed, batch, eos_of(target, tokenizer))


def pack(seqs, seq_len: int):
    tokens = np.zeros((len(seqs), seq_len), np.int32)
    lengths = np.zeros(len(seqs), np.int32)
    for i, s in enumerate(seqs):
        s = s[:seq_len]
        tokens[i, :len(s)] = s
        lengths[i] = len(s)
    return tokens, lengths


def pack_rows(tokens, lengths, starts, row_len: int, seed: int = 0):
    """Sequences (rows of `tokens` [N, T] with `lengths`; the loss from index `starts`) packed into
    rows of row_len, best fit in a seeded order, so a batch carries less padding -> (tokens,
    segments: 0 padding, 1.. the k-th sequence of the row, positions restarting at each sequence,
    loss mask), each [R, row_len]."""
    if lengths.max() > row_len:
        raise ValueError(f"--pack-len {row_len} is shorter than a sequence ({int(lengths.max())} tokens)")
    order = np.random.default_rng(seed).permutation(len(lengths))
    rows_at = [[] for _ in range(row_len + 1)]  # rows by the room left in them
    room = np.zeros(row_len + 1, np.int64)  # how many rows have that much room
    members = []
    for i in order:
        n = int(lengths[i])
        fits = np.flatnonzero(room[n:])
        if len(fits):
            c = n + int(fits[0])
            r = rows_at[c].pop()
            room[c] -= 1
        else:
            c, r = row_len, len(members)
            members.append([])
        members[r].append(i)
        rows_at[c - n].append(r)
        room[c - n] += 1
    out = [np.zeros((len(members), row_len), np.int32) for _ in range(3)] + [np.zeros((len(members), row_len), bool)]
    for r, seqs in enumerate(members):
        at = 0
        for k, i in enumerate(seqs):
            n = int(lengths[i])
            out[0][r, at:at + n] = tokens[i, :n]
            out[1][r, at:at + n] = k + 1
            out[2][r, at:at + n] = np.arange(n)
            out[3][r, at + int(starts[i]):at + n] = True
            at += n
    return tuple(out)


def token_counts(tokens, lengths, vocab_size: int):
    """How often each id occurs in the sequences (rows of tokens, lengths long): [vocab_size]."""
    return np.bincount(tokens[np.arange(tokens.shape[1])[None] < lengths[:, None]], minlength=vocab_size)


def vocabulary_coverage(counts, ids) -> float:
    """The share of the counted tokens that are among ids."""
    return float(counts[ids].sum() / max(counts.sum(), 1))


def draft_vocabulary(tokens, lengths, vocab_size: int, size: int):
    """The `size` most frequent target ids in the data (sorted), FR-Spec's hot vocabulary, and its coverage."""
    counts = token_counts(tokens, lengths, vocab_size)
    hot = np.sort(np.argsort(-counts, kind="stable")[:size])
    return hot.astype(np.int32), vocabulary_coverage(counts, hot)
