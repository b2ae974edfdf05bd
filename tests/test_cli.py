import subprocess
import sys


def test_cli_answers_paris():
    out = subprocess.run([sys.executable, "-m", "jaxspec", "generate", "--model", "smollm2-135m", "--prompt",
                          "What is the capital of France?", "--max-tokens", "24"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_cli_unknown_model_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "jaxspec", "generate", "--model", "no-such-model"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "not a known short name" in out.stderr
