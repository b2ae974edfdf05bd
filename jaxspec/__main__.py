"""Command line: `python -m jaxspec generate --model smollm2-135m --prompt "..."`."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jaxspec")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text")
    g.add_argument("--model", default="smollm2-135m", help="short name, .gguf file or HF directory")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompts-file", help="a file with one prompt per line (or JSONL with a 'prompt' field)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--dtype", choices=["float32", "bfloat16"])
    g.add_argument("--speculative-algorithm", default="AUTO",
                   help="NGRAM, EAGLE, EAGLE3, NAIVE_EAGLE, DFLASH, NONE, or AUTO: EAGLE3 6:4:24 where a trained "
                        "head ships for the model, else NONE")
    g.add_argument("--speculative-num-draft-tokens", type=int, help="nodes verified a step (default 8; DFLASH: its block size)")
    g.add_argument("--speculative-draft-model-path", help="EAGLE head or DFLASH drafter directory (default: the shipped one)")
    g.add_argument("--speculative-token-map", help="FR-Spec: token ids the EAGLE head may draft (.pt/.npy/.json)")
    g.add_argument("--speculative-token-map-refresh", type=int, default=0,
                    help="refresh the token map from the emitted tokens every N of them (0: never)")
    g.add_argument("--speculative-num-steps", type=int)
    g.add_argument("--speculative-eagle-topk", type=int, default=4)
    g.add_argument("--speculative-policy", choices=["fixed", "measured"], default="fixed",
                    help="EAGLE family: verify every step (fixed), or verify or decode plainly by the programs' costs "
                         "timed at warm-up and the accept lengths seen (measured)")
    g.add_argument("--speculative-dflash-block-size", type=int,
                     help="DFLASH: tokens a draft pass proposes and a step verifies (default: the drafter's)")
    g.add_argument("--max-batch", type=int, default=32)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--tp-size", type=int, default=1, help="devices to split the model over (tensor parallel)")
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument("--json", action="store_true", help="print one JSON object per completion")
    g.add_argument("--no-warmup", action="store_true", help="compile programs as they are first needed")
    args = ap.parse_args(argv)

    import jax.numpy as jnp
    from jaxspec import Generator, SamplingParams, SpecConfig
    from jaxspec.sampling import SamplerFlags
    from jaxspec.models.loading import CheckpointError

    prompts = list(args.prompt or [])
    if args.prompts_file:
        for line in open(args.prompts_file):
            line = line.rstrip("\n")
            if line.strip():
                prompts.append(json.loads(line)["prompt"] if line.lstrip().startswith("{") else line)
    if not prompts:
        prompts = ["What is the capital of France?"]
    from jaxspec.speculative import resolve_auto
    resolve_auto(args)
    spec = None
    if args.speculative_algorithm.upper() != "NONE":
        spec = SpecConfig(args.speculative_algorithm, num_draft_tokens=args.speculative_num_draft_tokens,
                          draft_model_path=args.speculative_draft_model_path,
                          token_map=args.speculative_token_map,
                          token_map_refresh=args.speculative_token_map_refresh, num_steps=args.speculative_num_steps,
                          eagle_topk=args.speculative_eagle_topk,
                          dflash_block_size=args.speculative_dflash_block_size)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        # the program set these prompts can meet (their batch, their sampler) is built before the
        # first token, so no step waits for a compile mid-run
        gen = Generator.from_pretrained(args.model, dtype=getattr(jnp, args.dtype) if args.dtype else None,
                                        speculative=spec, max_batch=min(args.max_batch, len(prompts)),
                                        page_size=args.page_size, max_seq_len=args.max_seq_len, tp_size=args.tp_size,
                                        spec_policy=args.speculative_policy,
                                        warmup=not args.no_warmup, warmup_flags=[SamplerFlags.of([params])])
        chat = not args.raw and gen.tokenizer.chat_template is not None
        inputs = [[{"role": "user", "content": p}] if chat else p for p in prompts]
        outs = gen.generate(inputs, params, progress=len(inputs) > 1)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p, c in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": p, "text": c.text, "finish_reason": c.finish_reason,
                              "tokens": len(c.token_ids), "accept_length": c.mean_accept_length}))
        else:
            extra = f", accept length {c.mean_accept_length:.2f}" if c.mean_accept_length else ""
            print(f"{c.text}\n[{len(c.token_ids)} tokens, {c.finish_reason}, {c.latency_s:.2f} s{extra}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
