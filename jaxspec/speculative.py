"""Speculative-decoding configuration, in SGLang's option names."""
from __future__ import annotations

import dataclasses
import os

ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3", "NAIVE_EAGLE")

# Draft heads shipped with jaxspec for its embedded models (trained by `python -m jaxspec.train`).
_WEIGHTS = os.path.join(os.path.dirname(__file__), "drafters", "weights")
DEFAULT_HEADS = {"smollm2-135m": os.path.join(_WEIGHTS, "smollm2-135m-eagle3")}


@dataclasses.dataclass
class SpecConfig:
    algorithm: str = "NGRAM"
    num_draft_tokens: int = 8  # tree nodes verified per step, the root (last sampled token) included
    # EAGLE / EAGLE3 / NAIVE_EAGLE (NAIVE_EAGLE is a chain: topk 1, num_steps + 1 tokens)
    draft_model_path: str | None = None  # None: the head shipped for the embedded target, if any
    token_map: str | None = None  # FR-Spec: the ids the head may draft (.pt as SGLang writes it, .npy, .json)
    num_steps: int | None = None  # default 3, NAIVE_EAGLE 1 (seed 000's setting)
    eagle_topk: int = 4
    # NGRAM
    ngram_min_match_window_size: int = 1
    ngram_max_match_window_size: int = 12
    ngram_max_bfs_breadth: int = 8
    ngram_branch_length: int = 18
    ngram_match_type: str = "BFS"
    ngram_capacity: int = 1_000_000

    def build(self, model, model_name: str | None = None):
        algo = self.algorithm.upper()
        if self.token_map and algo not in ("EAGLE", "EAGLE3", "NAIVE_EAGLE"):
            raise ValueError(f"a token map restricts an EAGLE head's draft vocabulary; {algo} has no head")
        if algo == "NGRAM":
            from jaxspec.drafters.ngram import NgramDrafter
            return NgramDrafter(self.num_draft_tokens, self.ngram_min_match_window_size,
                                self.ngram_max_match_window_size, self.ngram_max_bfs_breadth,
                                self.ngram_branch_length, self.ngram_match_type, self.ngram_capacity)
        if algo in ("EAGLE", "EAGLE3", "NAIVE_EAGLE"):
            from jaxspec.drafters.eagle import EagleDrafter, load_head
            from jaxspec.drafters.eagle_step import TreeShape
            path = self.draft_model_path or DEFAULT_HEADS.get(model_name or "")
            if path is None:
                raise ValueError(f"speculative algorithm {algo} needs draft_model_path (a directory with an EAGLE "
                                 f"or EAGLE-3 head); jaxspec ships heads only for {', '.join(DEFAULT_HEADS)}")
            head = load_head(path, model.cfg, model, dtype=model.embed[...].dtype)
            if algo != "NAIVE_EAGLE" and head.cfg.kind != algo.lower():
                raise ValueError(f"speculative algorithm {algo} but {path} holds an {head.cfg.kind.upper()} head")
            if self.token_map:
                from jaxspec.drafters.token_map import apply_token_map, load_token_map
                apply_token_map(head, model, load_token_map(self.token_map, model.cfg.vocab_size))
            if algo == "NAIVE_EAGLE":
                steps = self.num_steps or 1
                tree = TreeShape(steps=steps, topk=1, num_draft_tokens=steps + 1)
            else:
                tree = TreeShape(self.num_steps or 3, self.eagle_topk, self.num_draft_tokens)
            if head.cfg.draft_vocab_size < tree.topk:
                raise ValueError(f"the token map lists {head.cfg.draft_vocab_size} ids, fewer than eagle_topk={tree.topk}")
            return EagleDrafter(head, tree)
        raise ValueError(f"speculative algorithm {self.algorithm!r} is not available; choose one of {ALGORITHMS}")
