"""FR-Spec token maps: the head drafts only the listed ids, outputs stay the target's, and bad
maps are refused with the reason."""
import functools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY
from jaxspec import Generator, SamplingParams, SpecConfig
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.drafters.token_map import apply_token_map, load_token_map
from jaxspec.models.loading import CheckpointError

KW = dict(max_batch=8, max_seq_len=128, num_pages=300)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_token_map_cuts_the_draft_vocabulary_and_keeps_outputs(tiny, kind):
    ids = np.random.default_rng(0).permutation(48)[:20].astype(np.int32)
    head = DraftHead(HeadConfig.for_target(TINY, kind, draft_vocab_size=48 if kind == "eagle3" else None),
                     rngs=nnx.Rngs(5))
    full_logits = np.asarray(head.logits(tiny, jnp.ones((1, TINY.hidden_size))))
    apply_token_map(head, tiny, ids)
    assert head.cfg.draft_vocab_size == 20
    np.testing.assert_array_equal(np.asarray(head.to_target(jnp.arange(20))), ids)
    # the cut projection is the full one's columns for the listed ids
    # (the eagle3 head's d2t is the identity here, so its columns are the ids too)
    np.testing.assert_allclose(np.asarray(head.logits(tiny, jnp.ones((1, TINY.hidden_size)))), full_logits[:, ids],
                               rtol=1e-5, atol=1e-5)
    spec = Generator(tiny, None, drafter=EagleDrafter(head, TreeShape(3, 2, 6)), **KW)
    for params, plain in plain_outputs(tiny):
        assert [o.token_ids for o in spec.generate(PROMPTS, params)] == plain


PROMPTS = [list(map(int, np.random.default_rng(1).integers(0, 62, n))) for n in (3, 9, 14, 19, 5)]


@functools.cache
def plain_outputs(model):
    """(params, plain decoding's tokens): greedy, then seeded sampling."""
    gen = Generator(model, None, **KW)
    sets = (SamplingParams(max_tokens=16, ignore_eos=True),
            [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in range(5)])
    return [(p, [o.token_ids for o in gen.generate(PROMPTS, p)]) for p in sets]


def test_token_map_files_in_each_format_and_their_errors(tmp_path, tiny):
    torch = pytest.importorskip("torch")
    ids = [5, 1, 9, 33]
    torch.save(torch.tensor(ids), tmp_path / "map.pt")  # SGLang's format
    np.save(tmp_path / "map.npy", np.array(ids))
    (tmp_path / "map.json").write_text(json.dumps(ids))
    for name in ("map.pt", "map.npy", "map.json"):
        assert load_token_map(str(tmp_path / name), 64).tolist() == ids
    cases = {"far.json": ([1, 64], r"id 64 is outside the target's vocabulary \[0, 64\)"),
             "dup.json": ([1, 2, 1], "id 1 is listed more than once"),
             "flat.json": ([[1, 2]], "expected a non-empty 1-D list of integer token ids"),
             "empty.json": ([], "expected a non-empty 1-D list")}
    for name, (value, message) in cases.items():
        (tmp_path / name).write_text(json.dumps(value))
        with pytest.raises(CheckpointError, match=f"token map .*{name}: {message}"):
            load_token_map(str(tmp_path / name), 64)
    with pytest.raises(CheckpointError, match="no such file"):
        load_token_map(str(tmp_path / "absent.pt"), 64)
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="junk.pt: not a zip archive"):
        load_token_map(str(tmp_path / "junk.pt"), 64)
    # an EAGLE-3 head drafts from its own vocabulary: a map may only narrow it
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3", draft_vocab_size=8), rngs=nnx.Rngs(5))
    with pytest.raises(CheckpointError, match="1 ids .first 33. are outside the head's 8-token draft vocabulary"):
        apply_token_map(head, tiny, np.array([1, 2, 33]))
    with pytest.raises(ValueError, match="a token map restricts an EAGLE head's draft vocabulary; NGRAM has no head"):
        SpecConfig("NGRAM", token_map=str(tmp_path / "map.pt")).build(tiny)


def test_the_builder_counts_what_the_target_emits(tiny, smollm, tmp_path):
    from jaxspec import token_map
    counts = token_map.count_emitted(tiny, None, None, max_new_tokens=12, seed=0, batch=32, num_prompts=32)
    assert counts.sum() > 32 * 6  # most answers run to the token budget
    ids = token_map.top_ids(counts, 16)
    assert counts[ids].min() >= np.delete(counts, ids).max()  # no id left out counts more than one kept
    cov = token_map.coverage(counts, (4, 8, 16, 32))
    assert list(cov) == [4, 8, 16, 32] and all(a <= b for a, b in zip(cov.values(), list(cov.values())[1:]))
    assert cov[16] == pytest.approx(counts[ids].sum() / counts.sum())
    for name in ("map.npy", "map.json"):
        token_map.write_map(ids, str(tmp_path / name))
        assert load_token_map(str(tmp_path / name), TINY.vocab_size).tolist() == ids.tolist()
    # a user's prompts, chat-templated by the model's tokenizer
    _, tok = smollm
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    got = token_map.read_prompts(str(tmp_path / "p.jsonl"), tok)
    assert got[0] == tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert len(got) == 2
    (tmp_path / "bad.jsonl").write_text('{"text": "no"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1: a line needs a 'prompt' or 'messages' field"):
        token_map.read_prompts(str(tmp_path / "bad.jsonl"), tok)


def test_an_adaptive_map_follows_the_emitted_tokens_and_keeps_outputs(tiny):
    from jaxspec.drafters.token_map import AdaptiveTokenMap
    ids = np.random.default_rng(0).permutation(64)[:20].astype(np.int32)
    head = DraftHead(HeadConfig.for_target(TINY, "eagle"), rngs=nnx.Rngs(5))
    adaptive = AdaptiveTokenMap(head, tiny, ids, every=8)
    spec = Generator(tiny, None, drafter=EagleDrafter(head, TreeShape(3, 2, 6), adaptive), warmup=True,
                     **dict(KW, max_batch=4))
    for params, plain in plain_outputs(tiny):  # the same outputs under each map swapped in meanwhile
        assert [o.token_ids for o in spec.generate(PROMPTS, params)] == plain
    assert adaptive.refreshes > 1 and spec.scheduler.late_compiles == []  # new maps, no new programs
    with pytest.raises(ValueError, match="token_map_refresh refreshes a token map: give the starting one"):
        SpecConfig("EAGLE", draft_model_path="x", token_map_refresh=8).build(tiny)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_an_adaptive_map_takes_the_most_emitted_ids_and_their_columns(tiny, kind):
    from jaxspec.drafters.token_map import AdaptiveTokenMap
    # an EAGLE-3 head chooses within its own 48-id vocabulary (d2t)
    head = DraftHead(HeadConfig.for_target(TINY, kind, draft_vocab_size=48 if kind == "eagle3" else None),
                     rngs=nnx.Rngs(5))
    x = jnp.ones((1, TINY.hidden_size))
    full = np.asarray(head.logits(tiny, x))
    adaptive = AdaptiveTokenMap(head, tiny, np.arange(10, 18, dtype=np.int32), every=30)
    emitted = [3, 3, 3, 40, 40, 5, 63, 63, 63, 63] * 3  # 63: outside an EAGLE-3 head's vocabulary
    adaptive.observe(emitted[:20])
    assert not adaptive.refresh()  # fewer than `every` tokens counted since the last refresh
    adaptive.observe(emitted[20:])
    assert adaptive.refresh() and adaptive.refreshes == 1
    want = [63, 3, 40, 5] if kind == "eagle" else [3, 40, 5]  # then the starting map's ids, in its order
    now = np.asarray(head.draft_to_target[...])
    assert now.tolist() == want + list(range(10, 18))[:8 - len(want)]
    np.testing.assert_allclose(np.asarray(head.logits(tiny, x)), full[:, now], rtol=1e-5, atol=1e-5)
    adaptive.observe(emitted)
    assert not adaptive.refresh()  # the same ids: nothing to swap
