"""Why a tree that emits more tokens per ms of a step than plain decoding can still lose to it at
batch 64: in a closed wave (bench/spec.py's `waves`, a Generator.generate call, a rollout) the wave
ends when its slowest request does, and the rows that accept least set that time.

`collect` decodes the benchmark prompts greedily through the engine on this machine with a fixed
tree, in waves of `--batch`, and keeps each request's accept lengths step by step (greedy outputs
are plain decoding's, so a request's plain steps are its token count). `simulate` replays those
traces against a step-cost table (bench/spec.py rows' `step_costs`, taken on a GPU): a wave's steps
run at the bucket of the rows still decoding, and a row finishes after its own steps. It prints,
per (dataset, tree), the per-step estimate the policy uses (mean tokens a row-step over the step's
cost, against plain's) beside the simulated wave time's ratio, and the bench's measured speedup.
`policies` replays the waves under four rules, each call choosing the traced tree or plain decoding:
plain, the tree always (fixed), the per-step estimate (per_step), and closed_wave.py's (closed:
the batch's remaining time, each row at its own rate so far).

    python bench/probes/wave_tail.py collect --trees eagle3:3:1:4,eagle3:6:4:24,dflash:16 --datasets humaneval,mt-bench
    python bench/probes/wave_tail.py simulate|policies \
        --costs bench/results/spec-policy-spells-NVIDIA-H200.json,bench/results/spec-dflash-spells-NVIDIA-H200.json
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from common import humaneval_prompts, mt_bench_prompts, print_table, results_tag, write_results  # noqa: E402
from jaxspec.closed_wave import ROW_PRIOR_DRAFTS, plain_ends_first, wave_ms  # noqa: E402
from jaxspec.programs import BATCH_BUCKETS, bucket as bucket_of  # noqa: E402

def spec_of(label: str, dflash_model: str | None):
    """"eagle3:3:1:4" (steps:topk:tokens), "dflash:16" (a chain of the block) or "dflash:15:1:8"."""
    from jaxspec import SpecConfig
    name, *nums = label.split(":")
    nums = [int(x) for x in nums]
    if name == "dflash":
        return (SpecConfig("DFLASH", draft_model_path=dflash_model, num_draft_tokens=nums[0]) if len(nums) == 1 else
                SpecConfig("DFLASH", draft_model_path=dflash_model, num_steps=nums[0], eagle_topk=nums[1],
                           num_draft_tokens=nums[2]))
    return SpecConfig(name.upper(), num_steps=nums[0], eagle_topk=nums[1], num_draft_tokens=nums[2])


def collect(args):
    from jaxspec import Generator, SamplingParams
    from jaxspec.models.loading import load
    model, tok = load("smollm2-135m")
    rows = []
    for label in args.trees.split(","):
        gen = Generator(model, tok, drafter=spec_of(label, args.dflash_model).build(model, "smollm2-135m"),
                        max_batch=args.batch, max_seq_len=1024, page_size=16, spec_max_verify_tokens=4096, warmup=False)
        for ds in args.datasets.split(","):
            prompts = (humaneval_prompts() if ds == "humaneval"
                       else [[{"role": "user", "content": q}] for q in mt_bench_prompts()])[:args.batch * args.waves]
            for w in range(0, len(prompts), args.batch):
                outs = gen.generate(prompts[w:w + args.batch], SamplingParams(max_tokens=args.max_tokens))
                for i, o in enumerate(outs):
                    rows.append(dict(tree=label, dataset=ds, wave=w // args.batch, prompt=w + i, tokens=len(o.token_ids),
                                     accept_lengths=list(o.accept_lengths)))
                print(label, ds, w, np.mean([len(o.token_ids) for o in outs]),
                      np.mean([a for o in outs for a in o.accept_lengths]), flush=True)
        write_results("wave_tail-traces", rows, dict(batch=args.batch, max_tokens=args.max_tokens))  # after each tree
    print(write_results("wave_tail-traces", rows, dict(batch=args.batch, max_tokens=args.max_tokens)))


def cost_label(label: str) -> str:
    """The step-cost table's name for a trace's tree: eagle3:3:1:4 -> 3:1:4, dflash:16 -> 15:1:16."""
    name, *nums = label.split(":")
    return f"{int(nums[0]) - 1}:1:{nums[0]}" if name == "dflash" and len(nums) == 1 else ":".join(nums)


def cost_tables(paths: str) -> dict:
    """family (eagle3, dflash) -> (ms by (kind, bucket, tree), {(dataset, config): measured speedup at each batch})."""
    out = {}
    for path in paths.split(","):
        d = json.load(open(path))
        spec = [r for r in d["rows"] if r.get("step_costs")]
        ms = {(kind, rows, tree): c for kind, rows, tree, c in spec[0]["step_costs"]}
        measured = {(r["dataset"], r["config"], r["batch"]): r.get("speedup") for r in d["rows"] if r["config"] != "plain"}
        out[spec[0]["algorithm"]] = (ms, measured)
    return out


def traced(args):
    """Per (dataset, traced tree): the tree's name in the cost table, its family's step costs and
    measured speedups, and the traces."""
    tables = cost_tables(args.costs)
    traces = json.load(open(args.traces))["rows"]
    for ds, tree in sorted({(t["dataset"], t["tree"]) for t in traces}):
        ms, measured = tables[tree.split(":")[0]]
        yield ds, tree, cost_label(tree), ms, measured, [t for t in traces if t["dataset"] == ds and t["tree"] == tree]


def simulate(args):
    out = []
    for ds, tree, label, ms, measured, ts in traced(args):
        plain_ms = spec_ms = 0.0
        for w in sorted({t["wave"] for t in ts}):
            wave = [t for t in ts if t["wave"] == w]
            plain_ms += wave_ms([t["tokens"] for t in wave], lambda b: ms[("decode", b, None)])
            spec_ms += wave_ms([len(t["accept_lengths"]) for t in wave], lambda b: ms[("verify", b, label)])
        acc = [a for t in ts for a in t["accept_lengths"]]
        row_acc = [np.mean(t["accept_lengths"]) for t in ts if t["accept_lengths"]]
        per_step = np.mean(acc) / ms[("verify", args.batch, label)] * ms[("decode", args.batch, None)]
        m = measured.get((ds, tree, args.batch))
        out.append(dict(dataset=ds, tree=tree, accept_length=round(float(np.mean(acc)), 3),
                        row_accept_min=round(float(np.min(row_acc)), 3),
                        row_accept_p10=round(float(np.percentile(row_acc, 10)), 3),
                        per_step_estimate=round(float(per_step), 3), simulated_wave=round(plain_ms / spec_ms, 3),
                        measured=None if m is None else round(m, 3)))
    print_table(out, list(out[0]))
    print(write_results("wave_tail" + args.tag, out, dict(costs=args.costs, traces=os.path.relpath(args.traces))))


def accept_at(trace: list[int]):
    """A function of a row's position (tokens emitted) -> what the traced step starting nearest it accepted."""
    starts = np.cumsum([0] + trace[:-1])
    return lambda p: trace[min(int(np.searchsorted(starts, p, side="right")) - 1, len(trace) - 1)]


def run_wave(rows, shape_ms, plain_ms, mean_accept, rule, max_tokens, call_steps=4, prior=ROW_PRIOR_DRAFTS,
             oracle=None, switch_ms=None):
    """A closed wave under `rule` (plain, fixed, per_step, closed, closed_switch): ms until its last
    row ends, and the calls of each kind. rows: [(tokens, accept_at)]; shape_ms / plain_ms /
    switch_ms: bucket -> ms a step, or a change between plain and the tree (an unchained call's
    launch; a move to the tree also verifies the roots alone first: a tree step that emits one
    token a row). closed_switch: the closed rule with a change's cost added to the side it moves to."""
    n = len(rows)
    pos, drafts, expect = np.zeros(n), np.zeros(n), np.zeros(n)
    total, choices, last = 0.0, collections.Counter(), None
    switch_ms = switch_ms or (lambda b: 0.0)
    while True:
        alive = [i for i in range(n) if pos[i] < rows[i][0]]
        if not alive:
            return total, choices
        b = bucket_of(len(alive), BATCH_BUCKETS)
        if rule in ("plain", "fixed"):
            spec = rule == "fixed"
        elif rule == "per_step":
            spec = bool(mean_accept / shape_ms(b) > 1 / plain_ms(b))
        else:  # closed: the wave's remaining time, each row at its own rate (closed_wave.py's rule)
            f = (drafts[alive] + prior) / (expect[alive] + prior) if oracle is None else oracle[alive]
            was = None if rule != "closed_switch" or last is None else "tree" if last else "plain"
            spec = not plain_ends_first(max_tokens - pos[alive], f, mean_accept, shape_ms, plain_ms, was, switch_ms(b))
        choices["spec" if spec else "plain"] += 1
        roots_alone = last is False and spec
        if last is not None and spec != last:
            total += switch_ms(b)
        last = spec
        for step in range(call_steps if spec else 2 * call_steps):
            alive = [i for i in range(n) if pos[i] < rows[i][0]]
            if not alive:
                break
            total += (shape_ms if spec else plain_ms)(bucket_of(len(alive), BATCH_BUCKETS))
            verified = spec and not (roots_alone and step == 0)  # (a roots-alone step emits one token a row)
            for i in alive:
                c = rows[i][1](pos[i]) if verified else 1
                if verified:
                    drafts[i] += c - 1
                    expect[i] += mean_accept - 1
                pos[i] = min(pos[i] + c, rows[i][0])


def policies(args):
    tables_launch = {}  # family -> bucket -> the auto policy's launch cost seen (ms, median over its rows)
    for path in args.costs.split(","):
        auto = [r for r in json.load(open(path))["rows"] if r.get("auto_launch")]
        tables_launch[auto[0]["algorithm"]] = {int(b): float(np.median([r["auto_launch"][b]["ms"] for r in auto
                                                                         if b in r["auto_launch"]]))
                                               for b in auto[0]["auto_launch"]}
    out = []
    for ds, tree, label, ms, _, ts in traced(args):
        mean_accept = float(np.mean([a for t in ts for a in t["accept_lengths"]]))
        launch = tables_launch[tree.split(":")[0]]
        rules = [("plain", None), ("fixed", None), ("per_step", None)] + [("closed", p) for p in args.priors]
        for switch_cost in (False, True):
            times = {}
            for rule, prior in rules + [("closed_switch", ROW_PRIOR_DRAFTS)] * switch_cost:
                total, chosen = 0.0, collections.Counter()
                for w in sorted({t["wave"] for t in ts}):
                    wave = [(t["tokens"], accept_at(t["accept_lengths"])) for t in ts if t["wave"] == w]
                    ms_w, c = run_wave(wave, lambda b: ms[("verify", b, label)], lambda b: ms[("decode", b, None)],
                                       mean_accept, rule, args.max_tokens, prior=prior,
                                       switch_ms=lambda b: launch.get(b, 5.0) if switch_cost else 0.0)
                    total, chosen = total + ms_w, chosen + c
                times[rule] = total
                out.append(dict(dataset=ds, tree=tree, rule=rule, prior=prior, switch_cost=switch_cost,
                                wave_ms=round(total, 1), vs_plain=round(times["plain"] / total, 3),
                                spec_calls=chosen["spec"], plain_calls=chosen["plain"]))
    print_table(out, list(out[0]))
    print(write_results("wave_tail-policies" + args.tag, out, dict(costs=args.costs, traces=os.path.relpath(args.traces))))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--trees", default="3:1:4")
    c.add_argument("--datasets", default="humaneval,mt-bench")
    c.add_argument("--batch", type=int, default=64)
    c.add_argument("--waves", type=int, default=2)
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--dflash-model", default=None, help="DFLASH drafter directory (default: the shipped one)")
    s = sub.add_parser("simulate")
    s.add_argument("--costs", required=True, help="bench/spec.py results, comma-separated: one per drafter family")
    s.add_argument("--traces", default=(glob.glob("bench/results/wave_tail-traces-*.json") or [None])[0])
    s.add_argument("--batch", type=int, default=64)
    s.add_argument("--tag", type=results_tag, default="", help="suffix of the results file name")
    p = sub.add_parser("policies")
    p.add_argument("--costs", required=True)
    p.add_argument("--traces", default=(glob.glob("bench/results/wave_tail-traces-*.json") or [None])[0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--priors", type=lambda x: [float(v) for v in x.split(",")], default=[ROW_PRIOR_DRAFTS],
                   help="closed rule's expected drafts at factor 1 added to each row's (closed_wave.ROW_PRIOR_DRAFTS)")
    p.add_argument("--tag", type=results_tag, default="", help="suffix of the results file name")
    args = ap.parse_args()
    dict(collect=collect, simulate=simulate, policies=policies)[args.cmd](args)


if __name__ == "__main__":
    main()
