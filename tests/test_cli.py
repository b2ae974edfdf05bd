import subprocess
import sys

from conftest import subprocess_env


def test_cli_answers_paris():
    out = subprocess.run([sys.executable, "-m", "jaxspec", "generate", "--model", "smollm2-135m", "--prompt",
                          "What is the capital of France?", "--max-tokens", "24", "--speculative-algorithm", "NGRAM",
                          "--no-warmup"],  # the warm-up set and its cost table: test_programs.py, test_spec_policy.py
                         capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_cli_unknown_model_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "jaxspec", "generate", "--model", "no-such-model"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "not a known short name" in out.stderr


def test_auto_picks_the_shipped_eagle3_head_or_no_drafter():
    import argparse
    from jaxspec.speculative import add_flags, resolve_auto

    def resolved(model, auto_policy="auto", **given):
        ap = argparse.ArgumentParser()
        add_flags(ap)
        args = ap.parse_args([])  # the flags' own defaults
        vars(args).update(model=model, **given)
        resolve_auto(args, auto_policy)
        return (args.speculative_algorithm, args.speculative_num_steps, args.speculative_eagle_topk,
                args.speculative_num_draft_tokens, args.speculative_policy)

    assert resolved("smollm2-135m") == ("EAGLE3", 6, 4, 32, "auto")  # the tree chosen every call
    assert resolved("smollm2-135m", speculative_num_draft_tokens=8) == ("EAGLE3", 6, 4, 8, None)  # fixed
    assert resolved("smollm2-135m", speculative_policy="fixed") == ("EAGLE3", 6, 4, 32, "fixed")
    assert resolved("smollm2-135m", auto_policy="fixed") == ("EAGLE3", 6, 4, 32, "fixed")  # the CLI's generate
    assert resolved("some/hf-checkpoint")[0] == "NONE"
    assert resolved("smollm2-135m", speculative_algorithm="NGRAM")[0] == "NGRAM"


def test_programs_lists_the_start_up_set():
    def listed(*flags):
        out = subprocess.run([sys.executable, "-m", "jaxspec", "programs", "--max-batch", "64", *flags],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    # AUTO as the server resolves it: the shipped EAGLE-3 head under the auto policy, 4096 nodes a step fitting
    # each of its 5 shapes at every bucket (6:8:64 at 64 rows): 7 decode steps, 5 prefill shapes with the head
    # (none by the target alone), 5 x 7 verify steps, greedy and sampled apart
    eagle3 = listed()
    assert eagle3[0] == "82 programs (max batch 64):" and sum("verify_steps" in line for line in eagle3) == 70
    # the fixed 6:4:32 tree: 5 prefill shapes with the head and 5 by the target alone (bucket 64 gets no
    # tree), a verify step for the buckets whose tree keeps 16 nodes of the 128 a step (1..8; 32 at 1..4)
    fixed = listed("--speculative-policy", "fixed")
    assert fixed[0] == "25 programs (max batch 64):" and len(fixed) == 26
    assert sum("verify_steps" in line for line in fixed) == 8
    # a verify budget of 1024 nodes a step: a tree at every bucket (16 nodes at 64), no prefill by the target alone
    wide = listed("--speculative-policy", "fixed", "--speculative-max-verify-tokens", "1024")
    assert wide[0] == "26 programs (max batch 64):" and sum("verify_steps" in line for line in wide) == 14
    out = subprocess.run([sys.executable, "-m", "jaxspec", "programs", "--speculative-max-verify-tokens", "0"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "--speculative-max-verify-tokens must be >= 1, got 0" in out.stderr
    plain = listed("--speculative-algorithm", "NONE")
    assert plain[0] == "12 programs (max batch 64):" and all("greedy and sampled" in line for line in plain[1:])
