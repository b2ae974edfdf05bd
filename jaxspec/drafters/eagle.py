"""EAGLE and EAGLE-3 draft heads, and the checkpoint layouts they load from and export to.

Both heads are one decoder layer that reads the target's features plus the embedding of the token
that followed them, and predicts the token after that. They differ in three places:

    input      EAGLE:   fc([embed; final-normed target hidden]) feeds the layer (no input norm)
               EAGLE-3: fc(concat of three target layers' residual streams) is the hidden; the
                        layer's q/k/v read [input_norm(embed); hidden_norm(hidden)] (width 2H)
    output     EAGLE:   the target's own lm_head on the layer output
               EAGLE-3: norm, then its own lm_head over a small draft vocabulary (FR-Spec's idea),
                        mapped back to target ids through d2t
    next step  both feed their own layer output (before any norm) as the next hidden

The attention itself is left to the caller (`qkv` then `finish`), because the head attends over
two different things: the paged draft cache during catch-up, and a dense buffer of tree nodes while
drafting (see eagle_step.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.drafters.device import DeviceDrafter
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import apply_rope, rms_norm, rope_frequencies
from jaxspec.models.loading import CheckpointError
from jaxspec.spec_shapes import DEFAULT_TREE


def default_feature_layers(num_layers: int) -> tuple:
    """SGLang's EAGLE-3 capture points, the inputs of layers 2, L/2 and L-3 (outputs of 1, L/2-1,
    L-4), clamped for very shallow test models."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    kind: str  # "eagle" or "eagle3"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # == vocab_size for EAGLE (it reuses the target's lm_head)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    fc_bias: bool = False
    feature_layers: tuple = ()  # EAGLE-3: target layers whose outputs are fused (low, mid, high)

    @classmethod
    def for_target(cls, target: ModelConfig, kind="eagle3", draft_vocab_size=None, intermediate_size=None,
                   feature_layers=None):
        """A head shaped like one layer of the target (what EAGLE and SpecForge train)."""
        n = target.num_layers
        if feature_layers is None:
            # SGLang's default capture points: the inputs of layers 2, L/2 and L-3
            feature_layers = default_feature_layers(n) if kind == "eagle3" else ()
        return cls(kind=kind, hidden_size=target.hidden_size, num_heads=target.num_heads,
                   num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   intermediate_size=intermediate_size or target.intermediate_size, vocab_size=target.vocab_size,
                   draft_vocab_size=(draft_vocab_size or target.vocab_size) if kind == "eagle3" else target.vocab_size,
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
                   fc_bias=kind == "eagle", feature_layers=tuple(feature_layers))

    def check_target(self, target: ModelConfig, source: str = "draft head"):
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target's {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target's {target.vocab_size}")
        bad = [l for l in self.feature_layers if not 0 <= l < target.num_layers]
        if bad:
            problems.append(f"feature layers {bad} outside the target's {target.num_layers} layers")
        if problems:
            raise CheckpointError(f"{source} does not match the target model: " + "; ".join(problems))


class DraftHead(nnx.Module):
    """Weights in [in, out] layout; random init is for tests and the start of training."""

    def __init__(self, cfg: HeadConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        rngs = rngs or nnx.Rngs(0)
        H, F = cfg.hidden_size, cfg.intermediate_size
        hq, hk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        eagle3 = cfg.kind == "eagle3"
        fc_in = 3 * H if eagle3 else 2 * H
        attn_in = 2 * H if eagle3 else H

        def m(*shape):
            return (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(shape[0])).astype(dtype)

        w = lambda *shape: nnx.Param(m(*shape))

        ones = lambda n: nnx.Param(jnp.ones((n,), dtype))
        self.fc = w(fc_in, H)
        if cfg.fc_bias:
            self.fc_bias = nnx.Param(jnp.zeros((H,), dtype))
        # q, k and v in one matrix and gate and up in another, as the target's and DFLASH's layers
        # (checkpoints keep them apart: FUSED). XLA's dot merging had already run the separate
        # matrices as two GEMMs on the H100 (step_profile-topk-*.json: the draft's GEMM count unchanged)
        self.wqkv = nnx.Param(jnp.concatenate([m(attn_in, hq), m(attn_in, hk), m(attn_in, hk)], 1))
        self.wo = w(hq, H)
        self.post_norm = ones(H)
        self.w_gate_up = nnx.Param(jnp.concatenate([m(H, F), m(H, F)], 1))
        self.w_down = w(F, H)
        if eagle3:
            self.input_norm, self.hidden_norm, self.norm = ones(H), ones(H), ones(H)
            self.lm_head = w(H, cfg.draft_vocab_size)
            # target id of each draft id (the checkpoint stores the difference, d2t)
            self.draft_to_target = nnx.Variable(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32))

    # -- features in, logits out -----------------------------------------------------------------
    def features(self, target_final, target_layers):
        """The hidden the head reads at catch-up positions: [B, T, H]."""
        if self.cfg.kind == "eagle":
            return target_final
        fused = jnp.concatenate(list(target_layers), axis=-1)  # [B, T, 3H], low/mid/high
        return (fused @ self.fc[...]).astype(target_final.dtype)

    @property
    def borrows_target_head(self) -> bool:
        """An EAGLE head without a token map drafts through the target's own projection."""
        return self.cfg.kind == "eagle" and self.cfg.draft_vocab_size == self.cfg.vocab_size

    def logits(self, target, out):
        """Draft logits [..., Vd] (float32) from the layer output."""
        if self.borrows_target_head:
            return target.logits(out)
        if self.cfg.kind == "eagle":  # a token map (token_map.py): the target's projection, cut to its columns
            return jnp.einsum("...h,hv->...v", out, self.lm_head[...], preferred_element_type=jnp.float32)
        h = rms_norm(out, self.norm[...], self.cfg.rms_norm_eps)
        return jnp.einsum("...h,hv->...v", h, self.lm_head[...], preferred_element_type=jnp.float32)

    def to_target(self, draft_ids):
        return draft_ids if self.borrows_target_head else self.draft_to_target[...][draft_ids]

    # -- the layer, split around its attention ---------------------------------------------------
    def qkv(self, emb, hidden, positions):
        """emb, hidden [B, T, H]; positions [B, T] -> q [B,T,Hq,D], k/v [B,T,Hkv,D], residual [B,T,H]."""
        cfg = self.cfg
        if cfg.kind == "eagle":
            x = jnp.concatenate([emb, hidden.astype(emb.dtype)], axis=-1) @ self.fc[...]
            if cfg.fc_bias:
                x = x + self.fc_bias[...]
            residual = a = x
        else:
            residual = hidden.astype(emb.dtype)
            a = jnp.concatenate([rms_norm(emb, self.input_norm[...], cfg.rms_norm_eps),
                                 rms_norm(residual, self.hidden_norm[...], cfg.rms_norm_eps)], axis=-1)
        b, t = emb.shape[:2]
        inv = rope_frequencies(cfg)
        q, k, v = jnp.split(a @ self.wqkv[...], qkv_splits(cfg), axis=-1)
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k, v = (x.reshape(b, t, cfg.num_kv_heads, cfg.head_dim) for x in (k, v))
        return apply_rope(q, positions, inv), apply_rope(k, positions, inv), v, residual

    def finish(self, attn_out, residual):
        """attn_out [B, T, Hq, D] -> layer output [B, T, H] (the next step's hidden)."""
        b, t = residual.shape[:2]
        x = residual + attn_out.reshape(b, t, -1) @ self.wo[...]
        h = rms_norm(x, self.post_norm[...], self.cfg.rms_norm_eps)
        gate, up = jnp.split(h @ self.w_gate_up[...], 2, axis=-1)
        return x + (jax.nn.silu(gate) * up) @ self.w_down[...]


# -- checkpoint layouts ------------------------------------------------------------------------------
# checkpoint name -> (our name, transpose). EAGLE-3 as SGLang/SpecForge write it; EAGLE as SafeAILab's.
EAGLE3_NAMES = {
    "fc.weight": ("fc", True), "midlayer.input_layernorm.weight": ("input_norm", False),
    "midlayer.hidden_norm.weight": ("hidden_norm", False),
    "midlayer.self_attn.q_proj.weight": ("wq", True), "midlayer.self_attn.k_proj.weight": ("wk", True),
    "midlayer.self_attn.v_proj.weight": ("wv", True), "midlayer.self_attn.o_proj.weight": ("wo", True),
    "midlayer.post_attention_layernorm.weight": ("post_norm", False),
    "midlayer.mlp.gate_proj.weight": ("w_gate", True), "midlayer.mlp.up_proj.weight": ("w_up", True),
    "midlayer.mlp.down_proj.weight": ("w_down", True), "norm.weight": ("norm", False),
    "lm_head.weight": ("lm_head", True),
}
EAGLE_NAMES = {
    "fc.weight": ("fc", True), "fc.bias": ("fc_bias", False),
    "layers.0.self_attn.q_proj.weight": ("wq", True), "layers.0.self_attn.k_proj.weight": ("wk", True),
    "layers.0.self_attn.v_proj.weight": ("wv", True), "layers.0.self_attn.o_proj.weight": ("wo", True),
    "layers.0.post_attention_layernorm.weight": ("post_norm", False),
    "layers.0.mlp.gate_proj.weight": ("w_gate", True), "layers.0.mlp.up_proj.weight": ("w_up", True),
    "layers.0.mlp.down_proj.weight": ("w_down", True),
}
# our fused matrix -> the checkpoint's parts, concatenated along the output axis in this order
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
IGNORED = ("embed_tokens.weight", "t2d", "layers.0.input_layernorm.weight")


def qkv_splits(cfg: HeadConfig) -> list:
    """Where wqkv's columns (and its products') split into q, k and v."""
    hq, hk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [hq, hq + hk]


def _read_tensors(directory: str) -> dict:
    from jaxspec.models.torch_zip import read_torch_zip
    from jaxspec.models.loading import read_safetensors
    st = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    if st:
        return read_safetensors(directory)
    bins = sorted(f for f in os.listdir(directory) if f.endswith(".bin"))
    if not bins:
        raise CheckpointError(f"{directory}: no *.safetensors or pytorch_model*.bin weights")
    out = {}
    for f in bins:
        out.update(read_torch_zip(os.path.join(directory, f)))
    return out


def load_head(directory: str, target_cfg: ModelConfig, target=None, dtype=jnp.float32) -> DraftHead:
    """Load an EAGLE or EAGLE-3 head from config.json + safetensors (or torch .bin) weights."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"draft model {directory!r}: no such directory")
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"draft model {directory}: config.json is missing")
    with open(cfg_path) as f:
        hf = json.load(f)
    tensors = {k.removeprefix("model."): v for k, v in _read_tensors(directory).items()}
    kind = "eagle3" if any(k.startswith("midlayer.") for k in tensors) else "eagle"
    if hf.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"draft model {directory}: {hf['num_hidden_layers']} layers; jaxspec loads one-layer heads")
    try:
        H, nh = hf["hidden_size"], hf["num_attention_heads"]
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        n = target_cfg.num_layers
        cfg = HeadConfig(
            kind=kind, hidden_size=H, num_heads=nh, num_kv_heads=hf.get("num_key_value_heads", nh),
            head_dim=hf.get("head_dim") or H // nh, intermediate_size=hf["intermediate_size"],
            vocab_size=hf.get("vocab_size", target_cfg.vocab_size),
            draft_vocab_size=((hf.get("draft_vocab_size") or hf.get("vocab_size", target_cfg.vocab_size))
                              if kind == "eagle3" else target_cfg.vocab_size),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=target_cfg.rope_scaling, fc_bias="fc.bias" in tensors,
            feature_layers=tuple(ids) if ids else (default_feature_layers(n) if kind == "eagle3" else ()))
    except KeyError as e:
        raise CheckpointError(f"draft model {cfg_path}: missing required field {e.args[0]!r}") from None
    cfg.check_target(target_cfg, f"draft model {directory}")
    names = EAGLE3_NAMES if kind == "eagle3" else EAGLE_NAMES
    head = nnx.eval_shape(lambda: DraftHead(cfg, dtype=dtype))
    state = nnx.state(head)
    flat = dict(nnx.to_flat_state(state))
    found = {}
    for name, arr in tensors.items():
        if name in IGNORED or name == "d2t":
            continue
        if name not in names:
            raise CheckpointError(f"draft model {directory}: unexpected tensor {name!r} for an {kind} head")
        ours, transpose = names[name]
        a = np.asarray(arr, np.float32)
        found[ours] = a.T if transpose else a
    for fused, parts in FUSED.items():
        missing = [p for p in parts if p not in found]
        if missing:
            raise CheckpointError(f"draft model {directory}: tensor for {missing[0]!r} is missing")
        shapes = {found[p].shape[0] for p in parts}
        if len(shapes) != 1:
            raise CheckpointError(f"draft model {directory}: {', '.join(parts)} have different input sizes "
                                  f"{[found[p].shape for p in parts]}")
        found[fused] = np.concatenate([found.pop(p) for p in parts], axis=1)
    if kind == "eagle3" and "lm_head" not in found and target is not None and cfg.draft_vocab_size == cfg.vocab_size:
        found["lm_head"] = np.asarray(target.embed[...]).T  # tied to the target's embedding
    host = {}
    for key, var in flat.items():
        name = key[0]
        if name == "draft_to_target":
            if "d2t" in tensors:
                d2t = np.asarray(tensors["d2t"]).astype(np.int64)
                if d2t.shape != (cfg.draft_vocab_size,):
                    raise CheckpointError(f"draft model {directory}: d2t has shape {d2t.shape}, "
                                          f"expected ({cfg.draft_vocab_size},)")
                host[key] = (np.arange(cfg.draft_vocab_size) + d2t).astype(np.int32)
            else:
                host[key] = np.arange(cfg.draft_vocab_size, dtype=np.int32)
            continue
        if name not in found:
            raise CheckpointError(f"draft model {directory}: tensor for {name!r} is missing")
        want = var.get_value().shape
        if found[name].shape != want:
            raise CheckpointError(f"draft model {directory}: {name} has shape {found[name].shape}, expected {want}")
        host[key] = np.ascontiguousarray(found[name], np.dtype(dtype))
    # cast on the host and put on the device in one transfer: a cast on the device compiled a
    # program per weight shape at every start
    for key, value in zip(host, jax.device_put(list(host.values()))):
        flat[key].set_value(value)
    nnx.update(head, nnx.from_flat_state(flat))
    return head


def export_head(head: DraftHead, directory: str, target_cfg: ModelConfig, extra_config: dict | None = None):
    """Write the head in the layout `load_head` reads (SGLang's EAGLE-3 / SafeAILab's EAGLE names)."""
    from safetensors.numpy import save_file
    cfg = head.cfg
    os.makedirs(directory, exist_ok=True)
    names = EAGLE3_NAMES if cfg.kind == "eagle3" else EAGLE_NAMES
    mats = {ours: np.asarray(getattr(head, ours)[...], np.float32) for ours, _ in names.values() if hasattr(head, ours)}
    mats.update(zip(FUSED["wqkv"], np.split(np.asarray(head.wqkv[...], np.float32), qkv_splits(cfg), axis=1)))
    mats.update(zip(FUSED["w_gate_up"], np.split(np.asarray(head.w_gate_up[...], np.float32), 2, axis=1)))
    out = {}
    for ck, (ours, transpose) in names.items():
        if ours in mats:
            out[ck] = np.ascontiguousarray(mats[ours].T if transpose else mats[ours])
    if cfg.kind == "eagle3":
        d2t = np.asarray(head.draft_to_target[...], np.int64)
        out["d2t"] = d2t - np.arange(cfg.draft_vocab_size)
        t2d = np.zeros(cfg.vocab_size, bool)
        t2d[d2t] = True
        out["t2d"] = t2d
    dt = np.asarray(head.wqkv[...]).dtype
    if dt != np.float32:  # keep the file as small as the weights are
        out = {k: (v.astype(dt) if v.dtype == np.float32 else v) for k, v in out.items()}
    save_file(out, os.path.join(directory, "model.safetensors"))
    hf = {
        "architectures": ["LlamaForCausalLMEagle3" if cfg.kind == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama", "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
        "max_position_embeddings": target_cfg.max_position, "tie_word_embeddings": False,
        "torch_dtype": {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(str(dt), "float32"),
    }
    if cfg.kind == "eagle3":
        hf["draft_vocab_size"] = cfg.draft_vocab_size
        hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers)}
    else:
        hf["bias"] = cfg.fc_bias
    hf.update(extra_config or {})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)


class EagleDrafter(DeviceDrafter):
    """An EAGLE or EAGLE-3 head and the tree shape it drafts (see eagle_step.py), and the token
    map that refreshes its draft vocabulary from what is emitted, if any (token_map.py)."""

    def __init__(self, head, tree, adaptive_map=None):
        super().__init__(head, tree)
        self.adaptive_map = adaptive_map

    def finish(self, req):
        super().finish(req)
        if self.adaptive_map is not None:
            self.adaptive_map.observe(req.output_ids)

    def refresh(self):
        return self.adaptive_map is not None and self.adaptive_map.refresh()

    def reset(self):
        if self.adaptive_map is not None:
            self.adaptive_map.reset()

    def cache_shape(self):
        c = self.head.cfg
        return 1, c.num_kv_heads, c.head_dim

    def auto_trees(self):
        """From a chain of three drafts to a 64-node tree (on the H100 6:4:24 led at batch 1 and its
        16-node cut at batch 8 on MT-bench, 3:1:4 at batch 8 on HumanEval: spec-auto-*.json). 6:4:32
        replaced 6:4:24: the same 32-wide verify program and draft steps, 2-6% more accepted at batch 1
        (H200: 2.31x / 2.88x plain on MT-bench / HumanEval against 2.22x / 2.71x, spec-dflash4-)."""
        from jaxspec.drafters.eagle_step import TreeShape
        shapes = [*map(TreeShape.parse, ("3:1:4", "4:2:8", "6:4:16")), TreeShape(*DEFAULT_TREE), TreeShape.parse("6:8:64")]
        return tuple(t for t in shapes if t.topk <= self.head.cfg.draft_vocab_size)

    def step_module(self):
        from jaxspec.drafters import eagle_step
        return eagle_step
