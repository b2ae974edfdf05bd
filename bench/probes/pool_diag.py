"""A batch-1 EAGLE-3 Generator with server.py's settings (measured policy, KV pool by
--mem-fraction-static 0.8), max batch 128 and then 64 in the same process: does it verify, and
at what pace? Eight MT-bench first turns one at a time, 128 new tokens. It prints and writes
no results file; bench/probes/pool_size.py separates the pool's size from the order of the
engines and writes pool_size-<device>.json.

    python bench/probes/pool_diag.py
"""
import sys
import time

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from common import mt_bench_prompts  # noqa: E402
from jaxspec import Generator, SamplingParams, SpecConfig  # noqa: E402
from jaxspec.spec_policy import SpecPolicy  # noqa: E402

SPEC = SpecConfig("EAGLE3", num_steps=6, eagle_topk=4, num_draft_tokens=24)
STATS = ("steps", "verify_steps", "emitted", "behind_plain_steps")
for mb in (128, 64):
    g = Generator.from_pretrained("smollm2-135m", speculative=SPEC, max_batch=mb, max_seq_len=1024,
                                  spec_policy="measured", warmup=True, mem_fraction=0.8)
    s = g.scheduler
    print("max_batch", mb)
    print(s.spec_costs.table())
    log = []
    orig = SpecPolicy.verified
    SpecPolicy.verified = lambda self, rows, em: (log.append((rows, em)), orig(self, rows, em))
    p = SamplingParams(max_tokens=128)
    st0, t0, n = dict(s.stats), time.perf_counter(), 0
    for q in mt_bench_prompts()[:8]:
        out = g.generate([[{"role": "user", "content": q}]], p)
        n += len(out[0].token_ids)
    print("tok/s", n / (time.perf_counter() - t0), {k: s.stats[k] - st0[k] for k in STATS}, s.spec_policy.emitted)
    print("first verified", log[:6])
    SpecPolicy.verified = orig
