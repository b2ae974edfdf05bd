"""What keeping a device drafter in step costs a plain decode step. Under the auto policy a batch's plain
decoding (PLAIN_CHOICE) runs the drafter beside the target on every step (eagle_step.decode,
dflash_step.decode), so that a later call may verify again; the target alone leaves the drafter behind
for the rest of those requests (Dispatch._leave_heads_behind). A closed batch that plain decoding would
end first (closed_wave.py) might take the second, if the difference pays: spec-dflash-s86-new-'s DFLASH
engine decoded plainly on 73 of 111 bucket-64 HumanEval calls, 1.267 ms a step observed against the
table's 1.160 (in step), and ran 0.90x plain. The target-alone program is not in the start-up set at
buckets where plain decoding is a choice, and its cost there was never timed.

Here, for each drafter and batch bucket, both decode programs on the same inputs, timed as the warm-up
times its table (steady calls of MAX_DECODE_STEPS steps, TIMING_CONTEXT tokens of context a row): ms a
step each and their ratio. SmolLM2 with its shipped drafters, or with --smoke a two-layer SmolLM2 shape
and a random EAGLE-3 head (the script checked on the CPU).
    python bench/probes/in_step_cost.py [--drafters eagle3,dflash] [--batches 1,8,32,64] [--smoke]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import print_table, smollm2_and_head, write_results  # noqa: E402
from jaxspec import Generator, SpecConfig  # noqa: E402
from jaxspec.programs import MAX_DECODE_STEPS  # noqa: E402
from jaxspec.sampling import SamplerFlags  # noqa: E402
from jaxspec.scheduler.startup import TIMING_CONTEXT  # noqa: E402
from jaxspec.step_costs import time_call  # noqa: E402

COLS = ["drafter", "batch", "in_step_ms", "target_ms", "in_step_over_target"]


def drafters(names, smoke):
    """(name, target, drafter) for each drafter family asked for."""
    if smoke:
        from jaxspec.drafters.eagle import EagleDrafter
        from jaxspec.drafters.eagle_step import TreeShape
        _, model, head = smollm2_and_head(layers=2)
        return [("eagle3", model, EagleDrafter(head, TreeShape.parse("6:4:24")))]
    from jaxspec.models.loading import load
    from jaxspec.speculative import shipped_drafter
    model, _ = load("smollm2-135m", jnp.bfloat16)
    tree = dict(eagle3=dict(num_steps=6, eagle_topk=4, num_draft_tokens=24), dflash=dict(num_draft_tokens=16))
    return [(n, model, SpecConfig(n.upper(), draft_model_path=shipped_drafter("smollm2-135m", n.upper()), **tree[n])
             .build(model, "smollm2-135m")) for n in names]


def step_ms(sched, rows: int, plain: bool) -> float:
    """ms a step of the bucket's decode program: in step (plain False) or the target alone."""
    args = list(sched._dummy_decode(rows, MAX_DECODE_STEPS, alive=True))
    pages = -(-(TIMING_CONTEXT + MAX_DECODE_STEPS + 1) // sched.page_size)
    args[1] = args[1].copy()
    args[1][:, :pages] = 1 + np.arange(pages)  # every row reads the same context pages, as the warm-up's
    args[2] = np.full_like(args[2], TIMING_CONTEXT)
    flags = SamplerFlags()
    inputs = [jax.device_put(tuple(args)) for _ in range(3 * 4 + 1)]  # the programs donate: a copy a call
    return time_call(lambda: sched._call("decode", plain, inputs.pop(), flags), reps=3, calls=4) / MAX_DECODE_STEPS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters", default="eagle3,dflash")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name, model, drafter in drafters(args.drafters.split(","), args.smoke):
        gen = Generator(model, None, drafter=drafter, max_batch=max(batches), max_seq_len=1024, warmup=False,
                        spec_policy="auto", spec_max_verify_tokens=4096)
        sched = gen.scheduler
        for b in batches:
            if not sched._keeps_heads_at(b):
                print(f"{name} at batch {b}: plain decoding is not a choice there (no tree): skipped")
                continue
            in_step, alone = step_ms(sched, b, False), step_ms(sched, b, True)
            rows.append(dict(drafter=name, batch=b, in_step_ms=round(in_step, 4), target_ms=round(alone, 4),
                             in_step_over_target=round(in_step / alone, 3)))
            print_table(rows[-1:], COLS)
    print_table(rows, COLS)
    print(write_results("in_step_cost" + ("-smoke" if args.smoke else "") + args.tag, rows,
                        dict(timing_context=TIMING_CONTEXT, steps_a_call=MAX_DECODE_STEPS)))


if __name__ == "__main__":
    main()
