"""DFLASH: a block-diffusion drafter that proposes a whole block of tokens in one forward pass
(the DFlash paper, arXiv 2602.06036; z-lab/dflash; SGLang's DFLASH worker, seed 003).

The drafter is a few decoder layers with no embedding or lm_head of its own (the target's are
used). Its context is the target's own residual streams at a few layers (evenly spaced, as
`build_target_layer_ids` picks them), concatenated, projected by `fc` and normed by
`hidden_norm`: every drafter layer projects that context into its K/V (no queries: context
positions are never predicted). The block is [last accepted token, mask token x (block - 1)] at
the next positions; it attends to all the context and, non-causally, to the whole block; the
target's lm_head on the normed output at block positions 1.. gives the drafted tokens.

So the drafter's cache holds, for each committed position, K/V computed from the target's
features there alone: after a verify step only the accepted positions are new, and their K/V are
projections (no attention), which is why DFLASH's catch-up is nearly free (see dflash_step.py).
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
from jaxspec.models.llama import rms_norm, rotate
from jaxspec.models.loading import CheckpointError


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple:
    """The target layers whose outputs form the context: evenly spaced from layer 1 to L-3 (the
    reference implementation's choice, so that checkpoints without explicit ids load the same),
    clamped for very shallow test models."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    ids = (int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))
    return tuple(min(max(i, 0), num_target_layers - 1) for i in ids)


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    target_layer_ids: tuple  # target layers whose outputs (residual streams) are the context
    block_size: int  # tokens a draft pass proposes, the last accepted one included
    mask_token: int  # the id whose (target) embedding fills the block's unknown positions
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None

    @classmethod
    def for_target(cls, target: ModelConfig, num_layers=3, block_size=16, mask_token=0, target_layer_ids=None,
                   intermediate_size=None):
        """A drafter with the target's layer shape (what the reference trains)."""
        ids = tuple(target_layer_ids) if target_layer_ids else build_target_layer_ids(target.num_layers, num_layers)
        return cls(hidden_size=target.hidden_size, num_layers=num_layers, num_heads=target.num_heads,
                   num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   intermediate_size=intermediate_size or target.intermediate_size, vocab_size=target.vocab_size,
                   target_layer_ids=ids, block_size=block_size, mask_token=mask_token,
                   num_target_layers=target.num_layers, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, rope_scaling=target.rope_scaling)

    def check_target(self, target: ModelConfig, source: str = "DFLASH drafter"):
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target's {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target's {target.vocab_size}")
        if self.num_target_layers != target.num_layers:
            problems.append(f"trained for a {self.num_target_layers}-layer target, this one has {target.num_layers}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's {target.num_layers} layers")
        if not 0 <= self.mask_token < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token} outside the vocabulary [0, {target.vocab_size})")
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} < 2")
        if problems:
            raise CheckpointError(f"{source} does not match the target model: " + "; ".join(problems))


def _w(rngs, dtype, *shape):
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(shape[0])).astype(dtype))


class DFlashLayer(nnx.Module):
    """One drafter layer. wkv = [wk | wv] (the context's only projection), w_gate_up = [gate | up]."""

    def __init__(self, cfg: DFlashConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        H, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        ones = lambda n: nnx.Param(jnp.ones((n,), dtype))
        self.input_norm, self.post_norm, self.q_norm, self.k_norm = ones(H), ones(H), ones(D), ones(D)
        self.wq = _w(rngs, dtype, H, cfg.num_heads * D)
        self.wkv = _w(rngs, dtype, H, 2 * cfg.num_kv_heads * D)
        self.wo = _w(rngs, dtype, cfg.num_heads * D, H)
        self.w_gate_up = _w(rngs, dtype, H, 2 * F)
        self.w_down = _w(rngs, dtype, F, H)

    def kv(self, x, rope):
        """x [B, T, H] (the context, or the block's normed input) -> k (normed, rotated), v [B, T, Hkv, D]."""
        cfg = self.cfg
        b, t, _ = x.shape
        k, v = jnp.split((x @ self.wkv[...]).reshape(b, t, 2 * cfg.num_kv_heads, cfg.head_dim), 2, axis=2)
        return rotate(rms_norm(k, self.k_norm[...], cfg.rms_norm_eps), rope), v

    def qkv(self, x, rope):
        """The block's input x [B, T, H] -> q, k, v (its own keys and values)."""
        cfg = self.cfg
        b, t, _ = x.shape
        h = rms_norm(x, self.input_norm[...], cfg.rms_norm_eps)
        q = (h @ self.wq[...]).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k, v = self.kv(h, rope)
        return rotate(rms_norm(q, self.q_norm[...], cfg.rms_norm_eps), rope), k, v

    def finish(self, x, attn_out):
        """x + attention output [B, T, Hq, D], then the MLP."""
        b, t = x.shape[:2]
        x = x + attn_out.reshape(b, t, -1) @ self.wo[...]
        gate, up = jnp.split(rms_norm(x, self.post_norm[...], self.cfg.rms_norm_eps) @ self.w_gate_up[...], 2, axis=-1)
        return x + (jax.nn.silu(gate) * up) @ self.w_down[...]


class DFlashHead(nnx.Module):
    """Random init is for tests and the start of training; `load_dflash` overwrites it."""

    def __init__(self, cfg: DFlashConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        rngs = rngs or nnx.Rngs(0)
        H = cfg.hidden_size
        self.fc = _w(rngs, dtype, len(cfg.target_layer_ids) * H, H)
        self.hidden_norm = nnx.Param(jnp.ones((H,), dtype))
        self.layers = nnx.List([DFlashLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.Param(jnp.ones((H,), dtype))

    def context(self, features):
        """The target's selected layer outputs [len(ids), B, T, H] -> the context [B, T, H]."""
        n, b, t, h = features.shape
        fused = jnp.moveaxis(features, 0, 2).reshape(b, t, n * h)  # concatenated in target_layer_ids' order
        return rms_norm(fused.astype(self.fc[...].dtype) @ self.fc[...], self.hidden_norm[...], self.cfg.rms_norm_eps)

    def logits(self, target, x):
        return target.logits(rms_norm(x, self.norm[...], self.cfg.rms_norm_eps))


# -- the checkpoint layout (z-lab's DFlashDraftModel: config.json + safetensors) ----------------------------
def _layer_names(i: int) -> dict:
    p = f"layers.{i}."
    return {p + "input_layernorm.weight": "input_norm", p + "post_attention_layernorm.weight": "post_norm",
            p + "self_attn.q_norm.weight": "q_norm", p + "self_attn.k_norm.weight": "k_norm",
            p + "self_attn.q_proj.weight": "wq", p + "self_attn.k_proj.weight": "wk",
            p + "self_attn.v_proj.weight": "wv", p + "self_attn.o_proj.weight": "wo",
            p + "mlp.gate_proj.weight": "w_gate", p + "mlp.up_proj.weight": "w_up", p + "mlp.down_proj.weight": "w_down"}


def _rope_scaling(hf: dict, target_cfg: ModelConfig):
    rs = hf.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        return (float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                int(rs["original_max_position_embeddings"]))
    return None if rs is None else target_cfg.rope_scaling


def load_dflash(directory: str, target_cfg: ModelConfig, dtype=jnp.float32) -> DFlashHead:
    """A DFLASH drafter from z-lab's layout: config.json (a Qwen3/Llama config with block_size,
    num_target_layers and dflash_config {target_layer_ids, mask_token_id}) + safetensors."""
    from jaxspec.models.loading import read_safetensors
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise CheckpointError(f"DFLASH drafter {directory!r}: no such directory")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"DFLASH drafter {directory}: config.json is missing")
    with open(cfg_path) as f:
        hf = json.load(f)
    dc = hf.get("dflash_config") or {}
    try:
        nh, L = hf["num_attention_heads"], hf["num_hidden_layers"]
        if "mask_token_id" not in dc:
            raise KeyError("dflash_config.mask_token_id")
        cfg = DFlashConfig(
            hidden_size=hf["hidden_size"], num_layers=L, num_heads=nh, num_kv_heads=hf.get("num_key_value_heads", nh),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // nh, intermediate_size=hf["intermediate_size"],
            vocab_size=hf.get("vocab_size", target_cfg.vocab_size),
            target_layer_ids=tuple(dc.get("target_layer_ids") or build_target_layer_ids(hf["num_target_layers"], L)),
            block_size=int(hf["block_size"]), mask_token=int(dc["mask_token_id"]),
            num_target_layers=int(hf.get("num_target_layers", target_cfg.num_layers)),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(hf, target_cfg))
    except KeyError as e:
        raise CheckpointError(f"DFLASH drafter {cfg_path}: missing required field {e.args[0]!r}") from None
    cfg.check_target(target_cfg, f"DFLASH drafter {directory}")
    tensors = {k.removeprefix("model."): np.asarray(v, np.float32) for k, v in read_safetensors(directory).items()}
    names = {"fc.weight": "fc", "hidden_norm.weight": "hidden_norm", "norm.weight": "norm"}
    layer_names = [_layer_names(i) for i in range(cfg.num_layers)]
    known = set(names).union(*layer_names)
    extra = sorted(set(tensors) - known)
    if extra:
        raise CheckpointError(f"DFLASH drafter {directory}: unexpected tensor {extra[0]!r} "
                              "(biases, an embedding or an lm_head are not part of this layout)")

    def take(name, shape, transpose):
        if name not in tensors:
            raise CheckpointError(f"DFLASH drafter {directory}: tensor {name!r} is missing")
        a = tensors[name].T if transpose else tensors[name]
        if a.shape != shape:
            raise CheckpointError(f"DFLASH drafter {directory}: {name} has shape {a.shape[::-1] if transpose else a.shape}, "
                                  f"expected {shape[::-1] if transpose else shape}")
        return jnp.asarray(a, dtype)

    head = nnx.eval_shape(lambda: DFlashHead(cfg, dtype=dtype))
    H, D = cfg.hidden_size, cfg.head_dim
    hq, hk = cfg.num_heads * D, cfg.num_kv_heads * D
    head.fc = nnx.Param(take("fc.weight", (len(cfg.target_layer_ids) * H, H), True))
    head.hidden_norm = nnx.Param(take("hidden_norm.weight", (H,), False))
    head.norm = nnx.Param(take("norm.weight", (H,), False))
    for layer, nm in zip(head.layers, layer_names):
        by = {v: k for k, v in nm.items()}
        for ours, shape in (("input_norm", (H,)), ("post_norm", (H,)), ("q_norm", (D,)), ("k_norm", (D,))):
            setattr(layer, ours, nnx.Param(take(by[ours], shape, False)))
        layer.wq = nnx.Param(take(by["wq"], (H, hq), True))
        layer.wkv = nnx.Param(jnp.concatenate([take(by["wk"], (H, hk), True), take(by["wv"], (H, hk), True)], 1))
        layer.wo = nnx.Param(take(by["wo"], (hq, H), True))
        F = cfg.intermediate_size
        layer.w_gate_up = nnx.Param(jnp.concatenate([take(by["w_gate"], (H, F), True), take(by["w_up"], (H, F), True)], 1))
        layer.w_down = nnx.Param(take(by["w_down"], (F, H), True))
    return head


def export_dflash(head: DFlashHead, directory: str, target_cfg: ModelConfig, extra_config: dict | None = None):
    """Write the drafter in the layout `load_dflash` (and z-lab's DFlashDraftModel) reads."""
    from safetensors.numpy import save_file
    cfg = head.cfg
    os.makedirs(directory, exist_ok=True)
    a = lambda x: np.asarray(x[...], np.float32)
    out = {"fc.weight": a(head.fc).T, "hidden_norm.weight": a(head.hidden_norm), "norm.weight": a(head.norm)}
    hk, F = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i, layer in enumerate(head.layers):
        nm = {v: k for k, v in _layer_names(i).items()}
        wkv, gu = a(layer.wkv), a(layer.w_gate_up)
        mats = {"wq": a(layer.wq), "wk": wkv[:, :hk], "wv": wkv[:, hk:], "wo": a(layer.wo), "w_gate": gu[:, :F],
                "w_up": gu[:, F:], "w_down": a(layer.w_down)}
        out.update({nm[k]: v.T for k, v in mats.items()})
        out.update({nm[k]: a(getattr(layer, k)) for k in ("input_norm", "post_norm", "q_norm", "k_norm")})
    dt = np.asarray(head.fc[...]).dtype
    out = {k: np.ascontiguousarray(v.astype(dt) if dt != np.float32 else v) for k, v in out.items()}
    save_file(out, os.path.join(directory, "model.safetensors"))
    hf = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
          "rope_theta": cfg.rope_theta, "max_position_embeddings": target_cfg.max_position, "hidden_act": "silu",
          "attention_bias": False, "tie_word_embeddings": False, "block_size": cfg.block_size,
          "num_target_layers": cfg.num_target_layers,
          "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token},
          "torch_dtype": {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(str(dt), "float32")}
    if cfg.rope_scaling is not None:
        f, lo, hi, orig = cfg.rope_scaling
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
                              "original_max_position_embeddings": orig}
    hf.update(extra_config or {})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)


class DFlashDrafter(DeviceDrafter):
    """A DFLASH drafter and what it drafts: a block of tree.steps + 1 tokens a pass, verified as a
    chain (tree.topk 1) or as a tree of tree.num_draft_tokens nodes."""

    def __init__(self, head: DFlashHead, tree):
        super().__init__(head, tree)
        self.draft_slots = tree.steps + 1  # the block's own K/V, written after the accepted tokens

    def cache_shape(self):
        c = self.head.cfg
        return c.num_layers, c.num_kv_heads, c.head_dim

    def auto_trees(self):
        """The block verified as chains of 4, 8 and all its tokens, and as a top-8 tree of twice its
        width: one drafter pass each (the block's width, hence draft_slots, stays). The tree's nodes
        are its verify's cost, its top-k only which tokens they hold: at 32 nodes over the shipped
        drafter's block, top-8 walked 2.70 tokens a step on MT-bench against top-4's 2.56
        (dflash_tree_scores-widths-cpu.json; top-16 2.75)."""
        from jaxspec.drafters.eagle_step import TreeShape
        s = self.tree.steps
        chains = tuple(dict.fromkeys(TreeShape(s, 1, min(n, s + 1)) for n in (4, 8, s + 1)))
        return chains + (TreeShape(s, 8, 2 * (s + 1)),)

    def cut_shapes(self):
        """As DeviceDrafter's, but no chain stands for a cut of a tree: the tree keeps the block's
        most probable nodes, shallow and wide where the positions are uncertain, the chain the top
        token at every position. Linked through such cuts, the policy expected 15:4:32 to emit 3-4%
        more than the chain of 16 a step, where it accepted 24-25% more (spec-dflash-spells-, batch
        1), and verified the chain; the tree's own calls say what it accepts."""
        return tuple(s for s in super().cut_shapes() if s.topk > 1 or self.tree.topk == 1)

    def with_tree(self, tree):
        if tree.steps != self.tree.steps:
            raise ValueError(f"a DFLASH drafter's trees share its block of {self.tree.steps + 1} tokens; got {tree.label}")
        return super().with_tree(tree)

    def step_module(self):
        from jaxspec.drafters import dflash_step
        return dflash_step
