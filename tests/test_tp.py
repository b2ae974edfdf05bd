"""Tensor parallel over forced host devices: TP 2 and 4 give TP 1's tokens (plain, EAGLE-3, NGRAM,
batched; TP 4 repeats the tiny model's 2 KV heads), the weights and the KV cache are split, and
bench/tp.py runs."""
import functools
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import TINY
from jaxspec import Generator, SamplingParams, SpecConfig, sharding
from jaxspec.drafters.eagle import EagleDrafter, load_head
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.sampling import SamplerFlags

RNG = np.random.default_rng(4)
PROMPTS = [list(map(int, (list(RNG.integers(0, 62, 3)) * 8)[:n])) for n in (3, 9, 14, 21, 6)]  # repeats: NGRAM drafts
KW = dict(max_batch=8, max_seq_len=128, num_pages=300, page_size=4)  # test_dflash.py's: shared programs


def drafter(kind, tiny, tiny_eagle3):
    if kind == "eagle3":
        return EagleDrafter(load_head(str(tiny_eagle3 / "head"), TINY, tiny), TreeShape(3, 2, 6))
    if kind == "ngram":
        return SpecConfig("NGRAM", num_draft_tokens=4).build(tiny)
    return None


@functools.cache
def tp1_tokens(tiny, kind, sample):
    params = [SamplingParams(max_tokens=14, ignore_eos=True, temperature=1.0 if sample else 0.0, seed=i)
              for i in range(len(PROMPTS))]
    return params, [o.token_ids for o in Generator(tiny, None, **KW).generate(PROMPTS, params)]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["plain", "eagle3", "ngram"])
def test_tp_gives_tp1_tokens(tiny, tiny_eagle3, tp, kind):
    d = drafter(kind, tiny, tiny_eagle3)
    extra = dict(spec_max_host_verify_tokens=64) if kind == "ngram" else {}  # a tree at batch 8 too
    gen = Generator(tiny, None, tp_size=tp, drafter=d, **KW, **extra)
    for sample in ((False, True) if kind == "plain" else (False,)):  # seeded sampling over a vocabulary split
        params, want = tp1_tokens(tiny, "plain", sample)
        out = gen.generate(PROMPTS, params)
        assert [o.token_ids for o in out] == want, (tp, kind, sample)
    if kind != "plain":
        assert np.mean([o.mean_accept_length or 1 for o in out]) > 1.0
    assert gen.scheduler.pool.in_use == 0
    # greedy and sampled batches have programs of their own under a mesh, all built at start-up
    assert not gen.scheduler.programs.flags_for("decode", SamplerFlags()).sample
    assert gen.scheduler.late_compiles == []
    if tp == 4:  # 2 KV heads repeated to one a shard
        assert gen.model.cfg.num_kv_heads == 4 and gen.model.cfg.shard_groups == 4


def test_weights_and_cache_are_split(tiny):
    whole = sum(x.nbytes for x in jax.tree.leaves(nnx.state(tiny, nnx.Param)))
    for tp in (2, 4):
        gen = Generator(tiny, None, tp_size=tp, **KW)
        per = sharding.per_device_bytes(nnx.state(gen.model, nnx.Param))
        assert len(per) == tp and len(set(per)) == 1
        # each device holds about 1/tp (norms are whole on each; TP 4 repeats K/V columns)
        kv_extra = (4 - TINY.num_kv_heads) * TINY.head_dim * 2 * TINY.hidden_size * TINY.num_layers * 4 if tp == 4 else 0
        assert per[0] <= (whole + kv_extra) / tp * 1.05 and per[0] >= whole / tp
        cache = gen.scheduler.cache
        assert sharding.per_device_bytes(cache) == [cache.k.nbytes * 2 // tp] * tp
        assert gen.model.layers[0].wqkv[...].sharding.spec == sharding.P(None, sharding.AXIS)


def test_layout_keeps_the_function_and_rejects_what_does_not_divide(tiny):
    cfg = TINY
    with pytest.raises(ValueError, match="tp_size=3 does not divide the model's 4 attention heads"):
        sharding.tp_config(cfg, 3)
    with pytest.raises(ValueError, match="tp_size=8 needs 8 devices; 4 are visible"):
        sharding.tp_mesh(8)
    # the relaid-out model computes what the original does, on one device (no mesh)
    import dataclasses

    from jaxspec.models.loading import build_model
    flat = dict(nnx.to_flat_state(nnx.state(tiny, nnx.Param)))
    weights = {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in flat.items()}
    laid = build_model(sharding.tp_config(cfg, 4), sharding.tp_weights(cfg, weights, 4), tiny.dtype, "t")
    assert laid.cfg == dataclasses.replace(cfg, num_kv_heads=4, shard_groups=4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a = Generator(tiny, None, **KW).generate(PROMPTS[:2], params)
    b = Generator(laid, None, **KW).generate(PROMPTS[:2], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_tp_bench_runs_on_host_devices(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    import tp as tp_bench
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    rows = tp_bench.main(["--model", "tiny", "--tp", "1,2", "--batches", "2", "--context", "32", "--steps", "8",
                          "--verify-nodes", "4", "--bandwidth-bytes", str(1 << 20), "--check", "--max-seq-len", "64"])
    assert {(r["tp"], r["batch"], r["algorithm"]) for r in rows} == {(t, 2, a) for t in (1, 2)
                                                                      for a in ("plain", "verify:4")}
    assert all(r["ms_per_step"] > 0 for r in rows)
    import json
    out = json.load(open(next(tmp_path.glob("tp-*.json"))))
    assert out["identical_to_tp1"] == {"1": True, "2": True}
    # the 8B memory table: weights split by TP, K/V by KV head
    mem = tp_bench.main(["--memory-only", "--tp", "1,2,4", "--batches", "1"])
    assert json.load(open(next(tmp_path.glob("tp_memory-*.json"))))["rows"] == mem
    w = [m["weight_bytes_per_device"] for m in mem]
    assert w[0] == pytest.approx(16.06e9, rel=0.01) and w[1] == pytest.approx(w[0] / 2, rel=0.01)
    assert mem[2]["kv_bytes_per_device"] * 4 == mem[0]["kv_bytes_per_device"]


def test_rollout_over_a_tp_mesh_gives_tp1_tokens(tiny, tiny_eagle3):
    import jax.numpy as jnp

    from jaxspec.models.loading import shard_model
    from jaxspec.rollout import RolloutConfig, make_rollout
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    cfg = RolloutConfig("eagle3", max_new_tokens=10, page_size=4, num_steps=2, topk=2, num_draft_tokens=4)
    toks = np.zeros((4, 21), np.int32)
    for i, p in enumerate(PROMPTS[1:]):
        toks[i, :len(p)] = p
    args = (jnp.asarray(toks), jnp.asarray([len(p) for p in PROMPTS[1:]], jnp.int32), jnp.arange(4))
    fn, params, dparams = make_rollout(tiny, head, cfg)
    want = jax.jit(fn)(params, dparams, *args).tokens
    # rows over a 'data' axis, heads over 'tp'
    mesh = jax.make_mesh((2, 2), ("data", sharding.AXIS), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = shard_model(tiny, mesh)  # split over "tp", whole on each "data" row
    fn, params, dparams = make_rollout(model, head, cfg, mesh=mesh)
    rows = sharding.NamedSharding(mesh, sharding.P("data"))
    got = jax.jit(fn)(params, dparams, *(jax.device_put(a, rows) for a in args)).tokens
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_vocab_parallel_lookup_finds_every_shards_rows(tiny):
    """Token ids on both sides of each shard's boundary, looked up in the vocabulary-split table."""
    from jaxspec.models.loading import shard_model
    v = tiny.cfg.vocab_size
    for tp in (2, 4):
        n = v // tp
        ids = np.array([[0, n - 1, n, v - 1, (tp - 1) * n, 7]], np.int32)
        model = shard_model(tiny, sharding.tp_mesh(tp))
        with jax.set_mesh(sharding.tp_mesh(tp)):
            got = jax.jit(lambda t: model.embed_tokens(t))(ids)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(tiny.embed[...])[ids])


def test_the_decode_floor_counts_the_embedding_rows_a_step_reads():
    """bench/decode.py's read floor: an untied input table is read a row a token, a tied one whole
    (it is the output projection); the issue's floor (param_bytes) counts every table byte."""
    import dataclasses
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    from common import param_bytes, read_weight_bytes
    from jaxspec.models import Llama
    untied = Llama(dataclasses.replace(TINY, tie_word_embeddings=False), rngs=nnx.Rngs(0))
    table = TINY.vocab_size * TINY.hidden_size * 4  # float32
    assert read_weight_bytes(untied, 3) == param_bytes(untied) - table + 3 * TINY.hidden_size * 4
    tied = Llama(dataclasses.replace(TINY, tie_word_embeddings=True), rngs=nnx.Rngs(0))
    assert read_weight_bytes(tied, 3) == param_bytes(tied)
