"""Command line: `python -m jaxspec generate --model smollm2-135m --prompt "..."`, and
`python -m jaxspec programs` (the engine's program set, built and timed with --build)."""
from __future__ import annotations

import argparse
import json
import sys


def _engine_flags(p):
    from jaxspec.speculative import add_flags
    p.add_argument("--model", default="smollm2-135m", help="short name, .gguf file or HF directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    add_flags(p)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--tp-size", type=int, default=1, help="devices to split the model over (tensor parallel)")
    p.add_argument("--max-seq-len", type=int, default=2048)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jaxspec")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text")
    _engine_flags(g)
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompts-file", help="a file with one prompt per line (or JSONL with a 'prompt' field)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per completion")
    g.add_argument("--no-warmup", action="store_true", help="compile programs as they are first needed")
    p = sub.add_parser("programs", help="list the program set an engine builds at start-up (AUTO: the server's)")
    _engine_flags(p)
    p.add_argument("--build", action="store_true",
                   help="compile it (JAX's cache and the program store are used) and, with --speculative-policy "
                        "auto, print the step costs timed at warm-up")
    args = ap.parse_args(argv)
    from jaxspec.models.loading import CheckpointError
    try:
        return (generate if args.cmd == "generate" else programs)(args)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _generator(args, max_batch, auto_policy="auto", **kw):
    import jax.numpy as jnp
    from jaxspec import Generator
    from jaxspec.speculative import config_from_flags, verify_budget
    return Generator.from_pretrained(args.model, dtype=getattr(jnp, args.dtype) if args.dtype else None,
                                     speculative=config_from_flags(args, auto_policy), max_batch=max_batch,
                                     page_size=args.page_size, max_seq_len=args.max_seq_len, tp_size=args.tp_size,
                                     spec_policy=args.speculative_policy, **verify_budget(args), **kw)


def programs(args) -> int:
    from jaxspec.sampling import SamplerFlags
    gen = _generator(args, args.max_batch, warmup=args.build)
    sched = gen.scheduler
    specs = sched.program_specs()
    entries = {progs.entry(*spec): (spec[0], getattr(progs.tree, "label", ""), spec[1], spec[3], progs)
               for progs, *spec in specs}
    print(f"{len(entries)} programs (max batch {args.max_batch}):")
    for name, tree, flags, call_args, progs in sorted(entries.values(),
                                                      key=lambda e: (e[0], e[3][0].shape, e[1], e[2].sample)):
        shared = progs.flags_for(name, SamplerFlags()).sample  # a greedy batch's program samples too
        sampled = "greedy and sampled" if shared else "sampled" if flags.sample else "greedy"
        tree = f"  tree {tree}" if name == "verify_steps" else ""
        print(f"  {name:12s} rows {call_args[0].shape[0]:4d}  tokens {call_args[0].shape[1]:4d}  {sampled}{tree}")
    if args.build and sched.spec_costs.ms:
        print(sched.spec_costs.table())
    return 0


def generate(args) -> int:
    from jaxspec import SamplingParams
    from jaxspec.sampling import SamplerFlags

    prompts = list(args.prompt or [])
    if args.prompts_file:
        for line in open(args.prompts_file):
            line = line.rstrip("\n")
            if line.strip():
                prompts.append(json.loads(line)["prompt"] if line.lstrip().startswith("{") else line)
    if not prompts:
        prompts = ["What is the capital of France?"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    # the program set these prompts can meet (their batch, their sampler) is built before the
    # first token, so no step waits for a compile mid-run
    gen = _generator(args, min(args.max_batch, len(prompts)), "fixed", warmup=not args.no_warmup,
                     warmup_flags=[SamplerFlags.of([params])])
    chat = not args.raw and gen.tokenizer.chat_template is not None
    inputs = [[{"role": "user", "content": p}] if chat else p for p in prompts]
    outs = gen.generate(inputs, params, progress=len(inputs) > 1)
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
