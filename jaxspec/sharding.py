"""Tensor parallelism with jax.sharding: a one-axis mesh ('tp'), each weight's PartitionSpec by
name, and the fused matrices laid out so that every shard holds whole heads.

Megatron's split, as SGLang and vLLM use it: QKV and gate/up column-parallel, O and down
row-parallel (XLA inserts the all-reduce after them), embedding and lm_head vocabulary-parallel,
norms replicated; the KV cache sharded by KV head. The fused [q | k | v] and [gate | up] columns
are regrouped into [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] with shard s holding its own heads, so a
column split needs no communication; `ModelConfig.shard_groups` tells the decoder that layout.
With fewer KV heads than shards each KV head is repeated (as SGLang does): every shard then holds
one KV head for its query heads. Attention kernels run per shard under `shard_map`
(attention.py); everything else is partitioned by XLA's SPMD partitioner from these specs.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.models.config import ModelConfig

AXIS = "tp"


def tp_mesh(tp: int, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or tp > len(devices):
        raise ValueError(f"tp_size={tp} needs {tp} devices; {len(devices)} are visible")
    return jax.make_mesh((tp,), (AXIS,), devices=devices[:tp], axis_types=(jax.sharding.AxisType.Auto,))


def tp_size(mesh) -> int:
    return 1 if mesh is None or mesh.empty or AXIS not in mesh.axis_names else mesh.shape[AXIS]


def tp_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The configuration of the model laid out for tp shards."""
    if tp == 1:
        return cfg
    if cfg.shard_groups != 1:
        raise ValueError("this model is laid out for tensor parallelism already")
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (neither divides the other)")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if problems:
        raise ValueError(f"tp_size={tp} does not divide the model's " + ", ".join(problems))
    return dataclasses.replace(cfg, num_kv_heads=max(cfg.num_kv_heads, tp), shard_groups=tp)


def tp_weights(cfg: ModelConfig, weights: dict, tp: int) -> dict:
    """Host (numpy) weights of `cfg`'s layout -> those of tp_config(cfg, tp)'s."""
    if tp == 1:
        return weights
    d, hq, hk = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    rep = max(1, tp // hk)  # each KV head repeated for the shards that share it

    def regroup_qkv(w):  # [..., (hq + 2 hk) d] -> per shard [q_s k_s v_s]
        q, k, v = np.split(w, [hq * d, (hq + hk) * d], axis=-1)
        lead = w.shape[:-1]
        k = np.repeat(k.reshape(*lead, hk, d), rep, axis=-2)
        v = np.repeat(v.reshape(*lead, hk, d), rep, axis=-2)
        parts = [x.reshape(*lead, tp, -1) for x in (q, k.reshape(*lead, -1), v.reshape(*lead, -1))]
        return np.concatenate(parts, axis=-1).reshape(*lead, -1)

    def regroup_gate_up(w):
        g, u = np.split(w, 2, axis=-1)
        lead = w.shape[:-1]
        return np.concatenate([g.reshape(*lead, tp, -1), u.reshape(*lead, tp, -1)], axis=-1).reshape(*lead, -1)

    out = dict(weights)
    for key, w in weights.items():
        name = key.rsplit("/", 1)[-1]
        if name in ("wqkv", "bqkv"):
            out[key] = regroup_qkv(np.asarray(w))
        elif name == "w_gate_up":
            out[key] = regroup_gate_up(np.asarray(w))
    return out


def weight_spec(key: str, shape: tuple, tp: int) -> P:
    """The PartitionSpec of the target weight at `key` ('layers/3/wqkv', 'embed', ...)."""
    name = key.rsplit("/", 1)[-1]
    spec = {"embed": P(AXIS, None), "lm_head": P(None, AXIS), "wqkv": P(None, AXIS), "bqkv": P(AXIS),
            "w_gate_up": P(None, AXIS), "wo": P(AXIS, None), "w_down": P(AXIS, None)}.get(name, P())
    for dim, axis in enumerate(spec):
        if axis is not None and shape[dim] % tp:
            return P()  # e.g. a vocabulary the shards do not divide: kept whole on each
    return spec


def cache_sharding(mesh, num_kv_heads: int) -> NamedSharding | None:
    """KV pages [L, pages, page size, KV heads, D], sharded by KV head where the heads divide
    (None without a mesh: the default device)."""
    if mesh is None:
        return None
    tp = tp_size(mesh)
    return NamedSharding(mesh, P(None, None, None, AXIS, None) if num_kv_heads % tp == 0 else P())


def replicate(module, mesh):
    """Put a module's arrays on every device of the mesh, in place (drafter heads: small enough
    that a copy a device costs less than the collectives a split would add)."""
    from flax import nnx
    nnx.update(module, jax.device_put(nnx.state(module), NamedSharding(mesh, P())))
    return module


def per_device_bytes(tree) -> list[int]:
    """Bytes each device holds of the arrays in tree."""
    out = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return [out[d] for d in sorted(out, key=lambda d: d.id)]
