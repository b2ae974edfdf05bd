"""The PyTorch anchor: a gpt-fast-style Llama decode step (static KV cache, SDPA, bf16,
torch.compile(mode="reduce-overhead", fullgraph=True): CUDA graphs), random weights, on the shapes
jaxspec's benches time. What a PyTorch user gets from the same GPU without any speculation.

    python bench/torch_anchor.py --models llama3-8b,smollm2-135m --batches 1,8,64 --context 1024 --out rows.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

SHAPES = {
    "llama3-8b": dict(vocab=128256, dim=4096, ffn=14336, layers=32, heads=32, kv_heads=8, head_dim=128, theta=500000.0),
    "smollm2-135m": dict(vocab=49152, dim=576, ffn=1536, layers=30, heads=9, kv_heads=3, head_dim=64, theta=100000.0),
}


class Layer(torch.nn.Module):
    def __init__(self, s, batch, max_len):
        super().__init__()
        d, hq, hk = s["head_dim"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
        self.s = s
        self.wqkv = torch.nn.Linear(s["dim"], hq + 2 * hk, bias=False)
        self.wo = torch.nn.Linear(hq, s["dim"], bias=False)
        self.w13 = torch.nn.Linear(s["dim"], 2 * s["ffn"], bias=False)
        self.w2 = torch.nn.Linear(s["ffn"], s["dim"], bias=False)
        self.n1 = torch.nn.RMSNorm(s["dim"], eps=1e-5)
        self.n2 = torch.nn.RMSNorm(s["dim"], eps=1e-5)
        self.register_buffer("k", torch.zeros(batch, s["kv_heads"], max_len, d))
        self.register_buffer("v", torch.zeros(batch, s["kv_heads"], max_len, d))

    def forward(self, x, cos, sin, pos, mask):
        s = self.s
        b, t, _ = x.shape
        d, hq, hk = s["head_dim"], s["heads"], s["kv_heads"]
        q, k, v = self.wqkv(self.n1(x)).split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = (a.view(b, t, -1, d).transpose(1, 2) for a in (q, k, v))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v
        o = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, -1))
        g, u = self.w13(self.n2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(g) * u)


def rope(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Model(torch.nn.Module):
    def __init__(self, s, batch, max_len):
        super().__init__()
        self.embed = torch.nn.Embedding(s["vocab"], s["dim"])
        self.layers = torch.nn.ModuleList(Layer(s, batch, max_len) for _ in range(s["layers"]))
        self.norm = torch.nn.RMSNorm(s["dim"], eps=1e-5)
        self.head = torch.nn.Linear(s["dim"], s["vocab"], bias=False)
        inv = 1.0 / (s["theta"] ** (torch.arange(0, s["head_dim"], 2).float() / s["head_dim"]))
        ang = torch.arange(max_len).float()[:, None] * inv[None]
        self.register_buffer("cos", ang.cos())
        self.register_buffer("sin", ang.sin())
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril())

    def forward(self, tokens, pos):
        x = self.embed(tokens)
        cos, sin, mask = self.cos[pos], self.sin[pos], self.causal[pos][None, None]
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return self.head(self.norm(x)).argmax(-1)


def step_ms(name, batch, context, steps=50):
    s = SHAPES[name]
    max_len = context + steps + 8
    with torch.device("cuda"):
        model = Model(s, batch, max_len).to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))
    model.eval()
    decode = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    tok = torch.ones(batch, 1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        for i in range(5):  # compile, capture, warm up
            tok = decode(tok, torch.tensor([context + i], device="cuda")).clone()  # as gpt-fast: the graph's
        torch.cuda.synchronize()                                                   # output buffer is reused
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for i in range(steps):
            tok = decode(tok, torch.tensor([context + i], device="cuda")).clone()
        e1.record()
        torch.cuda.synchronize()
    ms = e0.elapsed_time(e1) / steps
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    del model, decode
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return ms, weights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3-8b,smollm2-135m")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        for b in map(int, args.batches.split(",")):
            t0 = time.perf_counter()
            ms, wbytes = step_ms(name, b, args.context)
            rows.append(dict(model=name, batch=b, context=args.context, engine="torch-compile", algorithm="plain",
                             ms_per_step=ms, tokens_per_s=b / ms * 1e3, weight_bytes=wbytes,
                             build_s=time.perf_counter() - t0, torch=torch.__version__))
            print(rows[-1], flush=True)
    if args.out:
        json.dump(rows, open(args.out, "w"))


if __name__ == "__main__":
    main()
