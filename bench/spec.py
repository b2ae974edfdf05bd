"""Speculative vs plain decoding through the real engine (Generator), side by side in one run.

    python bench/spec.py --model smollm2-135m [--datasets humaneval,mt-bench] [--batches 1,8,64]
        [--algos plain,ngram:8,naive_eagle,eagle3:3:1:4,eagle3:5:8:16,eagle:6:4:24/map4096,dflash:16,
                 eagle3:6:4:24=runs/new/head]
        (eagle3|eagle:steps:topk:tokens; dflash[:block] a chain, dflash:steps:topk:tokens a tree;
        /mapK restricts the head to the first K
        ids of --token-map (FR-Spec), /mapK/refreshN refreshes that map from the emitted tokens every
        N of them, from the start of each pass; a suffix @pallas / @mosaic / @ref picks the attention;
        a last /auto chooses the tree every call among the drafter's shapes by measured costs:
        spec_policy.py, rows' `policy`, `auto_choices`, `step_costs`; /auto-avg compares the shapes'
        plain averages, level_rate 0; /auto-level against the level alone, not by their cuts' counts on
        the same steps (shape_links.py; nor do its programs count them); /auto-open without the closed
        batch's rule, closed_wave.py); a last +join admits newcomers into the running chain (scheduler/joining.py))

Each (dataset, batch) runs its prompts twice per algorithm to compile (the engines side by side
in threads, `--warmup-threads`), then `--repeats` timed rounds with the algorithms interleaved, in
reverse order every other round (a pass is timed again, up to twice, if it compiled a new shape:
`compiles_in_timed_run`, `timed_passes`); tokens/s counts emitted tokens over wall time with
`batch` requests in flight (`--admission waves`: `batch` prompts at a time, the default;
`continuous`: all queued, `batch` at most running), the median over rounds, and speedup is the median of per-round ratios
(`--min-seconds` adds rounds where passes are short);
`speedup_pooled` divides all rounds' tokens by all their seconds. An algorithm named twice runs
twice (`plain,plain,...`: the second plain's speedup is the noise between two identical engines).
The heap is frozen for the garbage collector after the compile passes, as a server does after its
warm-up. Greedy (the engines build their greedy programs only); outputs of every algorithm are
compared with plain's (`identical_to_plain`: exact in float32; bf16 kernels differ by batch shape).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import humaneval_prompts, mt_bench_prompts, print_table, results_tag, run_torch_anchor, write_results
from jaxspec import SamplingParams, SpecConfig, spec_policy
from jaxspec.speculative import shipped_drafter
from jaxspec.generator import Generator
from jaxspec.models.loading import load
from jaxspec.sampling import SamplerFlags


def greedy(max_tokens) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def run(gen, prompts, batch, max_tokens, admission="waves"):
    """All prompts, at most `batch` in flight; returns (completions, seconds). `waves`: `batch`
    prompts at a time, the next wave when the last one's slowest request ends (static batching);
    `continuous`: all queued at once, a waiting one admitted as soon as a request ends (a server's
    continuous batching, SGLang's offline-throughput bench). A drafter that learns from what it saw
    (NGRAM's trie) starts every pass empty: the passes repeat the same prompts, and drafting a pass's
    answers from an earlier pass's would measure recall."""
    reset = getattr(gen.scheduler.drafter, "reset", None)
    if reset is not None:
        reset()
    params = greedy(max_tokens)
    t0 = time.perf_counter()
    if admission == "continuous":
        built, gen.scheduler.max_batch = gen.scheduler.max_batch, batch  # admission's cap; programs unchanged
        try:
            return gen.generate(prompts, params), time.perf_counter() - t0
        finally:
            gen.scheduler.max_batch = built
    outs = []
    for i in range(0, len(prompts), batch):
        outs += gen.generate(prompts[i:i + batch], params)
    return outs, time.perf_counter() - t0


def pooled_rate(runs) -> float:
    """All timed passes' tokens over all their seconds."""
    return sum(r["tokens"] for r in runs) / sum(r["secs"] for r in runs)


def compiled_programs(gen) -> int:
    """Shapes compiled so far by the generator's jitted programs (a compile inside the timed run
    is a stall the timing includes)."""
    cuts = gen.scheduler.cuts  # a chained change of shape's cut (scheduler/trees.py)
    return sum(len(p.table) for p in gen.scheduler.program_groups) + (len(cuts.table) if cuts else 0)


# the scheduler's host seconds per kind of call (launch and read-back, the wait included), and prompt tokens
PHASES = ("prefill_time", "decode_time", "verify_time", "wait_time", "prefill_tokens")


def timed_run(gen, prompts, batch, max_tokens, admission):
    """One timed pass. A compile inside it (drafts, hence shapes, can differ between passes) is a
    stall of seconds: the pass is repeated, at most twice, and the count reported."""
    drafter, policy = gen.scheduler.drafter, gen.scheduler.spec_policy
    for timed_pass in range(3):
        s0 = dict(gen.scheduler.stats)
        chosen0 = dict(policy.chosen) if policy is not None else {}
        h0, o0 = getattr(drafter, "host_time", 0.0), getattr(drafter, "overlapped_time", 0.0)
        c0 = compiled_programs(gen)
        outs, secs = run(gen, prompts, batch, max_tokens, admission)
        compiles = compiled_programs(gen) - c0
        if compiles == 0:
            break
    st = gen.scheduler.stats
    chosen = collections.Counter()  # the auto policy's calls a shape in this pass, over every bucket
    for (rows, label), n in (policy.chosen.items() if policy is not None else ()):
        chosen[label] += n - chosen0.get((rows, label), 0)
    acc = [a for o in outs for a in (o.accept_lengths or [])]
    return dict(outs=outs, secs=secs, chosen={k: n for k, n in sorted(chosen.items()) if n},
                accept=sum(acc) / len(acc) if acc else None, tokens=sum(len(o.token_ids) for o in outs), compiles=compiles,
                preemptions=st["preemptions"] - s0["preemptions"],
                passes=timed_pass + 1, verify_steps=st["verify_steps"] - s0["verify_steps"],
                emitted=st["emitted"] - s0["emitted"], steps=st["steps"] - s0["steps"],
                chained=st["chained_steps"] - s0["chained_steps"], switches=st["chained_switches"] - s0["chained_switches"],
                closed_plain=st["closed_plain_calls"] - s0["closed_plain_calls"],
                prefill_chains=st["prefill_chains"] - s0["prefill_chains"],
                host=getattr(drafter, "host_time", 0.0) - h0, overlapped=getattr(drafter, "overlapped_time", 0.0) - o0,
                phases={k: st[k] - s0[k] for k in PHASES})


def map_prefix(path, size: int) -> str:
    """The first `size` ids of the ranked map at `path`, as a temporary .npy."""
    import tempfile

    from jaxspec.drafters.token_map import load_token_map
    if not path:
        raise SystemExit("an algorithm with /mapK needs --token-map")
    ids = load_token_map(path, 1 << 31)
    if len(ids) < size:
        raise SystemExit(f"--token-map {path} lists {len(ids)} ids, fewer than {size}")
    out = os.path.join(tempfile.mkdtemp(), f"map{size}.npy")
    np.save(out, ids[:size])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts-per-batch", type=int, default=2, help="prompts = batch * this (batch 1: --b1-prompts)")
    ap.add_argument("--b1-prompts", type=int, default=8,
                    help="prompts at batch 1 (a dataset's 80 MT-bench or 164 HumanEval prompts in all: 999)")
    ap.add_argument("--algos", default="plain,ngram:8",
                    help="plain, ngram:<tokens>, naive_eagle[:steps], eagle3:<steps>:<topk>:<tokens>; a '+v8' suffix "
                    "runs 8 verify steps a call")
    ap.add_argument("--draft-model", default=None, help="EAGLE-3 head directory (default: the shipped one)")
    ap.add_argument("--eagle-model", default=None, help="EAGLE head directory (default: the shipped one)")
    ap.add_argument("--dflash-model", default=None, help="DFLASH drafter directory (default: the shipped one)")
    ap.add_argument("--token-map", help="token ids by frequency (.npy/.json/.pt), cut to K by an algorithm's /mapK")
    ap.add_argument("--max-batch", type=int, default=64, help="the engines' largest batch (fewer programs below 64)")
    ap.add_argument("--lazy", action="store_true",
                    help="no start-up build of the engines' program sets: the warm-up passes compile what they meet")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bf16 on GPU")
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds (median reported)")
    ap.add_argument("--min-seconds", type=float, default=0.0,
                    help="more rounds (up to 4x --repeats) until each algorithm has this much timed")
    ap.add_argument("--warmup-threads", type=int, default=0,
                    help="engines compiling at once in the warm-up passes (0: all; 1: one after another)")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="each engine's KV pages of 16 tokens (default: a whole 1024-token sequence and a tree's slack "
                    "per request of --max-batch, so that no pass preempts: the engine's own default, 256 tokens a "
                    "request, is short of HumanEval's second 64 prompts with their 128 new tokens; rows' `preemptions`)")
    ap.add_argument("--admission", default="waves",
                    help="waves, continuous or both (comma-separated; rows' `admission`): see run()")
    ap.add_argument("--tag", type=results_tag, default="", help="suffix of the results file name")
    ap.add_argument("--torch-anchor", action="store_true",
                    help="also run bench/torch_anchor.py's plain step (context 256) and give vs_torch")
    ap.add_argument("--spec-max-verify-tokens", type=int, default=None,
                    help="scheduler's tree budget per step over the batch (default: the scheduler's)")
    args = ap.parse_args()
    import jax.numpy as jnp
    if "smol" in args.model.lower():  # a SmolLM2 GGUF path: the shipped drafters
        args.draft_model = args.draft_model or shipped_drafter("smollm2-135m", "EAGLE3")
        args.eagle_model = args.eagle_model or shipped_drafter("smollm2-135m", "EAGLE")
        args.dflash_model = args.dflash_model or shipped_drafter("smollm2-135m", "DFLASH")
    model, tok = load(args.model, getattr(jnp, args.dtype) if args.dtype else None)
    gens = {}
    for a in args.algos.split(","):
        label = a
        while any(lab == label for _, lab in gens):
            label += "#2"  # the same algorithm again: a control for the noise between rounds
        a, _, head_dir = a.partition("=")  # "eagle3:6:4:24=runs/x/head": that head, not --draft-model
        a, join = (a[:-len("+join")], True) if a.endswith("+join") else (a, False)  # Scheduler join_newcomers
        a, _, vsteps = a.partition("+v")  # "eagle3:6:4:24+v8": 8 verify steps a call (Scheduler verify_steps)
        a, _, probe = a.partition("/probe")  # "ngram:8/probe32": a host drafter's spec_probe_every
        a, plain_avg = (a[:-len("-avg")], True) if a.endswith("/auto-avg") else (a, False)  # level_rate 0
        a, links = (a[:-len("-level")], False) if a.endswith("/auto-level") else (a, None)  # shape_links.py
        a, per_step = (a[:-len("-open")], True) if a.endswith("/auto-open") else (a, False)  # closed_wave.py off
        a, auto = (a[:-len("/auto")], True) if a.endswith("/auto") else (a, False)  # spec_policy.py
        a, _, attn_impl = a.partition("@")  # "eagle3:5:8:16@pallas": that attention (default auto)
        a, _, map_size = a.partition("/map")  # "eagle:6:4:24/map4096": the first 4096 ids of --token-map
        map_size, _, refresh = map_size.partition("/refresh")  # ".../map4096/refresh256": adaptive, every 256 tokens
        name, *nums = a.split(":")
        nums = [int(x) for x in nums]
        if name == "plain":
            spec = None
        elif name == "ngram":
            spec = SpecConfig("NGRAM", num_draft_tokens=nums[0] if nums else 8)
        elif name == "naive_eagle":
            spec = SpecConfig("NAIVE_EAGLE", draft_model_path=args.draft_model, num_steps=nums[0] if nums else 1)
        elif name == "dflash":  # "dflash:16=runs/df/drafter": that drafter, not --dflash-model
            path = head_dir or args.dflash_model
            spec = (SpecConfig("DFLASH", draft_model_path=path, num_draft_tokens=nums[0] if nums else None)
                    if len(nums) < 3 else SpecConfig("DFLASH", draft_model_path=path, num_steps=nums[0],
                                                     eagle_topk=nums[1], num_draft_tokens=nums[2]))
        else:
            spec = SpecConfig(name.upper(), draft_model_path=head_dir or (args.eagle_model if name == "eagle"
                                                                          else args.draft_model),
                              num_steps=nums[0], eagle_topk=nums[1], num_draft_tokens=nums[2],
                              token_map=map_prefix(args.token_map, int(map_size)) if map_size else None,
                              token_map_refresh=int(refresh or 0))
        drafter = spec.build(model, args.model) if spec else None
        kw = {} if args.spec_max_verify_tokens is None else dict(spec_max_verify_tokens=args.spec_max_verify_tokens)
        kw["attn_impl"] = attn_impl or "auto"
        if auto:
            kw["spec_policy"] = "auto"
        if vsteps:
            kw["verify_steps"] = int(vsteps)
        if join:
            kw["join_newcomers"] = True
        if probe:
            kw["spec_probe_every"] = int(probe)
        links_before = spec_policy.USE_LINKS
        if links is not None:  # the level alone: nor do its programs count their trees' cuts
            spec_policy.USE_LINKS = links
        gens[(name, label)] = Generator(model, tok, drafter=drafter, max_batch=args.max_batch, max_seq_len=1024,
                                        page_size=16, num_pages=args.num_pages or 1 + args.max_batch * (1024 + 128) // 16,
                                        warmup=not args.lazy, warmup_flags=[SamplerFlags.of([greedy(1)])], **kw)
        spec_policy.USE_LINKS = links_before
        if plain_avg:  # the policy comparing shapes by plain averages, not against the requests' level
            gens[(name, label)].scheduler.spec_policy.level_rate = 0.0
        if per_step:  # a closed batch ranked by tokens a ms of a step like any other (closed_wave.py)
            gens[(name, label)].scheduler.closed_batch_rule = False
    rows = []
    for ds in args.datasets.split(","):
        if ds == "humaneval":
            prompts = humaneval_prompts()
        else:
            prompts = [[{"role": "user", "content": q}] for q in mt_bench_prompts()]
        for b in map(int, args.batches.split(",")):
            n = args.b1_prompts if b == 1 else b * args.prompts_per_batch
            ps = prompts[:n]
            # compile every shape this workload meets; twice, so the prefix cache is in the state the
            # timed runs will find it (its hits change prefill shapes). The engines warm up side by
            # side, a thread each: XLA compiles without the GIL (one engine after another, the
            # EAGLE batch-64 compiles left no time for HumanEval in spec-v19-eagle-b64's call)
            def warm(gen):
                for mode in args.admission.split(","):
                    run(gen, ps, b, args.max_tokens, mode)
                    run(gen, ps, b, args.max_tokens, mode)
            threads = args.warmup_threads or len(gens)
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(warm, gens.values()))
            if threads > 1:  # step costs seen beside other engines are not this engine's (a server runs one)
                for gen in gens.values():
                    if gen.scheduler.spec_policy is not None:
                        gen.scheduler.spec_policy.forget_costs()
            # what exists now lives to the end (models, compiled programs): the collector's full
            # passes need not walk it (a pause of its own inside a timed pass is noise)
            gc.collect()
            gc.freeze()
            for mode in args.admission.split(","):
                for gen in gens.values():  # the auto policy's choices in the timed rounds alone
                    if gen.scheduler.spec_policy is not None:
                        gen.scheduler.spec_policy.chosen.clear()
                # timed rounds, the algorithms interleaved within each round so that drift (clocks, host
                # noise) hits all of them alike; speedups are per round, then the median
                timed = {k: [] for k in gens}
                rounds = 0
                # at least --repeats rounds, more (up to 4x) until every algorithm has --min-seconds of
                # timed passes: a large batch's pass is short, and host noise then swamps one round
                while rounds < args.repeats or (rounds < 4 * args.repeats and
                                                min(sum(r["secs"] for r in v) for v in timed.values()) < args.min_seconds):
                    order = list(gens.items())
                    for key, gen in (order if rounds % 2 == 0 else order[::-1]):
                        timed[key].append(timed_run(gen, ps, b, args.max_tokens, mode))
                    rounds += 1
                base = None
                for (name, label), gen in gens.items():
                    runs = timed[(name, label)]
                    tps = [r["tokens"] / r["secs"] for r in runs]
                    outs = runs[0]["outs"]
                    row = dict(model="smollm2-135m" if "smol" in args.model.lower() else os.path.basename(args.model),
                               algorithm=name, config=label.split("=")[0], dataset=ds, batch=b, admission=mode,
                               draft_model=os.path.relpath(label.split("=")[1]) if "=" in label else None,
                               policy="auto" if "/auto" in label else "fixed",
                               tree=getattr(getattr(gen.scheduler.drafter, "tree", None), "label", None),
                               token_map=(label.split("/map")[1].split("@")[0].split("/")[0] if "/map" in label
                                          else ("none" if name in ("eagle", "eagle3", "naive_eagle") else None)),
                               token_map_refresh=int(label.split("/refresh")[1].split("@")[0]) if "/refresh" in label else None,
                               draft_tokens=getattr(gen.scheduler.drafter, "num_nodes", None),
                               tokens_per_s=float(np.median(tps)), tokens_per_s_runs=tps, requests=len(ps),
                               tokens=runs[0]["tokens"], compiles_in_timed_run=sum(r["compiles"] for r in runs),
                               timed_passes=sum(r["passes"] for r in runs),
                               preemptions=sum(r["preemptions"] for r in runs),
                               phases={k: round(sum(r["phases"][k] for r in runs), 4) for k in PHASES},
                               calls=sum(r["steps"] for r in runs), chained_calls=sum(r["chained"] for r in runs),
                               calls_runs=[r["steps"] for r in runs], chained_calls_runs=[r["chained"] for r in runs],
                               closed_plain_calls_runs=[r["closed_plain"] for r in runs],  # (a round's calls: its speed)
                               prefill_chains=sum(r["prefill_chains"] for r in runs))  # first calls chained on a prefill
                    if base is None:
                        base = (tps, [o.token_ids for o in outs], runs)
                    else:
                        ratios = [t / p for t, p in zip(tps, base[0])]
                        vs = sum(r["verify_steps"] for r in runs)
                        acc = [a for o in outs for a in (o.accept_lengths or [])]
                        row.update(speedup=float(np.median(ratios)), speedup_runs=ratios,
                                   speedup_pooled=pooled_rate(runs) / pooled_rate(base[2]),
                                   accept_length=sum(acc) / max(len(acc), 1),
                                   identical_to_plain=[o.token_ids for o in outs] == base[1],
                                   verify_steps=vs, emitted=sum(r["emitted"] for r in runs),
                                   chained_switches=sum(r["switches"] for r in runs),
                                   closed_plain_calls=sum(r["closed_plain"] for r in runs))  # closed_wave.py's
                    policy = gen.scheduler.spec_policy
                    if policy is not None:  # what the auto policy learned, and chose at this batch (first or not)
                        summary = policy.summary()
                        row.update(auto_choices_runs=[r["chosen"] for r in runs],  # a timed pass each
                                   accept_length_runs=[r["accept"] for r in runs],
                                   auto_accept_length=summary["accept_length"],
                                   auto_expected=summary["expected"],  # against the requests' level
                                   auto_linked_expected=summary["linked_expected"],  # by the same-step links
                                   auto_use_links=policy.use_links,
                                   auto_level_rate=policy.level_rate,
                                   auto_choices=summary["chosen"],  # bucket -> tree -> calls, in the timed rounds
                                   auto_why=summary["why"],  # bucket -> "tree: reason" -> calls (spec_policy.py)
                                   auto_observed_ms=summary["observed_ms"],
                                   auto_recent_ms=summary["recent_ms"],  # median, p90, max of the last calls
                                   auto_launch=summary["launch"],  # calls not chained: their cost, their fraction
                                   step_costs=[[k, r, t, ms] for (k, r, t), ms in sorted(gen.scheduler.spec_costs.ms.items(),
                                                                                          key=str)])
                    if hasattr(gen.scheduler.drafter, "host_time"):  # NGRAM drafts on the host
                        vs = sum(r["verify_steps"] for r in runs)
                        row["draft_host_ms_per_step"] = 1e3 * sum(r["host"] for r in runs) / max(vs, 1)
                        # trie insertion, done while the device runs a step (not on the critical path)
                        row["overlapped_host_ms_per_step"] = (
                            1e3 * sum(r["overlapped"] for r in runs) / max(sum(r["steps"] for r in runs), 1))
                    rows.append(row)
                    print_table(rows[-1:], ["config", "dataset", "batch", "admission", "tokens_per_s", "speedup", "accept_length",
                                            "compiles_in_timed_run",
                                            "identical_to_plain", "draft_host_ms_per_step", "overlapped_host_ms_per_step"])
                    write_results("spec" + args.tag, rows, {"dtype": str(model.embed[...].dtype)})  # partial results survive
    if args.torch_anchor:
        anchor = {r["batch"]: r for r in run_torch_anchor("smollm2-135m", args.batches, 256)}
        for r in rows:
            r["vs_torch"] = r["tokens_per_s"] / anchor[r["batch"]]["tokens_per_s"]
        rows += [dict(r, dataset="random", config="torch-compile") for r in anchor.values()]
    print()
    print_table(rows, ["config", "dataset", "batch", "admission", "draft_tokens", "tokens_per_s", "speedup", "speedup_pooled",
                       "vs_torch", "accept_length",
                       "identical_to_plain", "draft_host_ms_per_step", "overlapped_host_ms_per_step"])
    print(write_results("spec" + args.tag, rows, {"dtype": str(model.embed[...].dtype)}))


if __name__ == "__main__":
    main()
