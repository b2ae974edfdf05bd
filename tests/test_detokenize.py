"""The output text grown token by token equals decoding the whole output, at every step."""
import numpy as np
import pytest

from jaxspec.detokenize import IncrementalText


@pytest.fixture(scope="module")
def tok():
    from jaxspec.models.gguf_file import GGUFFile
    from jaxspec.models.loading import gguf_tokenizer, resolve
    path = resolve("smollm2-135m")
    return gguf_tokenizer(GGUFFile(path).metadata, path)


TEXTS = ["Hello, world! 1, 2, 3, 4, 5.", "  leading spaces\n\ttabs and\nnewlines  ", "naïve café — 東京 🚀🚀 ok",
         "<|im_start|>assistant\nspecial tokens are skipped<|im_end|>"]


@pytest.mark.parametrize("text", TEXTS)
def test_each_step_is_a_prefix_and_the_end_is_the_whole_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    inc = IncrementalText(tok)
    grown = ""
    for n in range(1, len(ids) + 1):
        grown += inc.update(ids[:n])
        assert grown == inc.text and full.startswith(inc.text) and "\ufffd" not in inc.text
        # it holds back only the text of tokens that end in an unfinished character
        rest = tok.decode(ids[:n], skip_special_tokens=True)[len(inc.text):]
        assert rest == "" or rest.endswith("\ufffd")
    assert inc.final(ids) == full == inc.text


def test_random_tokens_and_several_at_once(tok):
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = [int(i) for i in rng.integers(0, 49152, 40)]
        inc = IncrementalText(tok)
        n = 0
        while n < len(ids):
            n += int(rng.integers(1, 5))
            inc.update(ids[:n])
            assert tok.decode(ids[:n], skip_special_tokens=True).startswith(inc.text)
        assert inc.final(ids) == tok.decode(ids, skip_special_tokens=True)
