"""The restructured engine gives the tokens the engine gave before it (tests/golden.py)."""
import json
import os

from golden import ALGORITHMS, generate_all


def test_greedy_outputs_equal_those_recorded_before_the_restructure():
    recorded = json.load(open(os.path.join(os.path.dirname(__file__), "data", "golden_outputs.json")))["outputs"]
    now = generate_all()
    for algo in ALGORITHMS:
        same = sum(a == b for a, b in zip(now[algo], recorded[algo]))
        assert same == len(recorded[algo]), f"{algo}: {same} of {len(recorded[algo])} prompts give the recorded tokens"
