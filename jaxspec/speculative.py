"""Speculative-decoding configuration, in SGLang's option names."""
from __future__ import annotations

import dataclasses

ALGORITHMS = ("NGRAM",)


@dataclasses.dataclass
class SpecConfig:
    algorithm: str = "NGRAM"
    num_draft_tokens: int = 8  # tree nodes verified per step, the root (last sampled token) included
    # NGRAM
    ngram_min_match_window_size: int = 1
    ngram_max_match_window_size: int = 12
    ngram_max_bfs_breadth: int = 8
    ngram_branch_length: int = 18
    ngram_match_type: str = "BFS"
    ngram_capacity: int = 1_000_000

    def build(self, model):
        algo = self.algorithm.upper()
        if algo == "NGRAM":
            from jaxspec.drafters.ngram import NgramDrafter
            return NgramDrafter(self.num_draft_tokens, self.ngram_min_match_window_size,
                                self.ngram_max_match_window_size, self.ngram_max_bfs_breadth,
                                self.ngram_branch_length, self.ngram_match_type, self.ngram_capacity)
        raise ValueError(f"speculative algorithm {self.algorithm!r} is not available; choose one of {ALGORITHMS}")
