"""The restructured engine gives the tokens the engine gave before it (tests/golden.py)."""
import json
import os

import pytest

from golden import ALGORITHMS, generate


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_greedy_outputs_equal_those_recorded_before_the_restructure(algo):
    recorded = json.load(open(os.path.join(os.path.dirname(__file__), "data", "golden_outputs.json")))["outputs"][algo]
    now = generate(algo)
    same = sum(a == b for a, b in zip(now, recorded))
    assert same == len(recorded), f"{algo}: {same} of {len(recorded)} prompts give the recorded tokens"
