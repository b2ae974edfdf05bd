"""The program store on the GPU: an EAGLE-3 engine whose programs are read back from the store
(exported StableHLO with the Triton and Mosaic GPU kernels inside) emits the same greedy tokens
as one whose programs are traced anew. SmolLM2's shapes, random bf16 weights, batch 1 and 4.

    python bench/probes/store_check.py
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import SMOLLM2, random_model, write_results  # noqa: E402
from jaxspec import Generator, SamplingParams, SpecConfig  # noqa: E402
from jaxspec.models import ModelConfig  # noqa: E402


def main():
    model = random_model(ModelConfig(**SMOLLM2, max_position=4096), jnp.bfloat16)
    spec = SpecConfig("EAGLE3", num_steps=6, eagle_topk=4, num_draft_tokens=24)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 40000, n))) for n in (7, 100, 300, 33)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    store = tempfile.mkdtemp()
    outs, reads = {}, {}
    for run in ("traced", "exported", "read"):
        gen = Generator(model, None, drafter=spec.build(model, "smollm2-135m"), max_batch=4, max_seq_len=1024)
        for progs in (gen.scheduler.programs, gen.scheduler.plain_programs):
            progs.store = None if run == "traced" else store
        outs[run] = [o.token_ids for o in gen.generate(prompts[:1], params) + gen.generate(prompts, params)]
        reads[run] = gen.scheduler.programs.store_reads + gen.scheduler.plain_programs.store_reads
    rows = [dict(run=run, store_reads=reads[run], equal_to_traced=outs[run] == outs["traced"])
            for run in outs]
    for r in rows:
        print(r)
    print(write_results("store_check", rows))


if __name__ == "__main__":
    main()
