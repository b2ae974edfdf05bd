"""Greedy outputs of the Generator on 20 chat prompts (SmolLM2, float32), recorded before the
engine's restructure (tests/data/golden_outputs.json) and checked after: the restructure must not
change a token. `python tests/golden.py OUT.json` records them."""
from __future__ import annotations

import json
import sys

PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn leaves.", "Explain recursion to a child.",
    "List three uses of a paperclip.", "What is 17 times 23?", "Translate 'good morning' into Spanish.",
    "Give me a short tip for learning to cook.", "Why is the sky blue?", "Write a Python function that reverses a string.",
    "Name a famous painting and its painter.", "How do plants make food?", "Describe a cat in one sentence.",
    "What does a compiler do?", "Suggest a name for a pet goldfish.", "What is the boiling point of water?",
    "Write two lines of a poem about the sea.", "How many days are in a leap year?",
    "What is the difference between weather and climate?", "Tell me a fun fact about octopuses.",
    "Summarize the story of Cinderella in one sentence.",
]
ALGORITHMS = ("plain", "EAGLE3", "NGRAM")
MAX_TOKENS = 24


def generate(algo: str, prompts: list = PROMPTS) -> list:
    import jax.numpy as jnp

    from jaxspec import Generator, SamplingParams, SpecConfig
    spec = None if algo == "plain" else (
        SpecConfig("EAGLE3", num_steps=3, eagle_topk=4, num_draft_tokens=8) if algo == "EAGLE3"
        else SpecConfig("NGRAM", num_draft_tokens=8))
    # the test suite's SmolLM2 engine shape (conftest.SMOL_KW); greedy outputs do not depend on the batch
    gen = Generator.from_pretrained("smollm2-135m", dtype=jnp.float32, speculative=spec, max_seq_len=256, max_batch=4,
                                    num_pages=80)
    done = gen.generate([[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=MAX_TOKENS))
    return [c.token_ids for c in done]


if __name__ == "__main__":
    res = {algo: generate(algo) for algo in ALGORITHMS}
    with open(sys.argv[1], "w") as f:
        json.dump({"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "outputs": res}, f)
