"""Speculative-decoding configuration, in SGLang's option names."""
from __future__ import annotations

import dataclasses
import os

from jaxspec.spec_shapes import DEFAULT_TREE

ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3", "NAIVE_EAGLE", "DFLASH")
TREE_FLAGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")

# Drafters shipped with jaxspec for its embedded models (trained by `python -m jaxspec.train`), by
# algorithm; a directory missing from this checkout is not offered.
_WEIGHTS = os.path.join(os.path.dirname(__file__), "drafters", "weights")
SHIPPED = {"smollm2-135m": {"EAGLE3": "smollm2-135m-eagle3", "NAIVE_EAGLE": "smollm2-135m-eagle3",
                            "EAGLE": "smollm2-135m-eagle", "DFLASH": "smollm2-135m-dflash"}}


def shipped_drafter(model_name: str | None, algorithm: str) -> str | None:
    name = SHIPPED.get(model_name or "", {}).get(algorithm)
    path = name and os.path.join(_WEIGHTS, name)
    return path if path and os.path.isdir(path) else None


def add_flags(ap) -> None:
    """The speculative flags of the server and the CLI (SGLang's names) on an argparse parser."""
    ap.add_argument("--speculative-algorithm", default="AUTO",
                    help="NGRAM, EAGLE, EAGLE3, NAIVE_EAGLE, DFLASH, NONE, or AUTO: EAGLE3 "
                         f"{':'.join(map(str, DEFAULT_TREE))} where a trained head ships for the model, else NONE")
    ap.add_argument("--speculative-draft-model-path", help="EAGLE head or DFLASH drafter directory (default: the shipped one)")
    ap.add_argument("--speculative-token-map", help="FR-Spec: token ids the EAGLE head may draft (.pt/.npy/.json)")
    ap.add_argument("--speculative-token-map-refresh", type=int, default=0,
                    help="refresh the token map from the emitted tokens every N of them (0: never)")
    ap.add_argument("--speculative-num-steps", type=_int_or_auto, help="EAGLE tree depth, or auto (see --speculative-policy)")
    ap.add_argument("--speculative-eagle-topk", type=_int_or_auto,
                    help="branching per draft step (default 4; DFLASH: 1, a chain, or > 1 for a tree), or auto")
    ap.add_argument("--speculative-num-draft-tokens", type=_int_or_auto,
                    help="nodes verified a step (default 8; DFLASH: its block size), or auto")
    ap.add_argument("--speculative-dflash-block-size", type=int,
                    help="DFLASH: tokens a draft pass proposes and a step verifies (default: the drafter's)")
    ap.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=8)
    ap.add_argument("--speculative-ngram-match-type", default="BFS")
    ap.add_argument("--speculative-policy", choices=["fixed", "auto"],
                    help="EAGLE family and DFLASH: verify the given tree, cut to fit the batch (fixed), or choose "
                         "every call among several tree shapes by the step costs and accept lengths seen (auto; also "
                         "set by a tree flag's value auto). Default: auto for the server's AUTO head given no tree "
                         "numbers, else fixed")
    ap.add_argument("--speculative-max-verify-tokens", type=int,
                    help="EAGLE family and DFLASH: tree nodes a verify step may take over its whole batch bucket "
                         "(default 128 under the fixed policy, 4096 under auto); a bucket where no tree fits decodes "
                         "plainly, its heads left behind")


def _int_or_auto(value: str):
    return value if value == "auto" else int(value)


def config_from_flags(args, auto_policy: str = "auto") -> "SpecConfig | None":
    """The SpecConfig add_flags' flags describe (AUTO resolved: see resolve_auto), or None for plain
    decoding."""
    if any(getattr(args, f) == "auto" for f in TREE_FLAGS):
        args.speculative_policy = "auto"  # the tree flags left as numbers size the prefill's first draft
        for f in TREE_FLAGS:
            if getattr(args, f) == "auto":
                setattr(args, f, None)
    resolve_auto(args, auto_policy)
    if args.speculative_policy is None:
        args.speculative_policy = "fixed"
    if args.speculative_algorithm.upper() == "NONE":
        return None
    return SpecConfig(args.speculative_algorithm, num_draft_tokens=args.speculative_num_draft_tokens,
                      ngram_max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
                      ngram_match_type=args.speculative_ngram_match_type,
                      draft_model_path=args.speculative_draft_model_path, token_map=args.speculative_token_map,
                      token_map_refresh=args.speculative_token_map_refresh, num_steps=args.speculative_num_steps,
                      eagle_topk=args.speculative_eagle_topk, dflash_block_size=args.speculative_dflash_block_size)


def verify_budget(args) -> dict:
    """The Generator's keyword for --speculative-max-verify-tokens, if given."""
    n = args.speculative_max_verify_tokens
    if n is not None and n < 1:
        raise ValueError(f"--speculative-max-verify-tokens must be >= 1, got {n}")
    return {} if n is None else dict(spec_max_verify_tokens=n)


def resolve_auto(args, auto_policy: str = "auto") -> None:
    """The command lines' --speculative-algorithm AUTO, resolved in place on their parsed flags:
    EAGLE3 where a trained head ships for the model, else NONE (for a model without one, no
    drafter is known to pay). Given no tree numbers and no policy, the tree policy is auto_policy
    (6:4:32 sizing the prefill's first draft, or verified every call under 'fixed': on the H200 at batch 1 it
    ran at 2.31x / 2.88x plain on MT-bench / HumanEval against 6:4:24's 2.22x / 2.71x, spec-dflash4-). The server's
    is 'auto': served on the H200 (MT-bench, 256 tokens) it ran at 2.48x / 1.20x / 1.11x / 1.12x
    plain at concurrency 1 / 8 / 32 / 128, the fixed 6:4:24 tree at 2.35x / 1.26x / 0.90x / 1.04x
    (serve-auto-NVIDIA-H200.json). The CLI's one-shot generate keeps 'fixed': its few calls leave
    auto exploring, and building every shape made its cold start on the CPU 137 s against 58
    (cli_start-cpu.json). Tree numbers given keep their values, the others 6:4:32's."""
    if args.speculative_algorithm.upper() != "AUTO":
        return
    if args.speculative_draft_model_path is None and shipped_drafter(args.model, "EAGLE3") is None:
        args.speculative_algorithm = "NONE"
        return
    args.speculative_algorithm = "EAGLE3"
    tree = tuple(zip(TREE_FLAGS, DEFAULT_TREE))
    if args.speculative_policy is None and all(getattr(args, flag) is None for flag, _ in tree):
        args.speculative_policy = auto_policy
    for flag, value in tree:
        if getattr(args, flag) is None:
            setattr(args, flag, value)


@dataclasses.dataclass
class SpecConfig:
    algorithm: str = "NGRAM"
    # tree nodes verified per step, the root (last sampled token) included; None: 8, or for DFLASH
    # the drafter's trained block size
    num_draft_tokens: int | None = None
    # EAGLE / EAGLE3 / NAIVE_EAGLE (NAIVE_EAGLE is a chain: topk 1, num_steps + 1 tokens), DFLASH
    draft_model_path: str | None = None  # None: the drafter shipped for the embedded target, if any
    token_map: str | None = None  # FR-Spec: the ids the head may draft (.pt as SGLang writes it, .npy, .json)
    # emitted tokens between refreshes of the token map from what the engine emits (0: the map stays)
    token_map_refresh: int = 0
    num_steps: int | None = None  # default 3, NAIVE_EAGLE 1 (seed 000's setting)
    # branching per step (default 4; DFLASH: 1, SGLang's chain; > 1 a tree from the block's distributions)
    eagle_topk: int | None = None
    # DFLASH: tokens a draft pass proposes, the root included (SGLang's --speculative-dflash-block-size);
    # None: num_draft_tokens if given, else the drafter's trained block size
    dflash_block_size: int | None = None
    # NGRAM
    ngram_min_match_window_size: int = 1
    ngram_max_match_window_size: int = 12
    ngram_max_bfs_breadth: int = 8
    ngram_branch_length: int = 18
    ngram_match_type: str = "BFS"
    ngram_capacity: int = 1_000_000

    def build(self, model, model_name: str | None = None):
        algo = self.algorithm.upper()
        if algo not in ALGORITHMS:
            raise ValueError(f"speculative algorithm {self.algorithm!r} is not available; choose one of {ALGORITHMS}")
        if self.token_map and algo not in ("EAGLE", "EAGLE3", "NAIVE_EAGLE"):
            raise ValueError(f"a token map restricts an EAGLE head's draft vocabulary; {algo} has no head")
        if self.token_map_refresh and not self.token_map:
            raise ValueError("token_map_refresh refreshes a token map: give the starting one (token_map)")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 2:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} must be >= 2 (the root plus at least one draft)")
        nodes = self.num_draft_tokens or 8
        if algo == "NGRAM":
            from jaxspec.drafters.ngram import NgramDrafter
            return NgramDrafter(nodes, self.ngram_min_match_window_size,
                                self.ngram_max_match_window_size, self.ngram_max_bfs_breadth,
                                self.ngram_branch_length, self.ngram_match_type, self.ngram_capacity)
        from jaxspec.drafters.eagle_step import TreeShape
        path = self.draft_model_path or shipped_drafter(model_name, algo)
        if path is None:
            shipped = sorted(m for m, by in SHIPPED.items() if shipped_drafter(m, algo))
            raise ValueError(f"speculative algorithm {algo} needs draft_model_path (a directory with "
                             f"{'a DFLASH drafter' if algo == 'DFLASH' else 'an EAGLE or EAGLE-3 head'}); jaxspec ships "
                             f"one only for {', '.join(shipped) or 'no model'}")
        dtype = model.embed[...].dtype
        if algo == "DFLASH":
            from jaxspec.drafters.dflash import DFlashDrafter, load_dflash
            head = load_dflash(path, model.cfg, dtype=dtype)
            topk = self.eagle_topk or 1
            n = self.dflash_block_size or (self.num_draft_tokens if topk == 1 else None) or head.cfg.block_size
            if n < 2 or n > 64:
                raise ValueError(f"DFLASH block size {n} must be in [2, 64] (the root plus at least one draft)")
            if topk == 1:  # SGLang's DFLASH: the block verified as a chain
                return DFlashDrafter(head, TreeShape(steps=n - 1, topk=1, num_draft_tokens=n))
            steps = self.num_steps or n - 1
            if steps > n - 1:
                raise ValueError(f"DFLASH tree depth num_steps={steps} exceeds the block's {n - 1} drafted positions")
            return DFlashDrafter(head, TreeShape(steps, topk, self.num_draft_tokens or 2 * n))
        from jaxspec.drafters.eagle import EagleDrafter, load_head
        head = load_head(path, model.cfg, model, dtype=dtype)
        if algo != "NAIVE_EAGLE" and head.cfg.kind != algo.lower():
            raise ValueError(f"speculative algorithm {algo} but {path} holds an {head.cfg.kind.upper()} head")
        adaptive = None
        if self.token_map:
            from jaxspec.drafters.token_map import AdaptiveTokenMap, apply_token_map, load_token_map
            ids = load_token_map(self.token_map, model.cfg.vocab_size)
            if self.token_map_refresh:
                adaptive = AdaptiveTokenMap(head, model, ids, self.token_map_refresh)
            else:
                apply_token_map(head, model, ids)
        if algo == "NAIVE_EAGLE":
            steps = self.num_steps or 1
            tree = TreeShape(steps=steps, topk=1, num_draft_tokens=steps + 1)
        else:
            tree = TreeShape(self.num_steps or 3, self.eagle_topk or 4, nodes)
        if head.cfg.draft_vocab_size < tree.topk:
            raise ValueError(f"the token map lists {head.cfg.draft_vocab_size} ids, fewer than eagle_topk={tree.topk}")
        return EagleDrafter(head, tree, adaptive)
