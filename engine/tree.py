"""Draft trees: EAGLE-2 style construction, tree attention masks and positions.

A tree is two tensors: tokens [n] and parents [n] (parents[i] = -1 for a child of the root, otherwise an
earlier index, so a prefix of the arrays is always a tree). A chain is the tree with parents i − 1.

`build_tree` follows EAGLE-2 (Li et al., 2024): expand the top-k nodes of each depth by their top-k draft
tokens, scoring every node by its cumulative draft log-prob (a calibrated proxy of the chance the target
accepts the whole path), then keep the best `verify` nodes over all depths. A node never outscores its
parent (log-probs are <= 0), so the best nodes form a tree; ties are broken towards shallower and earlier
nodes, and a node is admitted only after its parent, which keeps that true under rounding too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DraftTree",
    "ExpandFn",
    "build_tree",
    "chain_parents",
    "path_to",
    "tree_attention_mask",
    "tree_depths",
    "tree_positions",
]

ExpandFn = Callable[[Tensor, Tensor, Tensor], Tensor]
"""expand(tokens [m], parents [m], frontier [f]) -> draft log-probs [f, V] of the token after each frontier
node. tokens/parents are all candidates so far (append-only, so indices are stable across calls, and a
drafter may key its own per-node state by them); frontier holds candidate indices, -1 for the root."""


@dataclass(frozen=True)
class DraftTree:
    """A selected draft tree in topological order (parents before children)."""

    tokens: Tensor
    """[n] int64."""
    parents: Tensor
    """[n] int64, -1 = child of the root."""
    scores: Tensor
    """[n] float32 cumulative draft log-prob of the path root → node."""

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def depths(self) -> Tensor:
        return tree_depths(self.parents)


def chain_parents(k: int, device: torch.device | str | None = None) -> Tensor:
    """Parents of a chain of k tokens: [-1, 0, 1, …, k-2], on `device` (None: the CPU)."""
    return torch.arange(-1, k - 1, dtype=torch.int64, device=device)


def tree_attention_mask(parents: Tensor, depth: int | None = None) -> Tensor:
    """bool [n, n] on parents' device: node i attends to node j iff j is i or an ancestor of i.

    The committed prefix is visible to every node; callers prepend it. Costs O(depth) tensor ops; `depth`
    (the most ancestors any node has), where the caller knows it, spares the host read per level that
    otherwise finds where the walk ends.
    """
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    rows = torch.arange(n, device=parents.device)
    parents = parents.long()
    ancestor = parents
    for _ in range(n if depth is None else depth):
        live = ancestor >= 0
        if depth is None and not bool(live.any()):
            break
        at = ancestor.clamp_min(0)
        mask[rows, at] |= live  # dead rows or no-ops at column 0: no data-dependent shapes
        ancestor = torch.where(live, parents[at], -1)
    return mask


def tree_depths(parents: Tensor) -> Tensor:
    """Depth of each node [n] int64: 0 for the root's children."""
    return tree_attention_mask(parents).sum(-1) - 1


def tree_positions(parents: Tensor, base_position: int) -> Tensor:
    """Sequence positions of the nodes [n] (RoPE): base_position is that of the root's children."""
    return tree_depths(parents) + base_position


def path_to(parents: Tensor, node: int) -> list[int]:
    """Node indices from the root's child down to `node` (inclusive)."""
    path = []
    parent_of = parents.tolist()
    while node >= 0:
        path.append(node)
        node = parent_of[node]
    return path[::-1]


def build_tree(
    expand: ExpandFn, depth: int, topk: int, verify: int, device: torch.device | str | None = None
) -> DraftTree:
    """Build an EAGLE-2 draft tree of at most `verify` nodes and at most `depth` levels.

    Each level expands the `topk` best nodes of the previous level (by cumulative log-prob) into their
    `topk` most likely tokens; the final tree keeps the `verify` best candidates over all levels.
    `device`: where the root's (empty) expand inputs are made (None: the CPU); every later tensor, and the
    tree, is on the device of the log-probs `expand` returns.
    """
    for name, value in (("depth", depth), ("topk", topk), ("verify", verify)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    tokens = torch.empty(0, dtype=torch.int64, device=device)
    parents = torch.empty(0, dtype=torch.int64, device=device)
    frontier = torch.tensor([-1], dtype=torch.int64, device=device)
    logprobs = expand(tokens, parents, frontier).float()  # [1, V]
    # Candidates live where the drafter's log-probs are (the same device when the caller names it).
    device = logprobs.device
    tokens, parents, frontier = tokens.to(device), parents.to(device), frontier.to(device)
    scores = torch.empty(0, dtype=torch.float32, device=device)
    levels = torch.empty(0, dtype=torch.int64, device=device)
    frontier_scores = torch.zeros(1, device=device)
    for level in range(depth):
        if level:
            logprobs = expand(tokens, parents, frontier).float()  # [f, V]
        width = min(topk, logprobs.shape[-1])
        top_lp, top_tok = logprobs.topk(width, dim=-1)  # [f, width]
        child_scores = (frontier_scores[:, None] + top_lp).reshape(-1)
        keep = torch.isfinite(child_scores)  # a token the drafter gives probability 0 is no candidate
        first = tokens.numel()
        tokens = torch.cat([tokens, top_tok.reshape(-1)[keep]])
        parents = torch.cat([parents, frontier.repeat_interleave(width)[keep]])
        scores = torch.cat([scores, child_scores[keep]])
        levels = torch.cat([levels, torch.full_like(child_scores, level, dtype=torch.int64)[keep]])
        new_scores = scores[first:]
        if new_scores.numel() == 0 or level == depth - 1:
            break
        best = new_scores.topk(min(topk, new_scores.numel())).indices
        frontier = best + first
        frontier_scores = new_scores[best]
    return _select(tokens, parents, scores, levels, verify)


def _select(tokens: Tensor, parents: Tensor, scores: Tensor, levels: Tensor, verify: int) -> DraftTree:
    """The best `verify` candidates, each admitted only after its parent, in topological order."""
    score_of, level_of, parent_of = scores.tolist(), levels.tolist(), parents.tolist()
    order = sorted(range(len(score_of)), key=lambda i: (-score_of[i], level_of[i], i))
    chosen: list[int] = []
    taken: set[int] = set()
    for i in order:
        if len(chosen) == verify:
            break
        if parent_of[i] < 0 or parent_of[i] in taken:
            chosen.append(i)
            taken.add(i)
    rank = {node: r for r, node in enumerate(chosen)}
    chosen.sort(key=lambda i: (level_of[i], rank[i]))
    new_index = {old: new for new, old in enumerate(chosen)}
    idx = torch.tensor(chosen, dtype=torch.int64, device=tokens.device)
    return DraftTree(
        tokens=tokens[idx],
        parents=torch.tensor(
            [new_index.get(parent_of[i], -1) for i in chosen], dtype=torch.int64, device=tokens.device
        ),
        scores=scores[idx],
    )
