"""Lossless verification of speculative drafts: pure functions, tensors and plain data in, results out.

Two modes (details, and why the noise keeps every round fresh: docs/engine.md, "Verification"):
- "match" (reproducible; greedy rows in any mode): `verify_match` draws the target's token after every
  node exactly as `sampling.sample` would in plain decoding — same logits, same (seed, position) noise —
  and walks each draft while a child carries the drawn token, so the output is token-identical to plain
  decoding whatever the drafter. It draws at the roots first and deeper only under a surviving first
  token: a sampled draft often dies at once, and a draw costs a softmax over the vocabulary.
- "rejection" (speculative sampling, Leviathan et al. / Chen et al.): `verify_chain` accepts draft x with
  probability min(1, q(x)/p(x)), draws from normalise(max(q − p, 0)) at the first rejection and a bonus
  token from the last q after full acceptance; `verify_tree` does recursive rejection over a tree's
  children as point masses (SpecInfer). q and p are the processed distributions (temperature / top-k /
  top-p): what the sampler would use is what is verified. A deterministic drafter is a point mass p.
Every tensor is made on the device of the logits / probabilities it verifies; host reads are the decisions
a walk needs (a handful per call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from slipstream.engine.sampling import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_RESIDUAL_TAIL,
    STREAM_SAMPLE,
    STREAM_TAIL,
    SamplingParams,
    keyed_uniform,
    params_tensors,
    race_sample,
    sample,
)

__all__ = [
    "EMPTY",
    "PAD_TOKEN",
    "ChainVerification",
    "Proposal",
    "TreeVerification",
    "Verified",
    "VerifyEntry",
    "verify_chain",
    "verify_match",
    "verify_tree",
]

PAD_TOKEN = -1
"""Fills `ChainVerification.tokens` past `num_emitted`."""


@dataclass(slots=True)
class Proposal:
    """One sequence's draft as Python lists (the verify pass and the tree walk read them per node)."""

    tokens: list[int]
    """[n] draft tokens; draft node i is node i + 1 of the verify pass (node 0 is the pending token)."""
    parents: list[int] | None
    """[n] parent draft node (-1 = the root) in topological order, or None for a chain."""
    draft_probs: Tensor | None = None
    """[n, V] the distribution each token was drawn from, or None (point masses)."""

    @property
    def size(self) -> int:
        return len(self.tokens)

    def pass_parents(self) -> list[int]:
        """[n + 1] parents in verify-pass numbering: the root first."""
        parents = self.parents if self.parents is not None else range(-1, self.size - 1)
        return [-1, *(p + 1 for p in parents)]

    def root_tokens(self) -> list[int]:
        """Tokens of the root's children."""
        if self.parents is None:
            return self.tokens[:1]
        return [t for t, p in zip(self.tokens, self.parents, strict=True) if p < 0]

    def depths(self) -> list[int]:
        """[n + 1] depth of each verify-pass node (the root 0)."""
        if self.parents is None:
            return list(range(self.size + 1))
        depths = [0]
        for p in self.parents:
            depths.append(depths[p + 1] + 1)
        return depths

    def prefix(self, n: int) -> Proposal:
        """The first n nodes (a prefix of a topological order is a tree); a chain drops its parents."""
        parents = None if self.parents is None else self.parents[:n]
        if parents is not None and parents == list(range(-1, len(parents) - 1)):
            parents = None
        probs = self.draft_probs
        if n >= self.size:
            return Proposal(self.tokens, parents, probs)
        return Proposal(self.tokens[:n], parents, None if probs is None else probs[:n])


EMPTY = Proposal([], None)


@dataclass(slots=True)
class VerifyEntry:
    """One sequence's share of a verify pass."""

    row: int
    """Logit row of the root; the draft's nodes follow it."""
    proposal: Proposal
    params: SamplingParams
    position: int
    """Position (index in prompt + response) of the token after the root."""


@dataclass(slots=True)
class Verified:
    """What verification emits for one sequence (before max_tokens / stop truncation)."""

    tokens: list[int]
    """Accepted draft tokens, then the correction or bonus token."""
    logprobs: list[float]
    """Log-prob of each token under the target's processed distribution (0 for greedy)."""
    nodes: list[int]
    """Verify-pass node that sampled each token: the root (0), then the accepted draft nodes. The KV cache
    keeps exactly these nodes (the last emitted token becomes the new pending one)."""


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


# ---------------------------------------------------------------------------------------------------------
# "match": the target's own draw, walked down every draft


def verify_match(logits: Tensor, entries: Sequence[VerifyEntry]) -> list[Verified]:
    """Verify every entry's draft (chain or tree) against logits [rows, V] of one verify pass: the token
    after each node is `sample`'s draw there with the entry's params at (seed, position + depth), and the
    draft is walked while a child carries it (the first of equal siblings). Token-identical to plain
    decoding; see the module docstring for the order of the draws."""
    drawn: dict[int, tuple[int, float]] = {}  # logit row -> (token, log-prob)
    greedy_rows = [r for e in entries if e.params.greedy for r in range(e.row, e.row + e.proposal.size + 1)]
    if greedy_rows:
        # All-greedy rows: `sample` takes the argmax plain decoding takes, and builds no distribution.
        _draw(logits, [(row, 0, _GREEDY) for row in greedy_rows], drawn)
    sampled = [e for e in entries if not e.params.greedy]
    if sampled:
        _draw(logits, [(e.row, e.position, e.params) for e in sampled], drawn)
        deeper = [
            (e.row + j, e.position + depth, e.params)
            for e in sampled
            if drawn[e.row][0] in e.proposal.root_tokens()
            for j, depth in enumerate(e.proposal.depths()[1:], 1)
        ]
        _draw(logits, deeper, drawn)

    results = []
    for entry in entries:
        proposal, row = entry.proposal, entry.row
        nodes = [0]
        if proposal.parents is None:
            for j, token in enumerate(proposal.tokens):
                if token != drawn[row + j][0]:
                    break
                nodes.append(j + 1)
        else:
            child: dict[tuple[int, int], int] = {}
            for j, (parent, token) in enumerate(
                zip(proposal.pass_parents()[1:], proposal.tokens, strict=True)
            ):
                child.setdefault((parent, token), j + 1)  # the first of equal siblings
            node = child.get((0, drawn[row][0]))
            while node is not None:
                nodes.append(node)
                node = child.get((node, drawn[row + node][0]))
        picks = [drawn[row + node] for node in nodes]
        results.append(Verified([t for t, _ in picks], [lp for _, lp in picks], nodes))
    return results


_GREEDY = SamplingParams(temperature=0.0)


def _draw(
    logits: Tensor, rows: Sequence[tuple[int, int, SamplingParams]], drawn: dict[int, tuple[int, float]]
) -> None:
    """`sample` at (logit row, position, params) triples into `drawn`: plain decoding's draw there."""
    if not rows:
        return
    device = logits.device
    temperature, top_p, top_k, seeds = params_tensors([params for _, _, params in rows], device)
    positions = torch.tensor([position for _, position, _ in rows], dtype=torch.int64, device=device)
    index = [row for row, _, _ in rows]
    selected = logits if index == list(range(logits.shape[0])) else logits[_index(index, device)]
    tokens, logprobs = sample(selected, temperature, top_p, top_k, seeds, positions)
    drawn.update(zip(index, zip(tokens.tolist(), logprobs.tolist(), strict=True), strict=True))


def _index(rows: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------------------------------------
# "rejection": speculative sampling


def _accepts(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    """Accept with probability min(1, q(x)/p(x)): u < q/p without the division (p may be 0)."""
    return u * p_x.double() < q_x.double()


def _residual(q: Tensor, p: Tensor | None, draft: Tensor) -> Tensor:
    """Where to draw after a rejection: max(q − p, 0), unnormalised (the race normalises) [r, V].

    q is a fresh copy the caller owns. p None is the point mass on `draft` [r]: the residual is q
    without the draft token.
    """
    if p is None:
        q[torch.arange(q.shape[0], device=q.device), draft] = 0.0
        return q
    return q.sub_(p).clamp_min_(0.0)


def _without(q: Tensor, token: int) -> Tensor:
    """q with a rejected point-mass draft removed (the residual of a point mass)."""
    q = q.clone()
    q[token] = 0.0
    return q


def _lengths(draft_tokens: Tensor, draft_lengths: Tensor | None) -> Tensor:
    b, k = draft_tokens.shape
    if draft_lengths is None:
        return torch.full((b,), k, dtype=torch.int64, device=draft_tokens.device)
    if draft_lengths.shape != (b,) or bool(((draft_lengths < 0) | (draft_lengths > k)).any()):
        raise ValueError(f"draft_lengths must be [B] in [0, k={k}], got {draft_lengths.tolist()}")
    return draft_lengths.long()


def _final_tokens(
    draft_probs: Tensor | None,
    target_probs: Tensor,
    drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
    accept_length: Tensor,
    lengths: Tensor,
) -> Tensor:
    """[B] the token each row emits after its accepted drafts: a residual draw where a draft was rejected,
    the bonus draw from the last q where all were accepted."""
    b = drafts.shape[0]
    device = target_probs.device
    final = torch.empty(b, dtype=torch.int64, device=device)
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
    return final


def verify_chain(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    seeds: Tensor,
    positions: Tensor,
    draft_lengths: Tensor | None = None,
) -> ChainVerification:
    """Rejection-verify drafted chains; every row emits accept_length + 1 tokens with the law of plain
    decoding.

    draft_tokens [B, k] int64; draft_probs [B, k, V] (p of the distribution each draft token was drawn
    from) or None for a deterministic drafter; target_probs [B, k+1, V] (q after each prefix); seeds [B];
    positions [B]: the position of the first draft token. draft_lengths [B] (default k): row b's drafts
    beyond draft_lengths[b] are padding, and its bonus comes from target_probs[b, draft_lengths[b]]. All
    on target_probs' device. Cost: one race per row.
    """
    b, k = draft_tokens.shape
    v = target_probs.shape[-1]
    if target_probs.shape != (b, k + 1, v):
        raise ValueError(f"target_probs must be [B={b}, k+1={k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (b, k, v):
        raise ValueError(f"draft_probs must be [B={b}, k={k}, V={v}], got {tuple(draft_probs.shape)}")
    device = target_probs.device
    lengths = _lengths(draft_tokens, draft_lengths)  # [B]
    seeds, positions = seeds.long(), positions.long()
    rows = torch.arange(b, device=device)
    cols = torch.arange(k + 1, device=device)
    drafts = draft_tokens.long().clamp(0, v - 1)  # padding may hold anything
    valid = cols[None, :k] < lengths[:, None]  # [B, k]

    q_x = target_probs[:, :k].gather(2, drafts[..., None])[..., 0]  # [B, k]
    p_x = torch.ones_like(q_x) if draft_probs is None else draft_probs.gather(2, drafts[..., None])[..., 0]
    flat_seeds = seeds.repeat_interleave(k)
    flat_pos = (positions[:, None] + cols[None, :k]).reshape(-1)
    u = keyed_uniform(flat_seeds, flat_pos, STREAM_ACCEPT, 1).view(b, k)  # [B, k]
    accept = _accepts(u, p_x, q_x) & valid
    accept_length = accept.long().cumprod(1).sum(1)  # [B]
    final = _final_tokens(draft_probs, target_probs, drafts, seeds, positions, accept_length, lengths)
    emitted = torch.where(cols[None, :k] < accept_length[:, None], drafts, PAD_TOKEN)
    emitted = torch.cat([emitted, emitted.new_full((b, 1), PAD_TOKEN)], 1)
    emitted[rows, accept_length] = final

    n_emitted = accept_length + 1
    mask = cols[None, :] < n_emitted[:, None]  # [B, k+1]
    chosen = target_probs.gather(2, emitted.clamp_min(0)[..., None])[..., 0]  # [B, k+1]
    logprobs = torch.where(mask, chosen.float().log(), 0.0)
    return ChainVerification(
        accept_length=accept_length, tokens=emitted, num_emitted=n_emitted, logprobs=logprobs
    )


def _children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Children of every node (-1 = root), in index order."""
    out: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        out.setdefault(int(parent), []).append(node)
    return out


def verify_tree(
    tokens: Sequence[int] | Tensor,
    parents: Sequence[int] | Tensor,
    target_probs: Tensor,
    seed: int,
    base_position: int,
) -> TreeVerification:
    """Rejection-verify one request's draft tree: recursive rejection sampling over the children as point
    masses (SpecInfer) — try each child c with probability q(c), remove it from q on rejection, and draw
    from what is left; the law of plain decoding, from noise independent of the draft.

    tokens [n], parents [n] (-1 = child of the root, parents[i] < i not required): lists, or tensors read
    once; target_probs [n+1, V]: row 0 is q at the root, row i+1 is q after node i. base_position is the
    position of the root's children. Results are on target_probs' device.
    """
    token_of = tokens.tolist() if isinstance(tokens, Tensor) else [int(t) for t in tokens]
    parent_of = parents.tolist() if isinstance(parents, Tensor) else [int(p) for p in parents]
    n = len(token_of)
    if len(parent_of) != n or target_probs.shape[0] != n + 1:
        raise ValueError(
            f"tree of {n} tokens needs parents [{n}] and target_probs [{n + 1}, V], "
            f"got {len(parent_of)} parents and {tuple(target_probs.shape)}"
        )
    device = target_probs.device
    children = _children(parent_of)
    seeds = torch.tensor([seed], dtype=torch.int64, device=device)
    node, depth = -1, 0
    path: list[int] = []
    out_tokens: list[int] = []
    while True:
        q = target_probs[node + 1]  # [V]
        position = torch.tensor([base_position + depth], dtype=torch.int64, device=device)
        kids = children.get(node, [])
        nxt = None
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
            token = int(race_sample(rest[None], seeds, position, STREAM_RESIDUAL, STREAM_RESIDUAL_TAIL)[0])
        out_tokens.append(token)
        if nxt is None:
            break
        path.append(nxt)
        node, depth = nxt, depth + 1
    rows = torch.tensor([0, *(a + 1 for a in path)], dtype=torch.int64, device=device)
    emitted = torch.tensor(out_tokens, dtype=torch.int64, device=device)
    logprobs = target_probs[rows, emitted].float().log()
    return TreeVerification(
        accepted=torch.tensor(path, dtype=torch.int64, device=device), tokens=emitted, logprobs=logprobs
    )
