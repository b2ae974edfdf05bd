"""Build an FR-Spec token map: the K token ids a target emits most, for `--speculative-token-map`.

    python -m jaxspec.token_map --model smollm2-135m --out smollm2-map.npy --size 8192 [--prompts my.jsonl]

The target answers prompts (its own, written by itself as for drafter training, or a JSONL of
{"prompt": ...} / {"messages": [...]} lines), the tokens it emits are counted, and the K most
frequent ids are written (.npy or a JSON list; .pt as SGLang writes it when torch is installed),
with a report of how much of the emitted text each map size would have covered and a plot of it.
Never point it at a benchmark's prompts: the map is tuned to the text it counts.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def count_emitted(target, tokenizer, prompts, max_new_tokens: int, seed: int, batch: int,
                  num_prompts: int = 256) -> np.ndarray:
    """Counts [V] of the tokens the target emits answering `prompts` (token ids; None: num_prompts
    of its own), half greedily and half sampled at T=0.7."""
    from jaxspec import train_data
    if prompts is None:
        seqs, plens = train_data.build_data(target, tokenizer, num_prompts, max_new_tokens, 0.5, seed, batch)
    else:
        seqs, plens = train_data.distill(target, prompts, max_new_tokens, 0.5, seed, batch,
                                         train_data.eos_of(target, tokenizer))
    counts = np.zeros(target.cfg.vocab_size, np.int64)
    for s, n in zip(seqs, plens):
        np.add.at(counts, np.asarray(s[n:], np.int64), 1)
    return counts


def top_ids(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most counted ids, most frequent first (ties: lower id first)."""
    return np.argsort(-counts, kind="stable")[:size].astype(np.int32)


def coverage(counts: np.ndarray, sizes=COVERAGE_SIZES) -> dict:
    """{K: share of the counted tokens that the top-K ids cover}, for K below the vocabulary."""
    ranked = np.sort(counts)[::-1].cumsum()
    total = max(int(ranked[-1]), 1)
    return {k: float(ranked[min(k, len(ranked)) - 1] / total) for k in sizes if k < len(counts)}


def write_map(ids: np.ndarray, path: str):
    if path.endswith(".npy"):
        np.save(path, ids)
    elif path.endswith(".json"):
        with open(path, "w") as f:
            json.dump(ids.tolist(), f)
    elif path.endswith(".pt"):
        try:
            import torch
        except ImportError:
            raise SystemExit("writing a .pt map needs torch; write .npy or .json (jaxspec reads all three)") from None
        torch.save(torch.from_numpy(ids.astype(np.int64)), path)
    else:
        raise SystemExit(f"{path}: the map's file name must end in .npy, .json or .pt")


def read_prompts(path: str, tokenizer) -> list[list[int]]:
    """A JSONL of {"prompt": text} or {"messages": [...]} lines, as chat-templated token ids."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            msgs = row.get("messages") or ([{"role": "user", "content": row["prompt"]}] if "prompt" in row else None)
            if msgs is None:
                raise SystemExit(f"{path}:{n}: a line needs a 'prompt' or 'messages' field")
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def plot(cov: dict, path: str):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(list(cov), [100 * v for v in cov.values()], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("map size (ids)")
    ax.set_ylabel("emitted tokens covered (%)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True, help="the map: .npy, .json or .pt")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--prompts", help="JSONL of prompts (default: prompts the target writes itself)")
    ap.add_argument("--num-prompts", type=int, default=256, help="self-generated prompts (without --prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from jaxspec.models.loading import load
    target, tokenizer = load(args.model)
    if not 0 < args.size <= target.cfg.vocab_size:
        raise SystemExit(f"--size {args.size} must be in [1, {target.cfg.vocab_size}] (the vocabulary)")
    prompts = read_prompts(args.prompts, tokenizer) if args.prompts else None
    counts = count_emitted(target, tokenizer, prompts, args.max_new_tokens, args.seed, args.batch, args.num_prompts)
    write_map(top_ids(counts, args.size), args.out)
    cov = coverage(counts, sorted(set(COVERAGE_SIZES) | {args.size}))
    stem = os.path.splitext(args.out)[0]
    report = dict(model=args.model if not os.path.exists(args.model) else os.path.basename(args.model),
                  size=args.size, prompts=os.path.basename(args.prompts) if args.prompts else "self-generated",
                  emitted_tokens=int(counts.sum()), coverage={str(k): v for k, v in cov.items()})
    with open(stem + ".report.json", "w") as f:
        json.dump(report, f, indent=1)
    plot(cov, stem + ".coverage.png")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
