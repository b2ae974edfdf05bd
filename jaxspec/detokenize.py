"""A request's output text, grown as tokens arrive, decoding only the newest tokens.

Decoding the whole output on every token (for stop strings, for each streamed chunk) made a
request's host work grow with the square of its length. Here each new token decodes a short
window: the tokens since the last whole character plus the ones before them (a tokenizer may
render a token differently at the start of a text, e.g. SentencePiece's leading space), and the
window's text past what was already read is appended. A window ending in an incomplete UTF-8
sequence (U+FFFD) waits for the tokens that complete it.
"""
from __future__ import annotations


class IncrementalText:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""  # the text of the tokens read, whole characters only
        self._prefix = 0  # the window starts here: context for the tokens from _read on
        self._read = 0  # tokens whose text is in self.text
        self._seen = 0  # tokens taken

    def _decode(self, ids, start, end) -> str:
        return self.tokenizer.decode(ids[start:end], skip_special_tokens=True)

    def update(self, ids) -> str:
        """Take the tokens of `ids` (the whole output so far) not taken yet; returns the text they
        completed ("" while a character is incomplete)."""
        if len(ids) == self._seen:
            return ""
        self._seen = len(ids)
        before = self._decode(ids, self._prefix, self._read)
        after = self._decode(ids, self._prefix, len(ids))
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before):]
        self.text += new
        self._prefix, self._read = self._read, len(ids)
        return new

    def final(self, ids) -> str:
        """The whole text, an incomplete last character included (as decoding everything gives)."""
        self.update(ids)
        before = self._decode(ids, self._prefix, self._read)
        return self.text + self._decode(ids, self._prefix, len(ids))[len(before):]
