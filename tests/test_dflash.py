"""DFLASH: the block drafter's fused step (lossless, its paged drafts equal a dense forward), the
z-lab checkpoint layout read as torch reads it, and training."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import Generator, SamplingParams, SpecConfig
from jaxspec.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashHead, build_target_layer_ids, load_dflash
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.models.loading import CheckpointError
from jaxspec.train_dflash import block_forward
from jaxspec.models.llama import dense_forward

from conftest import TINY, drafter_cache_after, run_mixed_requests_with_aborts

KW = dict(max_batch=8, max_seq_len=128, num_pages=300, page_size=4)


def chain(n):
    return TreeShape(steps=n - 1, topk=1, num_draft_tokens=n)


def random_prompts(seed, n, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, 62, int(rng.integers(lo, hi))))) for _ in range(n)]


def test_training_learns_and_exports_the_zlab_layout(tiny_dflash, tiny):
    rows = [json.loads(line) for line in open(tiny_dflash / "metrics.jsonl")]
    train = [r for r in rows if r["split"] == "train"]
    assert train[-1]["loss"] < 0.5 * train[0]["loss"]
    assert len(train[-1]["acc"]) == 3 and train[-1]["acc"][0] > train[0]["acc"][0] + 0.3
    cfg = json.load(open(tiny_dflash / "drafter" / "config.json"))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == list(build_target_layer_ids(TINY.num_layers, 2))
    card = json.load(open(tiny_dflash / "drafter" / "card.json"))
    assert card["kind"] == "dflash" and card["steps"] == 150
    # held-out: a block is accepted through position j only if it was through j-1 and j matches
    through, acc = card["held_out_accepted_through"], card["held_out_acc"]
    assert through[0] == pytest.approx(acc[0], abs=1e-3) and all(a >= b for a, b in zip(through, through[1:]))
    assert all(t <= a + 1e-3 for t, a in zip(through, acc))
    assert card["held_out_accept_length"] == pytest.approx(1 + sum(through), abs=1e-2) and through[0] > 0.3
    assert "accepted_through" in [r for r in rows if r["split"] == "val"][-1]
    assert (tiny_dflash / "accept_length.png").exists()
    # the mask token is the data's rarest token (the tiny vocabulary has no unused one), never EOS
    data = np.load(tiny_dflash / "data.npz")
    seen = np.concatenate([row[:n] for row, n in zip(data["tokens"], data["lengths"])])
    counts = np.bincount(seen, minlength=TINY.vocab_size)
    mask = cfg["dflash_config"]["mask_token_id"]
    assert mask not in TINY.eos_token_ids and counts[mask] == counts[:63].min()


def test_training_goes_on_from_a_shipped_drafter(tmp_path, tiny, tiny_dflash):
    """--init-from: a second stage starts where the exported drafter ended (its loss, not a fresh
    drafter's), keeps its mask token and layers, and its card names where it started; --data
    trains on a corpus already written."""
    from jaxspec import train
    base = ["--drafter", "dflash", "--data", str(tiny_dflash / "data.npz"), "--seq-len", "64", "--steps", "4",
            "--batch", "8", "--block-size", "4", "--draft-layers", "2", "--anchors", "8", "--log-every", "1",
            "--save-every", "1000", "--lr", "1e-4", "--seed", "7", "--export-dtype", "float32"]
    first = {}
    for name, extra in (("fresh", []), ("more", ["--init-from", str(tiny_dflash / "drafter")])):
        train.train(train.parse_args(["--run", str(tmp_path / name), "--export", str(tmp_path / name / "out")] + base + extra),
                    tiny)
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        first[name] = next(r for r in rows if r["split"] == "train")["loss"]
    assert first["more"] < 0.7 * first["fresh"], first
    shipped = json.load(open(tiny_dflash / "drafter" / "config.json"))["dflash_config"]
    assert json.load(open(tmp_path / "more" / "out" / "config.json"))["dflash_config"] == shipped
    assert json.load(open(tmp_path / "more" / "out" / "card.json"))["init_from"] == "drafter"
    with pytest.raises(FileNotFoundError, match="--data nowhere.npz: no such corpus"):
        train.train(train.parse_args(["--run", str(tmp_path / "x"), "--data", "nowhere.npz"]), tiny)


@pytest.mark.parametrize("block", [4, 3, 2])
def test_dflash_greedy_equals_plain_and_drafts_are_accepted(tiny, tiny_dflash, block):
    head = load_dflash(str(tiny_dflash / "drafter"), TINY)
    prompts = random_prompts(block, 9)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Generator(tiny, None, **KW).generate(prompts, params)
    gen = Generator(tiny, None, drafter=DFlashDrafter(head, chain(block)), **KW)
    spec = gen.generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert np.mean([c.mean_accept_length for c in spec]) > 1.3
    assert max(max(c.accept_lengths) for c in spec) == block
    assert gen.scheduler.pool.in_use == 0


def test_a_tree_from_the_block_is_exact_and_accepts_more_than_the_chain(tiny, tiny_dflash):
    """topk > 1: the block's per-position distributions make an EAGLE-2 tree (every node at depth d
    expanding by position d's top-k). Greedy stays plain greedy, sampling plain sampling with the
    same seeds, with one step or several a call; the tree accepts more than the chain it contains."""
    head = load_dflash(str(tiny_dflash / "drafter"), TINY)
    prompts = random_prompts(11, 9)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Generator(tiny, None, **KW).generate(prompts, greedy)
    spec = {}
    for name, shape in (("chain", chain(4)), ("tree", TreeShape(steps=3, topk=3, num_draft_tokens=10))):
        gen = Generator(tiny, None, drafter=DFlashDrafter(head, shape), **KW)
        spec[name] = gen.generate(prompts, greedy)
        assert [c.token_ids for c in spec[name]] == [c.token_ids for c in plain]
        assert gen.scheduler.pool.in_use == 0
    accept = {k: np.mean([c.mean_accept_length for c in v]) for k, v in spec.items()}
    assert accept["tree"] > accept["chain"] > 1.3, accept
    sampled = SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    want = [c.token_ids for c in Generator(tiny, None, **KW).generate(prompts[:5], sampled)]
    for kw in (dict(overlap=False, decode_steps=1), {}):
        gen = Generator(tiny, None, drafter=DFlashDrafter(head, TreeShape(3, 3, 10)), **{**KW, **kw})
        assert [c.token_ids for c in gen.generate(prompts[:5], sampled)] == want


def test_paged_drafts_equal_a_dense_forward_over_the_committed_tokens(tiny, tiny_dflash):
    """After every step (prompts prefilled in several chunks, one prompt twice so that the second
    reuses the first's pages from the prefix cache), each request's drafted block equals the
    drafter run densely over the target's features of its committed tokens."""
    head = load_dflash(str(tiny_dflash / "drafter"), TINY)
    prompts = random_prompts(7, 3, 10, 30)
    prompts.append(list(prompts[0]))
    gen = Generator(tiny, None, drafter=DFlashDrafter(head, chain(4)), overlap=False, decode_steps=1,
                    prefill_chunk=8, **KW)
    sched = gen.scheduler
    reqs = [sched.add(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts[:3]]
    checked, counts = 0, []
    while sched.has_work:
        sched.step()
        if len(reqs) == 3 and all(r.finished for r in reqs):
            reqs.append(sched.add(prompts[3], SamplingParams(max_tokens=20, ignore_eos=True)))
        for r in reqs:
            if r.finished or r.draft is None:
                continue
            tokens, _ = r.draft
            seq = r.tokens[:r.kv_len]
            padded = jnp.zeros((1, 64), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq, jnp.int32))  # one shape
            _, layers = dense_forward(tiny, padded, head.cfg.target_layer_ids)
            block = jnp.asarray([[[r.tokens[r.kv_len]] + [head.cfg.mask_token] * 3]], jnp.int32)
            out = block_forward(head, tiny, layers, jnp.asarray([[len(seq)]]), block)
            want = np.asarray(jnp.argmax(head.logits(tiny, out[0, 0, 1:]), -1)).tolist()
            assert list(tokens) == [r.tokens[r.kv_len]] + want
            checked += 1
        counts += [c for r in reqs for c in r.accept_lengths]
    assert checked > 30 and max(counts) > 2
    assert sched.stats["prefill_tokens"] < sum(map(len, prompts))  # the repeated prompt came from the cache


def test_auto_shapes_share_the_block_and_keep_outputs_plain(tiny, tiny_dflash):
    """spec_policy='auto': the block verified as chains of several lengths and as a tree, one
    drafter pass each, the shape switched between calls: greedy and sampled output are plain's."""
    head = load_dflash(str(tiny_dflash / "drafter"), TINY)
    drafter = DFlashDrafter(head, chain(4))
    assert [t.label for t in drafter.auto_trees()] == ["3:1:4", "3:8:8"]
    with pytest.raises(ValueError, match="share its block of 4 tokens"):
        drafter.with_tree(TreeShape(2, 1, 3))
    prompts = random_prompts(13, 5)
    trees = (TreeShape(3, 1, 2), chain(4), TreeShape(3, 4, 8))
    plain_gen = Generator(tiny, None, **KW)
    gen = Generator(tiny, None, drafter=DFlashDrafter(head, chain(4)), spec_policy="auto", spec_trees=trees, **KW)
    assert gen.scheduler.draft_slots == 4
    turns = iter([trees[1], trees[2], trees[2], trees[0], trees[1]] * 200)
    gen.scheduler.spec_policy.choose = lambda rows, keys=None: next(turns)
    for params in (SamplingParams(max_tokens=30, ignore_eos=True),
                   [SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True) for i in range(5)]):
        switches = gen.scheduler.stats["chained_switches"]
        plain = plain_gen.generate(prompts, params)
        assert [c.token_ids for c in gen.generate(prompts, params)] == [c.token_ids for c in plain]
        assert gen.scheduler.pool.in_use == 0 and gen.scheduler.stats["chained_switches"] - switches >= 2
    assert len(gen.scheduler.spec_policy.accepts) == 3
    # the policy compares the chains through the longer one's cuts, the tree through its own calls
    # (a cut of the tree is no chain: DFlashDrafter.cut_shapes)
    assert [s.label for s in drafter.with_tree(trees[1]).with_policy_shapes(trees).cut_shapes()] == ["3:1:2"]
    assert drafter.with_tree(trees[2]).with_policy_shapes(trees).cut_shapes() == ()
    assert set(gen.scheduler.spec_policy.links.sums) == {(trees[0], trees[1])}


def test_plain_spells_of_the_auto_policy_keep_the_context_in_step(tiny, tiny_dflash):
    """The auto policy's plain decoding (dflash_step.decode) writes the drafter's context K/V as
    verifying would: outputs stay plain's, and the context over a request's tokens matches an
    engine's that never decoded plainly."""
    head = load_dflash(str(tiny_dflash / "drafter"), TINY)
    prompts = random_prompts(17, 5)
    trees = (chain(4), TreeShape(3, 4, 8))
    gens = [Generator(tiny, None, drafter=DFlashDrafter(head, chain(4)), spec_policy="auto", spec_trees=trees, **KW)
            for _ in range(2)]
    gens[0].scheduler.spec_policy.choose = lambda rows, keys=None: trees[0]
    turns = iter([None, trees[1], None, None, trees[0], trees[0]] * 300)
    gens[1].scheduler.spec_policy.choose = lambda rows, keys=None: next(turns)
    params = [SamplingParams(max_tokens=30, temperature=t, seed=i, ignore_eos=True) for i, t in enumerate([0, 1] * 3)]
    plain = Generator(tiny, None, **KW).generate(prompts, params[:5])
    assert [c.token_ids for c in gens[1].generate(prompts, params[:5])] == [c.token_ids for c in plain]
    assert gens[1].scheduler.pool.in_use == 0 and gens[1].scheduler.late_compiles == []
    k, reqs = drafter_cache_after(gens, prompts[0])
    np.testing.assert_allclose(k[1], k[0], atol=1e-5)


def test_sampling_equals_plain_with_the_same_seeds_and_chains_equal_single_steps(tiny, tiny_dflash):
    """The target's own seeded sample decides every position, so sampled DFLASH output is plain
    sampling's, token for token; several steps a call give the one-step scheduler's tokens, with
    max_tokens and a stop id falling inside a call."""
    head = load_dflash(str(tiny_dflash / "drafter"), TINY)
    prompts = random_prompts(3, 5)
    free = Generator(tiny, None, **KW).generate(prompts[:1], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    chained = 0
    for params in (SamplingParams(max_tokens=30, temperature=1.0, seed=4, ignore_eos=True),
                   SamplingParams(max_tokens=40, stop_token_ids=[free.token_ids[17]]),
                   SamplingParams(max_tokens=13, ignore_eos=True)):
        plain = Generator(tiny, None, **KW).generate(prompts, params)
        one = Generator(tiny, None, drafter=DFlashDrafter(head, chain(4)), overlap=False, decode_steps=1, **KW)
        many = Generator(tiny, None, drafter=DFlashDrafter(head, chain(4)), **KW)
        a, b = one.generate(prompts, params), many.generate(prompts, params)
        assert [c.token_ids for c in a] == [c.token_ids for c in b] == [c.token_ids for c in plain]
        assert [c.finish_reason for c in b] == [c.finish_reason for c in plain]
        assert [c.accept_lengths for c in a] == [c.accept_lengths for c in b]
        # /metrics' jaxspec_accept_length: per request and step, though a call runs several steps over every row
        assert many.scheduler.mean_accept_length() == pytest.approx(np.mean([x for c in b for x in c.accept_lengths or []]))
        assert many.scheduler.pool.in_use == 0
        chained += many.scheduler.stats["chained_steps"]
    assert chained > 4  # calls launched from the last call's device outputs


def test_no_leaked_pages_after_many_mixed_requests(tiny, tiny_dflash):
    head = load_dflash(str(tiny_dflash / "drafter"), TINY)
    gen = Generator(tiny, None, drafter=DFlashDrafter(head, chain(4)),
                    **{**KW, "max_batch": 32, "max_seq_len": 64, "num_pages": 160})
    run_mixed_requests_with_aborts(gen, np.random.default_rng(5), n=600)


# -- the checkpoint layout --------------------------------------------------------------------------------
def torch_dflash_reference(sd, cfg, ctx_features, emb_block, start):
    """z-lab's DFlashDraftModel forward (one sequence, an empty cache), written with torch from its
    checkpoint names: the context's K/V from fc + hidden_norm, rotated at positions 0..S-1, the
    block at S.., attention without a mask, per-head q/k norms before the rotation."""
    import torch
    t = lambda k: torch.tensor(np.asarray(sd[k], np.float32))
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w
    ctx = rms(torch.tensor(ctx_features) @ t("fc.weight").T, t("hidden_norm.weight"))
    x = torch.tensor(emb_block)
    s, n, d = ctx.shape[0], x.shape[0], cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(s + n).float()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = lambda z, c, si: z * c + torch.cat([-z[..., d // 2:], z[..., :d // 2]], -1) * si
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = rms(x, t(p + "input_layernorm.weight"))
        q = rms((h @ t(p + "self_attn.q_proj.weight").T).view(n, cfg.num_heads, d), t(p + "self_attn.q_norm.weight"))
        kin = torch.cat([ctx, h])
        k = rms((kin @ t(p + "self_attn.k_proj.weight").T).view(s + n, cfg.num_kv_heads, d), t(p + "self_attn.k_norm.weight"))
        v = (kin @ t(p + "self_attn.v_proj.weight").T).view(s + n, cfg.num_kv_heads, d)
        q, k = rot(q, cos[s:], sin[s:]), rot(k, cos, sin)
        g = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        att = (torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1) @ t(p + "self_attn.o_proj.weight").T
        m = rms(x, t(p + "post_attention_layernorm.weight"))
        m = (torch.nn.functional.silu(m @ t(p + "mlp.gate_proj.weight").T) * (m @ t(p + "mlp.up_proj.weight").T))
        x = x + m @ t(p + "mlp.down_proj.weight").T
    return rms(x, t("norm.weight")).numpy()


def write_zlab_checkpoint(path, rng, H=32, nh=4, nkv=2, d=16, F=48, layers=2, ids=(0, 1)):
    from safetensors.numpy import save_file
    shapes = {"fc.weight": (H, len(ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (nh * d, H), p + "self_attn.k_proj.weight": (nkv * d, H),
                       p + "self_attn.v_proj.weight": (nkv * d, H), p + "self_attn.o_proj.weight": (H, nh * d),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                       p + "mlp.down_proj.weight": (H, F)})
    sd = {k: (rng.normal(0, 0.2, s) + (1.0 if len(s) == 1 else 0.0)).astype(np.float32) for k, s in shapes.items()}
    save_file(sd, str(path / "model.safetensors"))
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "num_hidden_layers": layers,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": d, "intermediate_size": F,
           "vocab_size": TINY.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "block_size": 5,
           "num_target_layers": TINY.num_layers, "max_position_embeddings": 512,
           "dflash_config": {"target_layer_ids": list(ids), "mask_token_id": 61}}
    json.dump(cfg, open(path / "config.json", "w"))
    return sd, cfg


def test_zlab_layout_matches_torch_reading(tmp_path, tiny):
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    sd, _ = write_zlab_checkpoint(tmp_path, rng)
    head = load_dflash(str(tmp_path), TINY)
    assert head.cfg.block_size == 5 and head.cfg.mask_token == 61 and head.cfg.target_layer_ids == (0, 1)
    s, n = 7, 5
    feats = rng.normal(size=(2, 1, s, 32)).astype(np.float32)
    block = [9] + [61] * (n - 1)
    emb = np.asarray(tiny.embed_tokens(jnp.asarray(block)))
    ref = torch_dflash_reference(sd, head.cfg, np.concatenate([feats[0, 0], feats[1, 0]], -1), emb, s)
    # dense: anchor s sees context 0..s-1; paged: the same through the engine's draft pass
    out = block_forward(head, tiny, jnp.asarray(feats), jnp.asarray([[s]]), jnp.asarray([[block]]))
    from jaxspec.models.llama import rms_norm
    np.testing.assert_allclose(np.asarray(rms_norm(out[0, 0], head.norm[...], 1e-6)), ref, atol=2e-4, rtol=2e-4)
    from jaxspec.drafters.dflash_step import draft_block, write_context
    from jaxspec.kv_cache import KVCache
    dc = KVCache.create(2, 8, 4, 2, 16, jnp.float32)
    pt = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    dc = write_context(head, dc, jnp.asarray(feats), pt, jnp.asarray([0]), jnp.asarray([s]))
    (toks, parents), _ = draft_block(head, tiny, dc, pt, jnp.asarray([s]), jnp.asarray([9]), jnp.asarray([True]), chain(n),
                                   "ref")
    want = np.argmax(np.asarray(tiny.logits(jnp.asarray(ref[1:]))), -1)
    assert np.asarray(toks)[0].tolist() == [9] + want.tolist()
    assert np.asarray(parents)[0].tolist() == [-1, 0, 1, 2, 3]


def test_bad_dflash_checkpoints_and_options_are_named(tmp_path, tiny):
    rng = np.random.default_rng(1)

    def fresh(name, **cfg_edit):
        d = tmp_path / name
        d.mkdir()
        sd, cfg = write_zlab_checkpoint(d, rng)
        cfg.update(cfg_edit)
        json.dump(cfg, open(d / "config.json", "w"))
        return d, sd

    d, _ = fresh("nomask", dflash_config={"target_layer_ids": [0, 1]})
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_dflash(str(d), TINY)
    d, _ = fresh("wide", hidden_size=64)
    with pytest.raises(CheckpointError, match="hidden_size 64 != target's 32"):
        load_dflash(str(d), TINY)
    d, _ = fresh("deep", num_target_layers=36)
    with pytest.raises(CheckpointError, match="36-layer target"):
        load_dflash(str(d), TINY)
    d, _ = fresh("ids", dflash_config={"target_layer_ids": [0, 5], "mask_token_id": 61})
    with pytest.raises(CheckpointError, match=r"target_layer_ids \[5\]"):
        load_dflash(str(d), TINY)
    from safetensors.numpy import save_file
    d, sd = fresh("bias")
    save_file({**sd, "layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor 'layers.0.self_attn.q_proj.bias'"):
        load_dflash(str(d), TINY)
    d, sd = fresh("missing")
    save_file({k: v for k, v in sd.items() if k != "layers.1.mlp.up_proj.weight"}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'layers.1.mlp.up_proj.weight' is missing"):
        load_dflash(str(d), TINY)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_dflash(str(tmp_path / "nowhere"), TINY)
    with pytest.raises(ValueError, match="DFLASH needs draft_model_path"):
        SpecConfig("DFLASH").build(tiny)
    with pytest.raises(ValueError, match="a token map restricts"):
        SpecConfig("DFLASH", token_map="x.npy").build(tiny)


def test_spec_config_builds_the_drafter_with_its_block_size(tmp_path, tiny, tiny_dflash):
    drafter = SpecConfig("DFLASH", draft_model_path=str(tiny_dflash / "drafter")).build(tiny)
    assert isinstance(drafter, DFlashDrafter) and drafter.num_nodes == 4 and drafter.draft_slots == 4
    assert SpecConfig("dflash", draft_model_path=str(tiny_dflash / "drafter"), num_draft_tokens=3).build(tiny).num_nodes == 3
    assert SpecConfig("DFLASH", draft_model_path=str(tiny_dflash / "drafter"), dflash_block_size=2).build(tiny).num_nodes == 2
    tree = SpecConfig("DFLASH", draft_model_path=str(tiny_dflash / "drafter"), eagle_topk=3).build(tiny)
    assert (tree.tree.steps, tree.tree.topk, tree.num_nodes, tree.draft_slots) == (3, 3, 8, 4)
    with pytest.raises(ValueError, match="DFLASH tree depth num_steps=4 exceeds the block's 3 drafted positions"):
        SpecConfig("DFLASH", draft_model_path=str(tiny_dflash / "drafter"), eagle_topk=2, num_steps=4).build(tiny)
    with pytest.raises(ValueError, match="DFLASH block size 65 must be in"):
        SpecConfig("DFLASH", draft_model_path=str(tiny_dflash / "drafter"), dflash_block_size=65).build(tiny)
    head = DFlashHead(DFlashConfig.for_target(TINY, num_layers=1, block_size=4, mask_token=62), rngs=nnx.Rngs(0))
    assert head.cfg.target_layer_ids == (TINY.num_layers // 2,)
