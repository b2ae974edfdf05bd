"""Target models against HF transformers (torch CPU) as the numerical oracle."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kv_cache import KVCache
from jaxspec.models.loading import CheckpointError, load, resolve

from conftest import SMOL_KW

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["The capital of France is", "def quicksort(arr):\n    ", "1, 2, 3, 4,", "Hello! How are you today?"]


def run_contiguous(model, ids):
    cfg = model.cfg
    ps = 16
    pages = -(-len(ids) // ps)
    cache = KVCache.create(cfg.num_layers, pages + 1, ps, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    t = len(ids)
    h, _, _ = model(jnp.array([ids]), jnp.arange(t)[None], cache, jnp.arange(1, pages + 1)[None],
                    jnp.array([0]), jnp.array([t]))
    return np.asarray(model.logits(h)[0])


@pytest.fixture(scope="module")
def hf_smollm():
    """transformers' own reading of the GGUF. It parses the file anew for the config, the tokenizer
    and the weights (7-8 s each on the CI's CPU) and rebuilds gguf's tensor-name map for every
    tensor (10 s): both are memoized here, which changes nothing they return."""
    import functools

    import gguf
    path = resolve("smollm2-135m")
    d, f = os.path.dirname(path), os.path.basename(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model, tok


def test_smollm_logits_and_tokenizer_match_hf(smollm, hf_smollm):
    model, tok = smollm
    hf, htok = hf_smollm
    msgs = [{"role": "user", "content": "What is 2+2? Answer in 10 words, 12345."}]
    ours = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    theirs = htok.encode(htok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert ours == theirs
    for p in PROMPTS:
        ids = tok.encode(p, add_special_tokens=False)
        assert ids == htok.encode(p, add_special_tokens=False)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(run_contiguous(model, ids), ref, atol=2e-3, rtol=1e-3)


def test_gguf_tokenizer_renders_and_decodes_as_transformers(smollm, hf_smollm):
    """jaxspec's GGUF tokenizer does without transformers: its chat template, encode and decode
    (special tokens kept or skipped) equal transformers' on the same GGUF."""
    _, tok = smollm
    _, htok = hf_smollm
    convos = [[{"role": "user", "content": "hi"}],
              [{"role": "system", "content": "Be brief. Ünïcödé → ok"}, {"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]]
    for msgs in convos:
        for gen in (False, True):
            text = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert text == htok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
            assert ids == htok.encode(text, add_special_tokens=False)
            for skip in (False, True):
                assert tok.decode(ids, skip_special_tokens=skip) == htok.decode(ids, skip_special_tokens=skip)
    assert tok.eos_token_id == htok.eos_token_id


def test_smollm_greedy_matches_hf(smollm, hf_smollm):
    from jaxspec import Generator, SamplingParams
    model, tok = smollm
    hf, _ = hf_smollm
    gen = Generator(model, tok, **SMOL_KW)
    prompt = "The three primary colors are"
    ids = tok.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, len(ids):]
    out = gen.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True))
    assert out.token_ids == ref.tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_hf_directory_matches_transformers(tmp_path, family):
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        cfg = transformers.LlamaConfig(**kw, tie_word_embeddings=False,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = transformers.Qwen2Config(**kw, tie_word_embeddings=True), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**kw, head_dim=32, tie_word_embeddings=False), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    ref_model = cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a missed weight shows
        for name, p in ref_model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ref_model.save_pretrained(tmp_path, safe_serialization=True)
    model, _ = load(str(tmp_path), jnp.float32)
    ids = [3, 17, 99, 42, 7, 1, 120, 64, 5, 11]
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(run_contiguous(model, ids), ref, atol=1e-4, rtol=1e-4)
    if family == "llama":  # sharded with an index, and stored in bf16
        sharded = tmp_path / "sharded"
        ref_model.to(torch.bfloat16).save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
        assert (sharded / "model.safetensors.index.json").exists()
        model, _ = load(str(sharded), jnp.float32)
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0].float().numpy()
        np.testing.assert_allclose(run_contiguous(model, ids), ref, atol=2e-2, rtol=2e-2)


def test_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load(str(tmp_path))
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    st = tmp_path / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable"):
        load(str(tmp_path))
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["intermediate_size"] = 80
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"'layers/0/w_\w+' has shape \(\d+, \d+\), config expects"):
        load(str(tmp_path))
    gg = tmp_path / "broken.gguf"
    gg.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(CheckpointError, match="broken.gguf: not a readable GGUF"):
        load(str(gg))
    with open(resolve("smollm2-135m"), "rb") as f:
        gg.write_bytes(f.read(4 << 20))  # the metadata whole, the tensors cut short
    with pytest.raises(CheckpointError, match="broken.gguf: not a readable GGUF file .* past the end of the file"):
        load(str(gg))
    with pytest.raises(CheckpointError, match="not a known short name"):
        load("smollm9-1t")
