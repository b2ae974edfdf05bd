"""EAGLE / EAGLE-3 / naive EAGLE: fused verify-accept-catch-up-draft step, lossless, checkpoint
layouts, training."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import Generator, SamplingParams, SpecConfig
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig, export_head, load_head
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.engine_thread import Engine
from jaxspec.models.loading import CheckpointError

from conftest import TINY, drafter_cache_after, run_mixed_requests_with_aborts, train_tiny_head

KW = dict(max_batch=8, max_seq_len=128, num_pages=300)


def random_prompts(seed, n, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, 62, int(rng.integers(lo, hi))))) for _ in range(n)]


def eagle_generator(model, head, tree, **kw):
    return Generator(model, None, drafter=EagleDrafter(head, tree), **{**KW, **kw})


def test_training_reduces_loss_and_export_round_trips(tiny_eagle3, tiny):
    rows = [json.loads(l) for l in open(tiny_eagle3 / "metrics.jsonl")]
    train = [r for r in rows if r["split"] == "train"]
    assert train[-1]["loss"] < 0.7 * train[0]["loss"]
    assert train[-1]["acc"][0] > train[0]["acc"][0] + 0.2
    card = json.load(open(tiny_eagle3 / "head" / "card.json"))
    assert card["steps"] == 80 and card["draft_vocab"] == 48
    # the exported file loads back to the same head outputs
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    data = np.load(tiny_eagle3 / "data.npz")
    assert data["tokens"].shape[0] == 96
    assert head.cfg.kind == "eagle3" and head.cfg.draft_vocab_size == 48
    assert sorted(set(np.asarray(head.draft_to_target[...]).tolist())) == np.asarray(head.draft_to_target[...]).tolist()


def test_training_data_generator_matches_engine_greedy(tiny):
    """The on-device data generator is plain decoding: greedy rows equal the engine's greedy output
    (cut after EOS), sampled rows differ from greedy somewhere and are seed-reproducible."""
    from jaxspec.train_data import self_generate
    prompts = random_prompts(11, 6, 1, 20)
    temps = np.array([0, 0, 0, 0, 1.0, 1.0])
    outs = self_generate(tiny, prompts, temps, 5, 12, [63], batch=4)
    gen = Generator(tiny, None, **KW)
    want = [c.token_ids for c in gen.generate(prompts, SamplingParams(max_tokens=12))]
    assert outs[:4] == want[:4]
    assert outs[4:] != want[4:]
    assert self_generate(tiny, prompts, temps, 5, 12, [63], batch=4) == outs
    assert all(len(o) == 12 or o[-1] == 63 for o in outs)


def test_invented_prompts_pair_each_opener_with_each_topic(tiny, monkeypatch):
    """With topics, the target writes each prompt after a system message naming a subject (opener
    i % O, subject i // O), and the prompt kept is its user text alone; without, the ids it writes
    after are the chat template's user header and the opener, as the committed corpora were made.
    SmolLM2's tokenizer and chat template; the target's writing is recorded, not run."""
    from jaxspec import train_data
    from jaxspec.models.gguf_file import GGUFFile
    from jaxspec.models.loading import gguf_tokenizer, resolve
    path = resolve("smollm2-135m")
    tok, target, seen = gguf_tokenizer(GGUFFile(path).metadata, path), tiny, []

    def fake_generate(target, ids, temps, seed, max_tokens, eos, batch, desc=""):
        seen.append([tok.decode(x) for x in ids])
        return [tok.encode(" the ideas in this request, in detail", add_special_tokens=False) for _ in ids]

    monkeypatch.setattr(train_data, "self_generate", fake_generate)
    o = len(train_data.OPENERS)
    plain = train_data.invent_prompts(target, tok, 2 * o, 0, 8)
    topical = train_data.invent_prompts(target, tok, 2 * o, 0, 8, topics=True)
    assert plain == topical and plain[o] == plain[0] and plain[0].startswith(train_data.OPENERS[0])
    assert "asks about" not in plain[0]
    templ = tok.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False)
    assert seen[0][0] == templ[:templ.index("\x00")] + train_data.OPENERS[0]
    for i in (0, 1, o, o + 1):
        subject = train_data.TOPICS[i // o]
        assert f"The user asks about {subject}." in seen[1][i] and seen[1][i].endswith(train_data.OPENERS[i % o])
        assert "asks about" not in seen[0][i]
    assert train_data.TOPICS[0] != train_data.TOPICS[1]


def test_code_prompts_are_signatures_and_docstrings_completed_without_chat(tiny, tmp_path, monkeypatch):
    """--prompts code: a source tree's documented functions and methods, dedented, cut after the
    docstring (and after half of a longer body), test folders and undocumented functions left out,
    shuffled by seed; the target answers their raw tokens, no chat template around them."""
    from jaxspec import train_data
    from jaxspec.models.gguf_file import GGUFFile
    from jaxspec.models.loading import gguf_tokenizer, resolve
    (tmp_path / "pkg").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        'def area(w, h):\n    """The area of a w by h rectangle, in square units."""\n    return w * h\n\n'
        'def bare(x):\n    return x\n\n'
        'class Box:\n    def grow(self, k):\n        """Scale every side of the box by the factor k."""\n'
        '        a = 1\n        b = 2\n        c = 3\n        return k\n')
    (tmp_path / "test" / "t.py").write_text('def check():\n    """A test of something or other, ignored."""\n')
    (tmp_path / "pkg" / "broken.py").write_text("def (:\n")
    got = train_data.code_prompts(10, 0, root=str(tmp_path))
    assert sorted(got) == sorted([
        'def area(w, h):\n    """The area of a w by h rectangle, in square units."""\n',
        'def grow(self, k):\n    """Scale every side of the box by the factor k."""\n',
        'def grow(self, k):\n    """Scale every side of the box by the factor k."""\n    a = 1\n    b = 2\n'])
    assert train_data.code_prompts(2, 0, root=str(tmp_path)) == got[:2]
    assert {tuple(train_data.code_prompts(10, s, root=str(tmp_path))) for s in range(6)} != {tuple(got)}

    path = resolve("smollm2-135m")
    tok, seen = gguf_tokenizer(GGUFFile(path).metadata, path), []
    monkeypatch.setattr(train_data, "code_prompts", lambda n, seed: got[:n])
    monkeypatch.setattr(train_data, "self_generate",
                        lambda target, ids, temps, *a, **k: seen.extend(ids) or [[7, 8] for _ in ids])
    seqs, plens = train_data.build_data(tiny, tok, 2, 4, 0.25, 0, 8, source="code")
    assert [tok.decode(s) for s in seen] == got[:2] and plens == [len(s) for s in seen]
    assert seqs == [s + [7, 8] for s in seen]


def test_training_resumes_from_checkpoint(tmp_path, tiny):
    head_a, step = train_tiny_head(tmp_path / "a", "eagle", tiny, steps=6)
    assert step == 6
    from jaxspec import train
    # a run stopped by --max-minutes resumes where its checkpoint left off
    argv = ["--run", str(tmp_path / "a"), "--kind", "eagle", "--steps", "9", "--batch", "8", "--ttt", "3",
            "--seq-len", "64", "--save-every", "1000", "--log-every", "3"]
    _, step = train.train(train.parse_args(argv), tiny)
    assert step == 9
    steps = [json.loads(l)["step"] for l in open(tmp_path / "a" / "metrics.jsonl") if '"train"' in l]
    assert steps == [6, 9]  # the second run logged steps 7-9 only: nothing retrained



def test_training_goes_on_from_an_exported_head(tmp_path, tiny, tiny_eagle3):
    """--init-from starts from a shipped head on new data: its first logged accuracy is the trained
    head's, far above a fresh head's, and its draft vocabulary is kept (not recounted)."""
    from jaxspec import train
    base = ["--kind", "eagle3", "--num-prompts", "48", "--max-new-tokens", "40", "--seq-len", "64", "--steps", "2",
            "--batch", "8", "--ttt", "3", "--draft-vocab", "48", "--log-every", "1", "--save-every", "1000",
            "--gen-batch", "48", "--lr", "1e-5", "--seed", "7", "--export-dtype", "float32"]
    argv = base + ["--run", str(tmp_path / "on"), "--init-from", str(tiny_eagle3 / "head"), "--export",
                   str(tmp_path / "on" / "head")]
    train.train(train.parse_args(argv), tiny)
    train.train(train.parse_args(base + ["--run", str(tmp_path / "fresh")]), tiny)
    first = lambda run: [json.loads(l) for l in open(tmp_path / run / "metrics.jsonl")][0]["acc"][0]
    assert first("on") > first("fresh") + 0.2
    shipped = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    went_on = load_head(str(tmp_path / "on" / "head"), TINY, tiny)
    assert np.array_equal(np.asarray(went_on.draft_to_target[...]), np.asarray(shipped.draft_to_target[...]))
    assert json.load(open(tmp_path / "on" / "head" / "card.json"))["init_from"] == "head"  # no machine path

def test_growing_the_draft_vocabulary_keeps_the_head_and_adds_the_target_rows(tiny):
    """grow_draft_vocab: the head's own ids and lm_head rows kept, the most frequent others added
    with their target rows mapped as the head's own were, every other weight the same; it never shrinks."""
    from jaxspec.train_eagle import grow_draft_vocab
    rng = np.random.default_rng(0)
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3", draft_vocab_size=16), rngs=nnx.Rngs(5))
    old = np.sort(rng.choice(TINY.vocab_size, 16, replace=False)).astype(np.int32)
    head.draft_to_target[...] = jnp.asarray(old)
    counts = rng.integers(0, 1000, TINY.vocab_size)
    grown = grow_draft_vocab(head, tiny, counts, 40)
    hot = np.asarray(grown.draft_to_target[...])
    added = np.setdiff1d(hot, old)
    others = np.setdiff1d(np.arange(TINY.vocab_size), old)
    assert grown.cfg.draft_vocab_size == 40 and len(hot) == 40 and np.all(np.diff(hot) > 0) and np.isin(old, hot).all()
    assert set(added) == set(others[np.argsort(-counts[others], kind="stable")][:24])  # the most frequent others
    lm = np.asarray(grown.lm_head[...])
    assert np.array_equal(lm[:, np.searchsorted(hot, old)], np.asarray(head.lm_head[...]))
    target_rows = np.asarray(tiny.embed[...], np.float32).T
    fit, *_ = np.linalg.lstsq(target_rows[:, old].T, np.asarray(head.lm_head[...]).T, rcond=None)
    assert np.allclose(lm[:, np.searchsorted(hot, added)], (target_rows[:, added].T @ fit).T, atol=1e-5)
    for name in ("fc", "wqkv", "wo", "w_gate_up", "w_down", "input_norm", "hidden_norm", "norm"):
        assert np.array_equal(np.asarray(getattr(grown, name)[...]), np.asarray(getattr(head, name)[...]))
    with pytest.raises(ValueError, match="has 16 ids; it can only grow"):
        grow_draft_vocab(head, tiny, counts, 8)


def test_widening_the_head_mlp_keeps_what_it_computes_and_lets_the_new_units_learn():
    """grow_intermediate: the layer's output unchanged (new down rows zero), every other weight the
    same, and the loss's gradient reaches the new units' down rows; it never shrinks."""
    from jaxspec.train_eagle import grow_intermediate
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3", draft_vocab_size=16), rngs=nnx.Rngs(5))
    F = head.cfg.intermediate_size
    grown = grow_intermediate(head, 2 * F, seed=1)
    assert grown.cfg.intermediate_size == 2 * F and grown.w_down[...].shape == (2 * F, TINY.hidden_size)
    rng = np.random.default_rng(0)
    attn = jnp.asarray(rng.normal(size=(2, 3, head.cfg.num_heads, head.cfg.head_dim)), jnp.float32)
    residual = jnp.asarray(rng.normal(size=(2, 3, TINY.hidden_size)), jnp.float32)
    assert np.allclose(grown.finish(attn, residual), head.finish(attn, residual), atol=1e-5)
    for name in ("fc", "wqkv", "wo", "lm_head", "draft_to_target", "input_norm", "hidden_norm", "norm", "post_norm"):
        assert np.array_equal(np.asarray(getattr(grown, name)[...]), np.asarray(getattr(head, name)[...]))
    down = nnx.grad(lambda m: jnp.sum(m.finish(attn, residual) ** 2))(grown).w_down[...]
    assert np.abs(np.asarray(down[F:])).max() > 0
    with pytest.raises(ValueError, match=f"has {F} units; it can only grow"):
        grow_intermediate(head, F, seed=1)


TREES = [TreeShape(3, 2, 6), TreeShape(1, 1, 2), TreeShape(4, 1, 5), TreeShape(3, 4, 16)]


@pytest.mark.parametrize("tree,ps", [(t, 4) for t in TREES] + [(TREES[0], 16)], ids=str)
def test_eagle3_greedy_equals_plain(tiny, tiny_eagle3, tree, ps):
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    prompts = random_prompts(ps + tree.num_draft_tokens, 9)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Generator(tiny, None, page_size=ps, **KW).generate(prompts, params)
    gen = eagle_generator(tiny, head, tree, page_size=ps)
    spec = gen.generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert np.mean([c.mean_accept_length for c in spec]) > 1.5  # the trained head's drafts are accepted
    assert gen.scheduler.pool.in_use == 0


def test_shapes_switched_between_calls_keep_outputs_plain(tiny, tiny_eagle3):
    """spec_policy='auto' moving between a chain, a deep tree and a wide one (the last call's draft
    cut to the next program's nodes and depth, on the device where the call chains on the last),
    with a trained head whose drafts are accepted: greedy output is plain decoding's, and sampled
    output is plain sampling's with the same seeds (one engine for both, as a server has)."""
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    prompts = random_prompts(21, 6)
    trees = (TreeShape(1, 1, 2), TreeShape(4, 1, 5), TreeShape(2, 4, 8))
    plain_gen = Generator(tiny, None, **KW)
    gen = eagle_generator(tiny, head, trees[1], max_batch=4, spec_policy="auto", spec_trees=trees)
    turns = iter([trees[1], trees[1], trees[2], trees[0], trees[1], trees[2], trees[2]] * 200)
    gen.scheduler.spec_policy.choose = lambda rows, keys=None: next(turns)
    for temperature in (0.0, 1.0):
        switches = gen.scheduler.stats["chained_switches"]
        params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=temperature, seed=i) for i in range(6)]
        plain = plain_gen.generate(prompts, params)
        spec = gen.generate(prompts, params)
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain], temperature
        assert gen.scheduler.stats["chained_switches"] - switches >= 3  # changes chain on the last call's drafts
        assert gen.scheduler.pool.in_use == 0
    accepted = {t.label: max(c) for t, c in gen.scheduler.spec_policy.accepts.items()}
    assert set(accepted) == {t.label for t in trees} and accepted["4:1:5"] >= 3 and accepted["2:4:8"] >= 2
    assert gen.scheduler.late_compiles == []
    info = json.loads(json.dumps(Engine(gen, start=False).snapshot(detail=True)))  # the server's /server_info
    assert set(info["spec_policy"]["accept_histogram"]) == set(accepted)
    assert info["scheduler"]["chained_switches"] == gen.scheduler.stats["chained_switches"] >= 6
    # a step a call, each call of the other shape: every step verifies the last call's drafts, cut,
    # and tells the policy nothing of its own shape (but a request's first, on its prefill's drafts)
    policy, recorded, calls = gen.scheduler.spec_policy, [], gen.scheduler.stats["verify_steps"]
    flip, verified = iter(trees[1:] * 400), policy.verified
    policy.choose = lambda rows, keys=None: next(flip)
    policy.verified = lambda tree, emitted, *a, **k: (recorded.append(len(emitted)), verified(tree, emitted, *a, **k))
    gen.scheduler.verify_steps = 1
    gen.generate(prompts, [SamplingParams(max_tokens=20, ignore_eos=True)] * len(prompts))
    assert gen.scheduler.stats["verify_steps"] - calls >= 12 and sum(recorded) <= len(prompts)


def test_plain_spells_of_the_auto_policy_keep_the_head_in_step(tiny, tiny_eagle3):
    """The auto policy's plain decoding (eagle_step.decode) writes the head's K/V as the verify
    path would, so trees can come back: outputs stay plain's, greedy and sampled; the head's cache
    over a request's tokens matches an engine's that never decoded plainly; its drafts are accepted
    after each plain spell; the root verified alone after one is kept out of the accept statistics.
    Each change between a tree and plain decoding chains on the last call (no tree follows a tree here)."""
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    prompts = random_prompts(21, 6)
    trees = (TreeShape(4, 1, 5), TreeShape(2, 4, 8))
    plain_gen = Generator(tiny, None, **KW)
    gens = [eagle_generator(tiny, head, trees[0], max_batch=4, spec_policy="auto", spec_trees=trees) for _ in range(2)]
    gens[0].scheduler.spec_policy.choose = lambda rows, keys=None: trees[0]
    turns = iter([None, None, trees[1], None, trees[0], trees[0], None] * 300)
    gens[1].scheduler.spec_policy.choose = lambda rows, keys=None: next(turns)
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=temperature, seed=i) for i in range(6)]
        switches = gens[1].scheduler.stats["chained_switches"]
        spec = gens[1].generate(prompts, params)
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain_gen.generate(prompts, params)], temperature
        assert gens[1].scheduler.pool.in_use == 0
        assert gens[1].scheduler.stats["chained_switches"] - switches >= 3
    assert min(a for t, a in gens[1].scheduler.spec_policy.emitted.items()) > 1.5  # no root-alone step counted
    assert gens[1].scheduler.late_compiles == []
    k, reqs = drafter_cache_after(gens, prompts[0])
    np.testing.assert_allclose(k[1], k[0], atol=1e-5)
    assert np.mean(reqs[1].accept_lengths[1:]) > 1.5


def test_eagle_head_greedy_equals_plain_and_debug_mode_agrees(tiny):
    head = DraftHead(HeadConfig.for_target(TINY, "eagle"), rngs=nnx.Rngs(5))
    prompts = random_prompts(1, 3)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = Generator(tiny, None, **KW).generate(prompts, params)
    jitted = eagle_generator(tiny, head, TreeShape(2, 2, 4)).generate(prompts, params)
    eager = eagle_generator(tiny, head, TreeShape(2, 2, 4), jit=False).generate(prompts, params)
    assert [c.token_ids for c in jitted] == [c.token_ids for c in plain] == [c.token_ids for c in eager]
    assert [c.accept_lengths for c in jitted] == [c.accept_lengths for c in eager]


def test_eagle_overlapped_and_multi_step_calls_equal_synchronous(tiny):
    """The next verify call launched from the last one's device tree (before it is read back), and
    up to 4 verify steps a call, give the synchronous one-step scheduler's tokens and accept
    lengths, greedy and sampled, with max_tokens and a stop id falling inside a call."""
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3", draft_vocab_size=48), rngs=nnx.Rngs(5))
    prompts = random_prompts(4, 4)
    free = eagle_generator(tiny, head, TreeShape(3, 2, 6)).generate(
        prompts[:1], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    for params in ([SamplingParams(max_tokens=40, ignore_eos=True)] * 3 + [SamplingParams(max_tokens=13, ignore_eos=True)],
                   SamplingParams(max_tokens=60, temperature=4.0, seed=2, ignore_eos=True),
                   SamplingParams(max_tokens=40, stop_token_ids=[free.token_ids[17]])):
        sync = eagle_generator(tiny, head, TreeShape(3, 2, 6), overlap=False, decode_steps=1).generate(prompts, params)
        for kw in (dict(decode_steps=1), {}):
            gen = eagle_generator(tiny, head, TreeShape(3, 2, 6), **kw)
            over = gen.generate(prompts, params)
            assert [c.token_ids for c in over] == [c.token_ids for c in sync]
            assert [c.accept_lengths for c in over] == [c.accept_lengths for c in sync]
            assert [c.finish_reason for c in over] == [c.finish_reason for c in sync]
            assert gen.scheduler.stats["chained_steps"] > 2 and gen.scheduler.pool.in_use == 0
        calls = gen.scheduler.stats["verify_steps"]
        assert calls < sum(len(c.accept_lengths or []) for c in over) / 2  # several steps a call


def test_draft_tree_is_parent_first_with_distinct_siblings(tiny, tiny_eagle3):
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    gen = eagle_generator(tiny, head, TreeShape(3, 4, 16))
    reqs = [gen.submit(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in random_prompts(3, 4)]
    seen = 0
    while gen.scheduler.has_work:
        gen.scheduler.step()
        for r in reqs:
            if r.draft is None:
                continue
            tok, par = map(np.asarray, r.draft)
            assert par[0] == -1 and all(0 <= par[i] < i for i in range(1, len(par)))
            for p in set(par[1:].tolist()):
                kids = tok[1:][par[1:] == p]
                assert len(set(kids.tolist())) == len(kids)
            assert tok[0] == r.output_ids[-1]  # the root is the pending token
            seen += 1
    assert seen > 4


def test_eagle3_sampling_is_lossless(tiny, tiny_eagle3):
    """Seeded sampling: speculative draws equal plain draws (keys follow output positions), and a
    chi-square of the sampled second token against its exact marginal under the target."""
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    prompt, n = [5, 9, 5, 9, 5], 1000
    ps = [SamplingParams(max_tokens=2, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    kw = dict(max_batch=64, num_pages=1200, page_size=4, max_seq_len=64)
    gen = eagle_generator(tiny, head, TreeShape(2, 2, 4), spec_max_verify_tokens=4096, **kw)
    spec = [o.token_ids for o in gen.generate([prompt] * n, ps)]
    plain = [o.token_ids for o in Generator(tiny, None, **kw).generate([prompt] * n, ps)]
    assert spec == plain
    assert gen.scheduler.stats["emitted"] > gen.scheduler.stats["verify_steps"]
    # exact marginal of the second token: sum over first tokens of p(x1) p(x2 | x1)
    p1 = _full_dist(tiny, prompt)
    p2 = sum(p1[a] * _full_dist(tiny, prompt + [a]) for a in range(TINY.vocab_size))
    counts = np.bincount([t[1] for t in spec], minlength=TINY.vocab_size)
    expected = n * p2
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    stat, dof = ((obs - exp) ** 2 / exp).sum(), len(obs) - 1
    assert stat < dof + 4 * np.sqrt(2 * dof), (stat, dof)
    # power: the first token's distribution is not the second's
    wrong = n * p1
    assert ((counts[keep] - wrong[keep]) ** 2 / np.maximum(wrong[keep], 1e-9)).sum() > dof + 4 * np.sqrt(2 * dof)


def _full_dist(model, prompt):
    from jaxspec.kv_cache import KVCache
    cfg = model.cfg
    t = len(prompt)
    cache = KVCache.create(cfg.num_layers, 2, 64, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    h, _, _ = model(jnp.asarray([prompt]), jnp.arange(t)[None], cache, jnp.ones((1, 1), jnp.int32),
                    jnp.zeros(1, jnp.int32), jnp.full((1,), t, jnp.int32))
    return np.asarray(jax.nn.softmax(model.logits(h[0, -1])), np.float64)


def test_stops_inside_accepted_runs_and_max_tokens_one(tiny, tiny_eagle3):
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    prompts = random_prompts(7, 5)
    plain = Generator(tiny, None, page_size=4, **KW).generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    gen = eagle_generator(tiny, head, TreeShape(4, 2, 8), page_size=4)
    for p, ref in zip(prompts, plain):
        stop = ref.token_ids[12]
        got = gen.generate([p], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]))[0]
        assert got.token_ids == ref.token_ids[: ref.token_ids.index(stop) + 1] and got.finish_reason == "stop"
        got = gen.generate([p], SamplingParams(max_tokens=7, ignore_eos=True, logprobs=0))[0]
        assert got.token_ids == ref.token_ids[:7] and got.finish_reason == "length" and len(got.logprobs) == 7
        got = gen.generate([p], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        assert got.token_ids == ref.token_ids[:1]
    assert gen.scheduler.pool.in_use == 0


def test_logprobs_and_penalties_match_plain(tiny, tiny_eagle3):
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    prompts = random_prompts(11, 4)
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3, repetition_penalty=1.3, presence_penalty=0.5)
    plain = Generator(tiny, None, **KW).generate(prompts, params)
    spec = eagle_generator(tiny, head, TreeShape(3, 2, 6)).generate(prompts, params)
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_no_leaked_pages_after_many_mixed_requests(tiny, tiny_eagle3):
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    rng = np.random.default_rng(9)
    gen = eagle_generator(tiny, head, TreeShape(2, 2, 4), max_batch=32, max_seq_len=64, num_pages=120, page_size=4)
    run_mixed_requests_with_aborts(gen, rng)


# -- checkpoint layouts ----------------------------------------------------------------------------------
def torch_eagle3_reference(sd, cfg, emb, hidden, positions):
    """SGLang's LlamaForCausalLMEagle3 forward for a single sequence (causal), written with torch
    from its checkpoint names: an independent reading of the layout."""
    import torch
    t = lambda k: torch.tensor(np.asarray(sd[k], np.float32))
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w
    h = torch.tensor(hidden) @ t("fc.weight").T
    e = rms(torch.tensor(emb), t("midlayer.input_layernorm.weight"))
    x = torch.cat([e, rms(h, t("midlayer.hidden_norm.weight"))], -1)
    n, d = len(positions), cfg.head_dim
    q = (x @ t("midlayer.self_attn.q_proj.weight").T).view(n, cfg.num_heads, d)
    k = (x @ t("midlayer.self_attn.k_proj.weight").T).view(n, cfg.num_kv_heads, d)
    v = (x @ t("midlayer.self_attn.v_proj.weight").T).view(n, cfg.num_kv_heads, d)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
    ang = torch.tensor(positions).float()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = lambda z: torch.cat([-z[..., d // 2:], z[..., :d // 2]], -1)
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    g = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    att = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    att = att.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), -1e30).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1) @ t("midlayer.self_attn.o_proj.weight").T
    r = h + o
    m = rms(r, t("midlayer.post_attention_layernorm.weight"))
    gate, up = m @ t("midlayer.mlp.gate_proj.weight").T, m @ t("midlayer.mlp.up_proj.weight").T
    m = (torch.nn.functional.silu(gate) * up) @ t("midlayer.mlp.down_proj.weight").T
    logits = rms(m + r, t("norm.weight")) @ t("lm_head.weight").T
    return logits.numpy(), (np.arange(len(sd["d2t"])) + np.asarray(sd["d2t"], np.int64))


def test_sglang_eagle3_layout_matches_torch_reading(tmp_path, tiny):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    cfg = HeadConfig.for_target(TINY, "eagle3", draft_vocab_size=16)
    rng = np.random.default_rng(0)
    H, hq, hk = TINY.hidden_size, TINY.num_heads * TINY.head_dim, TINY.num_kv_heads * TINY.head_dim
    shapes = {"fc.weight": (H, 3 * H), "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
              "midlayer.self_attn.q_proj.weight": (hq, 2 * H), "midlayer.self_attn.k_proj.weight": (hk, 2 * H),
              "midlayer.self_attn.v_proj.weight": (hk, 2 * H), "midlayer.self_attn.o_proj.weight": (H, hq),
              "midlayer.post_attention_layernorm.weight": (H,), "midlayer.mlp.gate_proj.weight": (64, H),
              "midlayer.mlp.up_proj.weight": (64, H), "midlayer.mlp.down_proj.weight": (H, 64),
              "norm.weight": (H,), "lm_head.weight": (16, H)}
    sd = {k: torch.tensor(rng.normal(0, 0.2, s).astype(np.float32) + (1.0 if len(s) == 1 else 0.0)) for k, s in shapes.items()}
    hot = np.sort(rng.choice(TINY.vocab_size, 16, replace=False))
    sd["d2t"] = torch.tensor(hot - np.arange(16), dtype=torch.int64)
    t2d = np.zeros(TINY.vocab_size, bool)
    t2d[hot] = True
    sd["t2d"] = torch.tensor(t2d)
    save_file(sd, str(tmp_path / "model.safetensors"))
    json.dump({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "num_attention_heads": TINY.num_heads,
               "head_dim": TINY.head_dim,
               "num_key_value_heads": TINY.num_kv_heads, "intermediate_size": 64, "num_hidden_layers": 1,
               "vocab_size": TINY.vocab_size, "draft_vocab_size": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}},
              open(tmp_path / "config.json", "w"))
    head = load_head(str(tmp_path), TINY, tiny)
    assert head.cfg.feature_layers == (0, 0, 1) and not head.cfg.fc_bias
    n = 7
    emb = rng.normal(size=(n, H)).astype(np.float32)
    hidden = rng.normal(size=(n, 3 * H)).astype(np.float32)
    ref_logits, ref_d2t = torch_eagle3_reference({k: v.numpy() for k, v in sd.items()}, cfg, emb, hidden, list(range(n)))
    # ours: fc'd features, dense causal attention
    from jaxspec.train_eagle import ttt_attention
    q, k, v, res = head.qkv(jnp.asarray(emb)[None], jnp.asarray(hidden)[None] @ head.fc[...], jnp.arange(n)[None])
    out = head.finish(ttt_attention(q, [k], [v]), res)
    np.testing.assert_allclose(np.asarray(head.logits(tiny, out))[0], ref_logits, atol=2e-4, rtol=2e-4)
    np.testing.assert_array_equal(np.asarray(head.to_target(jnp.arange(16))), ref_d2t)
    # export writes the same layout back
    export_head(head, str(tmp_path / "again"), TINY)
    again = load_head(str(tmp_path / "again"), TINY, tiny)
    for name in ("fc", "wqkv", "w_gate_up", "lm_head", "draft_to_target"):
        np.testing.assert_array_equal(np.asarray(getattr(again, name)[...]), np.asarray(getattr(head, name)[...]))


def test_safeailab_eagle_bin_layout_loads(tmp_path, tiny):
    torch = pytest.importorskip("torch")
    H, hq, hk = TINY.hidden_size, TINY.num_heads * TINY.head_dim, TINY.num_kv_heads * TINY.head_dim
    rng = np.random.default_rng(1)
    shapes = {"fc.weight": (H, 2 * H), "fc.bias": (H,), "layers.0.self_attn.q_proj.weight": (hq, H),
              "layers.0.self_attn.k_proj.weight": (hk, H), "layers.0.self_attn.v_proj.weight": (hk, H),
              "layers.0.self_attn.o_proj.weight": (H, hq), "layers.0.post_attention_layernorm.weight": (H,),
              "layers.0.mlp.gate_proj.weight": (64, H), "layers.0.mlp.up_proj.weight": (64, H),
              "layers.0.mlp.down_proj.weight": (H, 64), "embed_tokens.weight": (TINY.vocab_size, H)}
    sd = {k: torch.tensor(rng.normal(0, 0.2, s).astype(np.float32)).to(torch.bfloat16 if "mlp" in k else torch.float32)
          for k, s in shapes.items()}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_attention_heads": TINY.num_heads,
               "head_dim": TINY.head_dim,
               "num_key_value_heads": TINY.num_kv_heads, "intermediate_size": 64, "num_hidden_layers": 1,
               "vocab_size": TINY.vocab_size, "bias": True}, open(tmp_path / "config.json", "w"))
    head = load_head(str(tmp_path), TINY, tiny)
    assert head.cfg.kind == "eagle" and head.cfg.fc_bias
    np.testing.assert_array_equal(np.asarray(head.fc[...]), sd["fc.weight"].numpy().T)
    np.testing.assert_array_equal(np.asarray(head.w_gate_up[...])[:, 64:], sd["layers.0.mlp.up_proj.weight"].float().numpy().T)
    np.testing.assert_array_equal(np.asarray(head.fc_bias[...]), sd["fc.bias"].numpy())
    # and it drafts losslessly
    prompts = random_prompts(4, 3)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    assert ([c.token_ids for c in eagle_generator(tiny, head, TreeShape(2, 2, 4)).generate(prompts, params)]
            == [c.token_ids for c in Generator(tiny, None, **KW).generate(prompts, params)])


def test_bad_draft_checkpoints_and_options_are_named(tmp_path, tiny, tiny_eagle3):
    with pytest.raises(CheckpointError, match="no such directory"):
        load_head(str(tmp_path / "nope"), TINY, tiny)
    other = dataclasses.replace(TINY, hidden_size=48, head_dim=12)
    with pytest.raises(CheckpointError, match="hidden_size 32 != target's 48"):
        load_head(str(tiny_eagle3 / "head"), other)
    with pytest.raises(ValueError, match="holds an EAGLE3 head"):
        SpecConfig(algorithm="EAGLE", draft_model_path=str(tiny_eagle3 / "head")).build(tiny)
    with pytest.raises(ValueError, match="needs draft_model_path"):
        SpecConfig(algorithm="EAGLE3").build(tiny)
    with pytest.raises(ValueError, match="exceeds the 7 nodes"):
        TreeShape(2, 2, 8)
    naive = SpecConfig(algorithm="NAIVE_EAGLE", draft_model_path=str(tiny_eagle3 / "head")).build(tiny)
    assert (naive.tree.steps, naive.tree.topk, naive.tree.num_draft_tokens) == (1, 1, 2)


def test_large_batch_fallback_decodes_plainly_and_later_requests_draft(tiny, tiny_eagle3):
    """Above spec_max_verify_tokens / nodes requests the step falls back to the target alone; a
    request decoded plainly stays plain (its head is behind), while later requests draft trees
    again, also over prefix-cached pages. Output stays the plain greedy output."""
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    prompts = random_prompts(21, 8)
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(8)]
    plain = Generator(tiny, None, **KW).generate(prompts, params)
    gen = eagle_generator(tiny, head, TreeShape(2, 2, 4), spec_max_verify_tokens=16)
    spec = gen.generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert all(c.accept_lengths is None for c in spec)  # batch 8 x 4 nodes > 16: plain throughout
    assert gen.scheduler.stats["verify_steps"] == 0
    later = gen.generate(prompts[:2], params[:2])  # batch 2 x 4 nodes fits
    assert [c.token_ids for c in later] == [c.token_ids for c in plain[:2]]
    assert gen.scheduler.stats["verify_steps"] > 0 and max(c.mean_accept_length for c in later) > 1
    assert gen.scheduler.pool.in_use == 0



def test_prefill_at_a_bucket_without_a_tree_runs_the_target_alone(tiny, tiny_eagle3):
    """Where the running batch's bucket gets no tree, a prefill chunk skips the head (its catch-up
    and first draft would be thrown away by the plain steps that follow): only the target's
    extend program runs, the heads are behind from the prompt on, greedy output is plain's, and
    a later small batch drafts again."""
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    prompts = random_prompts(22, 8, 20, 50)
    params = [SamplingParams(max_tokens=5 + 2 * i, ignore_eos=True) for i in range(8)]
    plain_gen = Generator(tiny, None, **KW)
    plain = plain_gen.generate(prompts, params)
    gen = eagle_generator(tiny, head, TreeShape(2, 2, 4), spec_max_verify_tokens=16)
    sched, calls = gen.scheduler, []
    for progs, name in ((sched.programs, "eagle"), (sched.plain_programs, "target")):
        run = progs.run
        progs.run = lambda n, *a, run=run, name=name: calls.append((name, n)) or run(n, *a)
    spec = gen.generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert ("target", "extend") in calls and not any(who == "eagle" for who, _ in calls)
    # their pages (target-only) serve the same prompts again as they serve the plain engine
    prefilled = []
    for g in (plain_gen, gen):
        before = g.scheduler.stats["prefill_tokens"]
        assert [c.token_ids for c in g.generate(prompts, params)] == [c.token_ids for c in plain]
        prefilled.append(g.scheduler.stats["prefill_tokens"] - before)
    assert prefilled[1] == prefilled[0] < sum(map(len, prompts)) // 2
    calls.clear()
    # prompts whose first page is cached with its head's K/V (from a small batch) decode from their
    # first step while the others prefill: in a batch whose bucket gets no tree they decode plainly too
    cached = [p[:16] + [7] for p in random_prompts(23, 2, 17, 18)]
    gen.generate(cached, SamplingParams(max_tokens=3, ignore_eos=True))
    calls.clear()
    both = gen.generate(cached + prompts[:6], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2 + params[:6])
    assert [c.token_ids for c in both[2:]] == [c.token_ids for c in plain[:6]]
    assert not any(who == "eagle" for who, _ in calls) and all(c.accept_lengths is None for c in both)
    calls.clear()
    later = gen.generate(prompts[:2], params[:2])  # batch 2 x 4 nodes fits: the head prefills and drafts
    assert [c.token_ids for c in later] == [c.token_ids for c in plain[:2]]
    assert ("eagle", "extend") in calls and ("target", "extend") not in calls
    assert max(c.mean_accept_length for c in later) > 1 and sched.pool.in_use == 0

# -- sampled requests: drafts coupled to the target's draw ----------------------------------------------
def test_coupled_draft_ranks_first_the_token_the_targets_draw_picks():
    """A drafter whose logits equal the target's proposes, first, exactly the token the target's
    seeded draw at that output position picks (over a draft vocabulary too, when the draw falls
    in it); greedy rows keep their logits."""
    from jaxspec import sampling
    rng = np.random.default_rng(0)
    b, v = 64, 50
    logits = jnp.asarray(rng.normal(0, 2, (b, v)), jnp.float32)
    temps = np.where(np.arange(b) % 4 == 0, 0.0, rng.uniform(0.3, 1.5, b))
    sb = sampling.SamplingBatch.build([SamplingParams(temperature=float(t), seed=int(s)) for t, s in
                                       zip(temps, rng.integers(0, 1000, b))], list(rng.integers(0, 1000, b)),
                                      list(rng.integers(0, 50, b)))
    flags = sampling.SamplerFlags(sample=True)
    drawn = np.asarray(sampling.sample(logits[:, None], sb, flags)[:, 0])
    coupled = np.asarray(sampling.coupled_draft_logits(logits, sb, sb.step, v))
    assert (coupled.argmax(-1) == drawn).all()
    greedy = temps == 0
    assert np.array_equal(coupled[greedy], np.asarray(logits)[greedy])
    assert len(set(drawn[~greedy])) > 10  # draws, not argmaxes
    assert (drawn[~greedy] != np.asarray(logits).argmax(-1)[~greedy]).sum() > 5
    # a draft vocabulary of 20 target ids, the target's mass on them alone
    ids = np.sort(rng.choice(v, 20, replace=False))
    narrow = jnp.full((b, v), -1e9, jnp.float32).at[:, ids].set(logits[:, ids])
    drawn = np.asarray(sampling.sample(narrow[:, None], sb, flags)[:, 0])
    coupled = np.asarray(sampling.coupled_draft_logits(logits[:, ids], sb, sb.step, v, jnp.asarray(ids)))
    assert (ids[coupled.argmax(-1)][~greedy] == drawn[~greedy]).all()


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_coupled_drafts_are_accepted_where_the_draw_is_noise(tiny, tiny_eagle3, tiny_dflash, kind):
    """At temperature 1000 the target's draw is its Gumbel noise alone, which no drafter can
    predict from text: the head's own most probable tokens are accepted about 1 / vocabulary of the
    time, while a draft coupled to the same noise (keyed by the right output position at every
    depth) is accepted whenever the draw falls in the drafter's vocabulary (the tiny EAGLE-3
    head's 48 of 64 ids; DFLASH: all). Either way the tokens are plain sampling's, seed for seed."""
    from unittest import mock

    from jaxspec.drafters import dflash_step, eagle_step
    from jaxspec.drafters.dflash import DFlashDrafter, load_dflash
    prompts = random_prompts(31, 8)
    params = [SamplingParams(max_tokens=24, temperature=1000.0, seed=i, ignore_eos=True) for i in range(8)]
    plain = Generator(tiny, None, **KW).generate(prompts, params)
    tree = TreeShape(3, 1, 4)  # a chain: its every node is the coupled child (a tree keeps those its scores rank)

    def drafter():
        if kind == "dflash":
            return DFlashDrafter(load_dflash(str(tiny_dflash / "drafter"), TINY), tree)
        return EagleDrafter(load_head(str(tiny_eagle3 / "head"), TINY, tiny), tree)

    coupled = Generator(tiny, None, drafter=drafter(), **KW).generate(prompts, params)
    with mock.patch.object(eagle_step, "coupled", lambda *a: None), \
            mock.patch.object(dflash_step, "coupled", lambda *a: None):
        # no program store: a stored program would skip the patched trace
        own = Generator(tiny, None, drafter=drafter(), compile_cache="off", **KW).generate(prompts, params)
    assert [c.token_ids for c in coupled] == [c.token_ids for c in own] == [c.token_ids for c in plain]
    mean = lambda outs: np.mean([a for c in outs for a in c.accept_lengths])
    covered = 1.0 if kind == "dflash" else 48 / TINY.vocab_size  # the chance a draw is a draftable id
    expected = sum(covered ** d for d in range(tree.steps + 1))
    assert mean(own) < 1.3 and mean(coupled) > 0.85 * expected, (mean(coupled), mean(own), expected)


def test_noise_drawn_once_a_depth_gives_the_per_node_draws():
    """sample()'s max_depth draws one noise vector per depth (nodes of a depth share their key):
    the same tokens as one per node, for any tree, sampled and greedy rows mixed."""
    from jaxspec import sampling
    from jaxspec.pallas.tree_mask import tree_attention_mask
    rng = np.random.default_rng(1)
    b, n, v = 6, 10, 40
    parents = np.full((b, n), -1, np.int32)
    for r in range(b):
        for i in range(1, n):
            parents[r, i] = rng.integers(0, i)
    _, depth = tree_attention_mask(jnp.asarray(parents), jnp.full(b, n, jnp.int32))
    logits = jnp.asarray(rng.normal(0, 1, (b, n, v)), jnp.float32)
    sb = sampling.SamplingBatch.build([SamplingParams(temperature=t) for t in (1.0, 0.0, 0.5, 2.0, 1.0, 0.0)],
                                      list(range(b)), list(rng.integers(0, 9, b)))
    flags = sampling.SamplerFlags(sample=True)
    per_node = sampling.sample(logits, sb, flags, depth=depth)
    per_depth = sampling.sample(logits, sb, flags, depth=depth, max_depth=int(depth.max()) + 1)
    assert np.array_equal(per_node, per_depth)
    assert not np.array_equal(per_node, jnp.argmax(logits, -1))


def test_verify_calls_chain_to_a_requests_last_tokens(tiny, tiny_eagle3):
    """A steady batch's verify calls chain up to its requests' last tokens: one reaching max_tokens
    inside call t leaves call t + 1 its row as padding, and a call with no live row ends at once;
    the output is plain greedy's."""
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    prompts, params = random_prompts(31, 1, 5, 9), SamplingParams(max_tokens=60, ignore_eos=True)
    plain = Generator(tiny, None, **KW).generate(prompts, params)
    gen = eagle_generator(tiny, head, TreeShape(3, 2, 6))
    spec = gen.generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    stats = gen.scheduler.stats
    # every verify call but the first was launched from the one before, the one launched before the
    # request's end was read too (at 4fd4eb9 chaining stopped 16 tokens before max_tokens)
    assert stats["chained_steps"] == stats["verify_steps"] == 6
    # a stop id inside a call: the chained call after it finds the row stopped (no budget left)
    stop = dataclasses.replace(params, stop_token_ids=[plain[0].token_ids[30]])
    want = Generator(tiny, None, **KW).generate(prompts, stop)[0].token_ids
    assert gen.generate(prompts, stop)[0].token_ids == want and len(want) <= 31
    assert gen.scheduler.pool.in_use == 0
    # eight steps a call (the outputs' full width): the same tokens, half the calls
    gen8 = eagle_generator(tiny, head, TreeShape(3, 2, 6), verify_steps=8)
    assert [c.token_ids for c in gen8.generate(prompts, params)] == [c.token_ids for c in plain]
    assert gen8.scheduler.stats["verify_steps"] == 3
    assert gen8.generate(prompts, stop)[0].token_ids == want and gen8.scheduler.pool.in_use == 0
    with pytest.raises(ValueError, match="verify_steps=9 must be in"):
        eagle_generator(tiny, head, TreeShape(3, 2, 6), verify_steps=9)


def test_dense_forward_equals_the_paged_forward(tiny):
    """Training reads the target through dense_forward (no KV cache): the same final hidden and
    layer outputs as the engine's paged forward over the same tokens, at every valid position."""
    from jaxspec.kv_cache import KVCache
    from jaxspec.models.llama import dense_forward
    rng = np.random.default_rng(0)
    b, t = 3, 20
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (b, t)), jnp.int32)
    lengths = jnp.asarray([20, 13, 7], jnp.int32)
    cache = KVCache.create(TINY.num_layers, b + 1, t, TINY.num_kv_heads, TINY.head_dim, jnp.float32)
    h, _, layers = tiny(tokens, jnp.broadcast_to(jnp.arange(t)[None], (b, t)), cache,
                        (1 + jnp.arange(b, dtype=jnp.int32))[:, None], jnp.zeros(b, jnp.int32), lengths,
                        hidden_layers=(0, 1), attn_impl="ref")
    dh, dlayers = dense_forward(tiny, tokens, (0, 1))
    valid = np.arange(t)[None] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(np.asarray(dh)[valid], np.asarray(h)[valid], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(dlayers)[:, valid], np.asarray(layers)[:, valid], atol=2e-5, rtol=2e-5)


def test_training_on_several_corpora_concatenates_them(tmp_path, tiny):
    """--data a,b trains on both corpora in order: the card counts every sequence, the held-out
    share is the first corpus's alone (the same however many follow), and a missing file is named."""
    from jaxspec import train
    base = ["--kind", "eagle3", "--num-prompts", "24", "--max-new-tokens", "12", "--seq-len", "32", "--steps", "2",
            "--batch", "4", "--ttt", "2", "--draft-vocab", "48", "--gen-batch", "24", "--save-every", "1000"]
    train.train(train.parse_args(base + ["--run", str(tmp_path / "a"), "--data-only"]), tiny)
    a = str(tmp_path / "a" / "data.npz")
    n = len(np.load(a)["tokens"])
    argv = base + ["--run", str(tmp_path / "ab"), "--data", f"{a},{a}", "--export", str(tmp_path / "ab" / "head"),
                   "--export-dtype", "float32"]
    train.train(train.parse_args(argv), tiny)
    card = json.load(open(tmp_path / "ab" / "head" / "card.json"))
    assert card["sequences"] == 2 * n
    assert card["train_sequences"] == 2 * n - max(1, int(n * 0.02))  # the first corpus's first 2% held out
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        train.train(train.parse_args(base + ["--run", str(tmp_path / "c"), "--data", f"{a},{tmp_path}/nope.npz"]), tiny)


def test_packed_rows_give_the_loss_of_one_sequence_a_row(tiny):
    """Sequences packed into shared rows (segments, restarting positions) give the EAGLE-3 loss,
    per-step agreement and chain shares that one sequence a row gives: nothing of one sequence
    leaks into another's target forward, attention or drafted tokens."""
    from jaxspec.train_data import pack_rows
    from jaxspec.train_eagle import target_outputs, ttt_loss, unpacked
    rng = np.random.default_rng(1)
    lengths = np.array([9, 14, 5, 11], np.int32)
    starts = np.array([3, 0, 2, 4], np.int32)
    tokens = np.zeros((4, 16), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(1, TINY.vocab_size, n)
    packed = pack_rows(tokens, lengths, starts, 24, seed=0)
    assert len(packed[0]) < 4 and (packed[1] > 0).sum() == lengths.sum()
    cfg = HeadConfig.for_target(TINY, "eagle3", draft_vocab_size=48)
    head = DraftHead(cfg, rngs=nnx.Rngs(0))
    hot = jnp.arange(48)

    def loss(tok, seg, pos, mask):
        feats, final, logp = target_outputs(tiny, tok, seg, pos, cfg, hot)
        total, (losses, accs, through, _) = ttt_loss(head, tiny, feats, final, tok, seg, pos, mask, logp, 3)
        return np.asarray(losses), np.asarray(accs), np.asarray(through)

    one_a_row = loss(jnp.asarray(tokens), *unpacked(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(starts)))
    for a, b in zip(loss(*map(jnp.asarray, packed)), one_a_row):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="--pack-len 8 is shorter than a sequence"):
        pack_rows(tokens, lengths, starts, 8)


@pytest.mark.parametrize("algo", ["plain", "EAGLE3", "DFLASH auto"])
def test_a_prefilled_batchs_first_call_chains_on_its_prefill(tiny, tiny_eagle3, tiny_dflash, algo):
    """A batch whose prompts one prefill chunk ends starts its first decode or verify call from that
    chunk's device outputs before reading them (scheduler._chain_on_prefill): greedy and sampled
    outputs as an engine that reads every call back, one request a wave and four in one chunk, one
    of them stopping at its first token while the chained call runs its row on; every page back."""
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    kw = dict(KW, max_batch=4, prefill_chunk=64)

    def engine(overlap):
        drafter = None if algo == "plain" else EagleDrafter(head, TreeShape(3, 2, 6))
        if algo.startswith("DFLASH"):
            from jaxspec.drafters.dflash import DFlashDrafter, load_dflash
            drafter = DFlashDrafter(load_dflash(str(tiny_dflash / "drafter"), TINY), TreeShape(3, 1, 4))
        return Generator(tiny, None, drafter=drafter, overlap=overlap, spec_policy="auto" if "auto" in algo else "fixed",
                         **kw)
    prompts = random_prompts(31, 4, 5, 12)  # (past the (4, 4) prefill shape: one alone takes the (1, 64) one)
    params = [SamplingParams(max_tokens=14, ignore_eos=True, temperature=t, seed=i) for i, t in enumerate((0, 0, 0.8, 0))]
    cold = engine(False)
    want = [c.token_ids for c in cold.generate(prompts, params)]
    first = want[0][0]  # the first request stops at its first token, its chained row running on
    stopped = [dataclasses.replace(params[0], stop_token_ids=[first])] + params[1:]
    want_stopped = [c.token_ids for c in cold.generate(prompts, stopped)]
    assert want_stopped[0] == [first] and want_stopped[1:] == want[1:]
    gen = engine(True)
    sched = gen.scheduler
    for p, sp, w in zip(prompts, params, want):  # waves of one
        assert gen.generate([p], sp)[0].token_ids == w
    assert sched.stats["prefill_chains"] == len(prompts)
    assert [c.token_ids for c in gen.generate(prompts, params)] == want  # four prompts in one (4, 16) chunk
    assert sched.stats["prefill_chains"] == len(prompts) + 1
    assert [c.token_ids for c in gen.generate(prompts, stopped)] == want_stopped
    assert sched.stats["prefill_chains"] == len(prompts) + 2
    assert sched.late_compiles == []
    sched.pool.check()
    assert sched.pool.in_use == 0
