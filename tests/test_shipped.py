"""The drafters and token map shipped for the embedded SmolLM2 load by name and keep its greedy
output (float32), while the target accepts what they draft."""
import functools
import os

import numpy as np
import pytest

from jaxspec import Generator, SamplingParams, SpecConfig
from jaxspec.speculative import shipped_drafter

from conftest import SMOL_KW

PROMPTS = [[{"role": "user", "content": "Write a Python function that reverses a list."}],
           [{"role": "user", "content": "Explain what a hash map is."}]]
PARAMS = SamplingParams(max_tokens=24)
KW = SMOL_KW
MAP = os.path.join(os.path.dirname(shipped_drafter("smollm2-135m", "EAGLE")), "smollm2-135m-token-map", "map.npy")


@functools.cache
def plain_tokens(model, tok):
    return [c.token_ids for c in Generator(model, tok, **KW).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("spec", [
    SpecConfig("EAGLE3", num_steps=4, eagle_topk=4, num_draft_tokens=8),
    SpecConfig("EAGLE", num_steps=4, eagle_topk=4, num_draft_tokens=8, token_map=MAP),  # FR-Spec, 32k ranked ids
    SpecConfig("DFLASH"),
], ids=["eagle3", "eagle+map", "dflash"])
def test_shipped_smollm2_drafters_are_lossless(smollm, spec):
    model, tok = smollm
    drafter = spec.build(model, "smollm2-135m")
    out = Generator(model, tok, drafter=drafter, **KW).generate(PROMPTS, PARAMS)
    assert [c.token_ids for c in out] == plain_tokens(model, tok)
    assert np.mean([c.mean_accept_length for c in out]) > 1.3


def test_the_shipped_map_ranks_the_vocabulary_and_its_report_covers_it():
    import json
    ids = np.load(MAP)
    assert ids.shape == (32768,) and len(np.unique(ids)) == 32768 and ids.max() < 49152
    report = json.load(open(os.path.join(os.path.dirname(MAP), "report.json")))
    assert report["prompts"] == "self-generated" and report["emitted_tokens"] > 100_000
    cov = [report["coverage"][k] for k in ("1024", "2048", "4096", "8192")]
    assert all(a <= b for a, b in zip(cov, cov[1:])) and cov[0] > 0.5
