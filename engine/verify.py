"""Lossless verification of speculative drafts: pure functions, tensors in, tensors out.

`verify_chain` checks a batch of drafted chains against the target's distributions for k+1 positions;
`verify_tree` walks one request's draft tree. q (`target_probs`) and p (`draft_probs`) are the processed
distributions (after temperature / top-k / top-p): what the sampler would use is what is verified.

Two modes (details, and why the noise keeps every round fresh: docs/engine.md, "Verification"):
- "rejection" (speculative sampling, Leviathan et al. / Chen et al.): accept draft x with probability
  min(1, q(x)/p(x)); at the first rejection draw from normalise(max(q − p, 0)); after full acceptance draw
  a bonus token from the last q. A deterministic drafter (n-gram) is a point mass p.
- "match" (reproducible): the target's token at each position is what `sampling.sample` would draw there
  with the same (seed, position) noise; drafts are accepted while they equal it, so the output is
  token-identical to plain decoding with the same seeds, whatever the drafter.
Greedy rows need no special case: q is one-hot, so both modes accept exactly the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from slipstream.engine.sampling import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_RESIDUAL_TAIL,
    STREAM_SAMPLE,
    STREAM_TAIL,
    keyed_uniform,
    race_sample,
)

__all__ = ["PAD_TOKEN", "ChainVerification", "TreeVerification", "verify_chain", "verify_tree"]

Mode = Literal["rejection", "match"]
PAD_TOKEN = -1
"""Fills `ChainVerification.tokens` past `num_emitted`."""


@dataclass(frozen=True)
class ChainVerification:
    """Outcome of verifying a batch of chains."""

    accept_length: Tensor
    """[B] int64: draft tokens accepted per row."""
    tokens: Tensor
    """[B, k+1] int64: emitted tokens (accepted drafts, then the correction or bonus token), PAD_TOKEN after."""
    num_emitted: Tensor
    """[B] int64: accept_length + 1."""
    logprobs: Tensor
    """[B, k+1] float32: log q of each emitted token at its position (the behaviour policy for RL), 0 after."""


@dataclass(frozen=True)
class TreeVerification:
    """Outcome of verifying one draft tree."""

    accepted: Tensor
    """[a] int64: accepted node indices, root to leaf (the path the KV cache commits)."""
    tokens: Tensor
    """[a+1] int64: the accepted nodes' tokens, then the target's next token."""
    logprobs: Tensor
    """[a+1] float32: log q of each emitted token."""

    @property
    def accept_length(self) -> int:
        return int(self.accepted.numel())


def _accepts(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    """Accept with probability min(1, q(x)/p(x)): u < q/p without the division (p may be 0)."""
    return u * p_x.double() < q_x.double()


def _residual(q: Tensor, p: Tensor | None, draft: Tensor) -> Tensor:
    """Where to draw after a rejection: max(q − p, 0), unnormalised (the race normalises) [r, V].

    q is a fresh copy the caller owns. p None is the point mass on `draft` [r]: the residual is q
    without the draft token.
    """
    if p is None:
        q[torch.arange(q.shape[0]), draft] = 0.0
        return q
    return q.sub_(p).clamp_min_(0.0)


def _without(q: Tensor, token: int) -> Tensor:
    """q with a rejected point-mass draft removed (the residual of a point mass)."""
    q = q.clone()
    q[token] = 0.0
    return q


def _check_mode(mode: str) -> None:
    if mode not in ("rejection", "match"):
        raise ValueError(f"mode must be 'rejection' or 'match', got {mode!r}")


def _lengths(draft_tokens: Tensor, draft_lengths: Tensor | None) -> Tensor:
    b, k = draft_tokens.shape
    if draft_lengths is None:
        return torch.full((b,), k, dtype=torch.int64)
    if draft_lengths.shape != (b,) or bool((draft_lengths < 0).any()) or bool((draft_lengths > k).any()):
        raise ValueError(f"draft_lengths must be [B] in [0, k={k}], got {draft_lengths.tolist()}")
    return draft_lengths.long()


def verify_chain(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    seeds: Tensor,
    positions: Tensor,
    mode: Mode = "rejection",
    draft_lengths: Tensor | None = None,
) -> ChainVerification:
    """Verify drafted chains; every row emits accept_length + 1 tokens with the law of plain decoding.

    draft_tokens [B, k] int64; draft_probs [B, k, V] (p of the distribution each draft token was drawn
    from) or None for a deterministic drafter; target_probs [B, k+1, V] (q after each prefix); seeds [B];
    positions [B]: the position of the first draft token. draft_lengths [B] (default k): row b's drafts
    beyond draft_lengths[b] are padding, and its bonus comes from target_probs[b, draft_lengths[b]].
    "match" ignores draft_probs. Cost: "match" draws only while a row agrees (accepted + 1 races);
    "rejection" one race per row.
    """
    _check_mode(mode)
    b, k = draft_tokens.shape
    v = target_probs.shape[-1]
    if target_probs.shape != (b, k + 1, v):
        raise ValueError(f"target_probs must be [B={b}, k+1={k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (b, k, v):
        raise ValueError(f"draft_probs must be [B={b}, k={k}, V={v}], got {tuple(draft_probs.shape)}")
    lengths = _lengths(draft_tokens, draft_lengths)  # [B]
    seeds, positions = seeds.long(), positions.long()
    rows = torch.arange(b)
    cols = torch.arange(k + 1)
    drafts = draft_tokens.long().clamp(0, v - 1)  # padding may hold anything
    valid = cols[None, :k] < lengths[:, None]  # [B, k]

    if mode == "match":
        # The target's own draw at each position, computed only while the row still agrees (j <= length):
        # the work is the accepted length, not k + 1 full-vocabulary races per row.
        target_tokens = torch.zeros(b, k + 1, dtype=torch.int64)
        accept_length = torch.zeros(b, dtype=torch.int64)
        alive = rows
        for j in range(k + 1):
            drawn = race_sample(target_probs[alive, j], seeds[alive], positions[alive] + j)
            target_tokens[alive, j] = drawn
            if j == k:
                break
            agree = (drafts[alive, j] == drawn) & valid[alive, j]
            alive = alive[agree]
            accept_length[alive] += 1
            if alive.numel() == 0:
                break
        emitted = torch.where(cols[None, :] <= accept_length[:, None], target_tokens, PAD_TOKEN)
    else:
        q_x = target_probs[:, :k].gather(2, drafts[..., None])[..., 0]  # [B, k]
        p_x = (
            torch.ones_like(q_x) if draft_probs is None else draft_probs.gather(2, drafts[..., None])[..., 0]
        )
        flat_seeds = seeds.repeat_interleave(k)
        flat_pos = (positions[:, None] + cols[None, :k]).reshape(-1)
        u = keyed_uniform(flat_seeds, flat_pos, STREAM_ACCEPT, 1).view(b, k)  # [B, k]
        accept = _accepts(u, p_x, q_x) & valid
        accept_length = accept.long().cumprod(1).sum(1)  # [B]
        final = torch.empty(b, dtype=torch.int64)
        rejected = accept_length < lengths
        rej = rejected.nonzero()[:, 0]
        if rej.numel() > 0:
            at = accept_length[rej]
            p_at = None if draft_probs is None else draft_probs[rej, at]
            residual = _residual(target_probs[rej, at], p_at, drafts[rej, at])  # [r, V]
            # p >= q everywhere means p == q, where rejection has probability 0 (up to rounding): fall back.
            empty = residual.sum(-1) <= 0
            if bool(empty.any()):
                residual[empty] = target_probs[rej[empty], at[empty]]
            final[rej] = race_sample(
                residual, seeds[rej], positions[rej] + at, STREAM_RESIDUAL, STREAM_RESIDUAL_TAIL
            )
        bonus = (~rejected).nonzero()[:, 0]
        if bonus.numel() > 0:
            at = accept_length[bonus]
            final[bonus] = race_sample(
                target_probs[bonus, at], seeds[bonus], positions[bonus] + at, STREAM_SAMPLE, STREAM_TAIL
            )
        emitted = torch.where(cols[None, :k] < accept_length[:, None], drafts, PAD_TOKEN)
        emitted = torch.cat([emitted, torch.full((b, 1), PAD_TOKEN)], 1)
        emitted[rows, accept_length] = final

    n_emitted = accept_length + 1
    mask = cols[None, :] < n_emitted[:, None]  # [B, k+1]
    chosen = target_probs.gather(2, emitted.clamp_min(0)[..., None])[..., 0]  # [B, k+1]
    logprobs = torch.where(mask, chosen.float().log(), 0.0)
    return ChainVerification(
        accept_length=accept_length, tokens=emitted, num_emitted=n_emitted, logprobs=logprobs
    )


def _children(parents: Tensor) -> dict[int, list[int]]:
    """Children of every node (-1 = root), in index order."""
    out: dict[int, list[int]] = {}
    for node, parent in enumerate(parents.tolist()):
        out.setdefault(int(parent), []).append(node)
    return out


def verify_tree(
    tokens: Tensor,
    parents: Tensor,
    target_probs: Tensor,
    seed: int,
    base_position: int,
    mode: Mode = "match",
) -> TreeVerification:
    """Verify one request's draft tree by walking it with draws from q.

    tokens [n], parents [n] (-1 = child of the root, parents[i] < i not required), target_probs [n+1, V]:
    row 0 is q at the root, row i+1 is q after node i. base_position is the position of the root's
    children. "match": at each depth draw the target's token exactly as plain decoding would and descend
    while a child carries it (token-identical to plain decoding). "rejection": recursive rejection
    sampling over the children as point masses (SpecInfer) — try each child c with probability q(c), remove
    it from q on rejection, and draw from what is left; the same law, from independent noise.
    """
    _check_mode(mode)
    n = tokens.numel()
    if parents.shape != (n,) or target_probs.shape[0] != n + 1:
        raise ValueError(
            f"tree of {n} tokens needs parents [{n}] and target_probs [{n + 1}, V], "
            f"got {tuple(parents.shape)} and {tuple(target_probs.shape)}"
        )
    children = _children(parents)
    token_of = tokens.tolist()
    seeds = torch.tensor([seed], dtype=torch.int64)
    node, depth = -1, 0
    path: list[int] = []
    out_tokens: list[int] = []
    while True:
        q = target_probs[node + 1]  # [V]
        position = torch.tensor([base_position + depth], dtype=torch.int64)
        kids = children.get(node, [])
        nxt = None
        if mode == "match":
            token = int(race_sample(q[None], seeds, position)[0])
            nxt = next((c for c in kids if token_of[c] == token), None)
        else:
            u = keyed_uniform(seeds, position, STREAM_ACCEPT, max(len(kids), 1))[0].tolist()
            rest = q.double()
            for j, c in enumerate(kids):
                tok = token_of[c]
                # Accept child c with probability rest(c) / sum(rest): q renormalised without the
                # children already rejected.
                if u[j] * float(rest.sum()) < float(rest[tok]):
                    nxt, token = c, tok
                    break
                rest = _without(rest, tok)
            if nxt is None:
                if float(rest.sum()) <= 0:  # every token with mass was a child: rounding; draw from q
                    rest = q.double()
                token = int(
                    race_sample(rest[None], seeds, position, STREAM_RESIDUAL, STREAM_RESIDUAL_TAIL)[0]
                )
        out_tokens.append(token)
        if nxt is None:
            break
        path.append(nxt)
        node, depth = nxt, depth + 1
    rows = torch.tensor([-1, *path]) + 1
    emitted = torch.tensor(out_tokens, dtype=torch.int64)
    logprobs = target_probs[rows, emitted].float().log()
    return TreeVerification(accepted=torch.tensor(path, dtype=torch.int64), tokens=emitted, logprobs=logprobs)
