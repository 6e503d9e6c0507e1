"""The verify pass on its own, for tests: score draft trees of several sequences in one forward pass, and
pick the path to keep with the engine's own verifier.

The Generator runs this pass inside `_speculative_step`, next to other requests' prefill chunks; the
tests here drive the model, the batch layout's tree masks, `verify.verify_match` and the KV cache's
`commit_path` directly, on the cache's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from slipstream.engine.batch import BatchLayout
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.tree import tree_attention_mask
from slipstream.engine.verify import Proposal, Verified, VerifyEntry, verify_match


@dataclass(frozen=True, kw_only=True)
class VerifyTree:
    """A draft tree to verify for one sequence."""

    slot: int
    tokens: Sequence[int]
    """[n] node tokens in topological order; node 0 is the root: the sequence's pending token."""
    parents: Sequence[int]
    """[n] parent node of each node; -1 for the root."""


@dataclass(frozen=True)
class TreeScores:
    """Per tree: logits [n, vocab] (row i scores the token after node i) and hidden [n, hidden]."""

    base_lengths: list[int]
    logits: list[Tensor]
    hidden: list[Tensor]


@torch.inference_mode()
def score_trees(model: Transformer, cache: KVCache, trees: Sequence[VerifyTree]) -> TreeScores:
    """One verify pass over several sequences' draft trees, with tree attention masks.

    Node i of a tree is written to cache position base + i (base = the slot's length before the pass) at
    RoPE position base + depth(i). Afterwards each slot's length is base + n: the caller keeps the
    accepted path with `cache.commit_path(slot, base, accepted_nodes)` (or `rollback`).
    """
    base_lengths = [cache.length(tree.slot) for tree in trees]
    sizes = [len(tree.tokens) for tree in trees]
    for tree, n in zip(trees, sizes, strict=True):
        parents = [int(p) for p in tree.parents]
        if (
            len(parents) != n
            or n == 0
            or parents[0] != -1
            or any(not 0 <= p < i for i, p in enumerate(parents[1:], 1))
        ):
            raise ValueError(
                f"slot {tree.slot}: need one parent per token, node 0 as the root (parent -1) and every "
                f"other node's parent an earlier node; got parents {parents}"
            )
    masks = [
        tree_attention_mask(torch.tensor(tree.parents, dtype=torch.int64, device=cache.device))
        for tree in trees
    ]
    layout = BatchLayout.build(
        cache, [tree.slot for tree in trees], sizes, tree_masks=masks, logit_rows=range(sum(sizes))
    )
    ids = torch.tensor([t for tree in trees for t in tree.tokens], dtype=torch.int64, device=cache.device)
    logits, hidden = model(ids, layout.positions, layout, cache)
    offsets = layout.cu_seqlens
    return TreeScores(
        base_lengths=base_lengths,
        logits=[logits[offsets[i] : offsets[i + 1]] for i in range(len(trees))],
        hidden=[hidden[offsets[i] : offsets[i + 1]] for i in range(len(trees))],
    )


def score_tree(
    model: Transformer,
    cache: KVCache,
    slot: int,
    base_len: int,
    tokens: Sequence[int],
    parents: Sequence[int],
) -> tuple[Tensor, Tensor]:
    """Single-sequence `score_trees`: (logits [n, vocab], hidden [n, hidden]); checks the base length."""
    if cache.length(slot) != base_len:
        raise ValueError(f"slot {slot} holds {cache.length(slot)} tokens, not base_len {base_len}")
    scores = score_trees(model, cache, [VerifyTree(slot=slot, tokens=tokens, parents=parents)])
    return scores.logits[0], scores.hidden[0]


def accepted_path(logits: Tensor, tree: VerifyTree, params: SamplingParams, position: int) -> Verified:
    """`verify_match` on one scored tree (node 0 the root): the nodes to commit and the tokens emitted.
    position: that of the token after the root (the slot's base length + 1)."""
    proposal = Proposal(list(tree.tokens[1:]), [p - 1 for p in tree.parents[1:]])
    (verified,) = verify_match(logits, [VerifyEntry(0, proposal, params, position)])
    return verified
