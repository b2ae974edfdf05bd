"""Sampling parameters (host side) and the in-graph sampler.

Every request brings its own parameters; a batch carries them as arrays (`SamplingBatch`) so one
compiled program serves any mix. What must change the program (whether anything samples, filters
or penalises, how many top logprobs) is the static `SamplerFlags`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # HF style, over prompt and output
    frequency_penalty: float = 0.0  # OpenAI style, over output
    presence_penalty: float = 0.0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: chosen token only; n: also the top n

    MAX_TOP_LOGPROBS = 20

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        def bad(msg):
            raise ValueError(f"invalid sampling parameter: {msg}")

        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or not 1 <= self.max_tokens < 2**31:
            bad(f"max_tokens must be an integer in [1, 2**31), got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not -1 <= self.top_k < 2**31:
            bad(f"top_k must be an integer in [-1, 2**31) (0 or -1 disable it), got {self.top_k!r}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None:
            self.seed %= 2**32  # the draws' keys are 32-bit: any integer seed (negative, int64) is taken modulo
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= self.MAX_TOP_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {self.MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad(f"stop_token_ids entry {t!r} is not a token id in [0, {vocab_size})")
        return self

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


class SamplerFlags(NamedTuple):
    """Static: selects which parts of the sampler are compiled in."""
    sample: bool = False
    filter: bool = False
    penalties: bool = False
    top_logprobs: int = 0

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> "SamplerFlags":
        top = max((p.logprobs or 0 for p in params), default=0)
        sample = any(p.temperature > 0 for p in params)
        # a sampling batch always compiles the filters (off per row by its values), so that one
        # program serves every sampled mix: fewer programs to build at start-up
        return cls(sample=sample, filter=sample,
                   penalties=any(p.penalised for p in params),
                   top_logprobs=0 if top == 0 else (5 if top <= 5 else SamplingParams.MAX_TOP_LOGPROBS))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] i32, 0 = off
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array  # [B] u32
    step: jax.Array  # [B] i32: tokens generated so far, so keys never repeat within a request
    repetition_penalty: jax.Array
    frequency_penalty: jax.Array
    presence_penalty: jax.Array
    history: jax.Array  # [B, Hmax] i32 token ids (prompt then output), -1 padding; [B, 1] when unused
    num_prompt: jax.Array  # [B] i32: history[:num_prompt] is prompt

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds, steps, histories=None, num_prompt=None, pad_to=None):
        n = pad_to or len(params)
        pad = [SamplingParams()] * (n - len(params))
        ps = list(params) + pad

        def col(f, dt):
            return np.array([f(p) for p in ps], dt)

        if histories is None:
            hist = np.full((n, 1), -1, np.int32)
            nprompt = np.zeros(n, np.int32)
        else:
            width = 1 << max(1, int(np.ceil(np.log2(max(len(h) for h in histories) + 1))))
            hist = np.full((n, width), -1, np.int32)
            for i, h in enumerate(histories):
                hist[i, :len(h)] = h
            nprompt = np.zeros(n, np.int32)
            nprompt[:len(num_prompt)] = num_prompt
        return cls(
            temperature=col(lambda p: p.temperature, np.float32), top_k=col(lambda p: max(p.top_k, 0), np.int32),
            top_p=col(lambda p: p.top_p, np.float32), min_p=col(lambda p: p.min_p, np.float32),
            seed=np.array(list(seeds) + [0] * (n - len(params)), np.uint32),
            step=np.array(list(steps) + [0] * (n - len(params)), np.int32),
            repetition_penalty=col(lambda p: p.repetition_penalty, np.float32),
            frequency_penalty=col(lambda p: p.frequency_penalty, np.float32),
            presence_penalty=col(lambda p: p.presence_penalty, np.float32),
            history=hist, num_prompt=nprompt)


def apply_penalties(logits, sb: SamplingBatch, extra_tokens=None):
    """logits [B, N, V]. extra_tokens [B, N, K] (-1 padded): output tokens that precede node n
    beyond the history (a draft tree's ancestors), so each node sees its own prefix."""
    b, n, v = logits.shape
    h = sb.history
    idx = jnp.arange(h.shape[1])[None]
    is_out = (idx >= sb.num_prompt[:, None]) & (h >= 0)
    rows = jnp.arange(b)[:, None]
    seen = jnp.zeros((b, v), jnp.bool_).at[rows, jnp.maximum(h, 0)].max(h >= 0)
    out_counts = jnp.zeros((b, v), jnp.float32).at[rows, jnp.maximum(h, 0)].add(is_out.astype(jnp.float32))
    seen = jnp.broadcast_to(seen[:, None], (b, n, v))
    out_counts = jnp.broadcast_to(out_counts[:, None], (b, n, v))
    if extra_tokens is not None:
        rb = jnp.arange(b)[:, None, None]
        rn = jnp.arange(n)[None, :, None]
        valid = extra_tokens >= 0
        et = jnp.maximum(extra_tokens, 0)
        seen = seen.at[rb, rn, et].max(valid)
        out_counts = out_counts.at[rb, rn, et].add(valid.astype(jnp.float32))
    rp = sb.repetition_penalty[:, None, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - sb.frequency_penalty[:, None, None] * out_counts
    return logits - sb.presence_penalty[:, None, None] * (out_counts > 0)


def filter_logits(logits, sb: SamplingBatch):
    """top-k, top-p, min-p on temperature-scaled logits [B, N, V]."""
    v = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, v), v)[:, None, None]
    kth = jnp.take_along_axis(sorted_desc, k - 1, axis=-1)
    logits = jnp.where(logits < kth, NEG_INF, logits)
    sorted_desc = jnp.where(jnp.arange(v) < k, sorted_desc, NEG_INF)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    keep_sorted = (before < sb.top_p[:, None, None]) | (sb.top_p[:, None, None] >= 1.0)  # rounding must not cut top_p=1
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, NEG_INF, logits)
    # min-p: p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); renormalising changes neither side
    floor = jnp.where(sb.min_p[:, None, None] > 0,
                      sorted_desc[..., :1] + jnp.log(jnp.maximum(sb.min_p, 1e-30))[:, None, None], -jnp.inf)
    return jnp.where(logits < floor, NEG_INF, logits)


def sample(logits, sb: SamplingBatch, flags: SamplerFlags, extra_tokens=None, depth=None, max_depth=None):
    """logits [B, N, V] float32 -> tokens [B, N].

    The key of a draw is (seed, position in the output): step_b + depth[b, n]. A speculative step
    thus draws the token at each output position with the key plain decoding would use there, so a
    seeded request gives the same tokens with or without speculation, whatever trees were drafted;
    draws at different positions along any root path use distinct keys, which keeps it lossless.

    The draw and the filters run under a lax.cond on whether any row samples (filters): a greedy
    batch skips the [B, N, V] sort and random bits, so one program can serve greedy and sampled
    batches alike (programs.SHARED_SAMPLER). max_depth (static, > every node's depth): the nodes
    of one depth share their key, so the noise is drawn once a depth ([B, max_depth, V] random
    values instead of [B, N, V]: a 24-node tree of depth 6 draws 7 vectors a row, not 24).
    """
    if flags.penalties:
        logits = apply_penalties(logits, sb, extra_tokens)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not flags.sample:
        return greedy
    b, n = logits.shape[:2]
    depth = jnp.zeros((b, n), jnp.int32) if depth is None else depth

    def draw(logits):
        scaled = logits / jnp.maximum(sb.temperature, 1e-6)[:, None, None]
        if flags.filter:
            filtered = (sb.top_k > 0) | (sb.top_p < 1.0) | (sb.min_p > 0.0)
            scaled = jax.lax.cond(jnp.any(filtered & (sb.temperature > 0)), lambda s: filter_logits(s, sb),
                                  lambda s: s, scaled)
        draw_noise = jax.vmap(jax.vmap(functools.partial(gumbel_noise, vocab=logits.shape[-1]), (None, 0)))
        if max_depth is not None and max_depth < n:
            per_depth = draw_noise(sb.seed, sb.step[:, None] + jnp.arange(max_depth)[None])  # [B, D, V]
            noise = per_depth[jnp.arange(b)[:, None], jnp.minimum(depth, max_depth - 1)]
        else:
            noise = draw_noise(sb.seed, sb.step[:, None] + depth)
        drawn = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)  # Gumbel-max: a draw from softmax(scaled)
        return jnp.where(sb.temperature[:, None] > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(sb.temperature > 0), draw, lambda _: greedy, logits)


def gumbel_noise(seed, pos, vocab: int):
    """The Gumbel noise the draw at output position `pos` of a request seeded `seed` adds to its
    scaled logits ([vocab] float32; vmap it over rows): the target's draw and coupled drafts
    (coupled_draft_logits) share it."""
    return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), pos), (vocab,), jnp.float32)


def coupled_draft_logits(logits, sb: SamplingBatch, pos, vocab: int, ids=None):
    """A drafter's logits [B, ..., Vd] for the tokens the target will draw at output positions
    pos ([B], or [B, M] for logits [B, M, Vd]: one position per row of the middle axis), made as
    the target makes its draw: scaled by the row's temperature and perturbed by the same Gumbel
    noise (ids [Vd]: each draft id's target id; None: the same vocabulary). Where the drafter
    agrees with the target, the draft's argmax is then the token the target's draw picks
    (Gumbel-max coupling), not merely its most probable one: a sampled request accepts about as
    often as 1 - TV(draft, target) instead of the target's probability of the draft's argmax.
    Greedy rows keep their logits. Drafts stay proposals: verification is unchanged, so outputs
    are exactly plain sampling's."""
    sampled = sb.temperature > 0
    lead = (-1,) + (1,) * (logits.ndim - 2)

    def perturb(logits):
        noise = functools.partial(gumbel_noise, vocab=vocab)
        g = jax.vmap(noise)(sb.seed, pos) if pos.ndim == 1 else jax.vmap(jax.vmap(noise, (None, 0)))(sb.seed, pos)
        g = g if ids is None else g[..., ids]
        g = g.reshape(g.shape[:1] + (1,) * (logits.ndim - g.ndim) + g.shape[1:])
        t = jnp.where(sampled, sb.temperature, 1.0).reshape(lead + (1,))
        return jnp.where(sampled.reshape(lead + (1,)), logits / t + g, logits)

    return jax.lax.cond(jnp.any(sampled), perturb, lambda x: x, logits)


def logprobs_of(logits, tokens, top_n: int):
    """Log-probabilities under the model's raw distribution: chosen [B, N] and optional top-n."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    if top_n == 0:
        return chosen, None, None
    vals, ids = jax.lax.top_k(lp, top_n)
    return chosen, vals, ids
