"""Fixed-shape, device-side speculative verification: `verify_match`, `verify_chain`, `verify_tree` and
`speculator.verify_drafts`' routing for a whole verify pass, with no host reads and no data-dependent
shapes (the GPU engine replays it as a CUDA graph). On the CPU in fp32 the tokens and log-probs are
bitwise those of today's functions (tests/engine/test_verify_static.py).

Layout: B rows of N = 1 + n nodes. Node 0 is the pending root; nodes 1..n are the draft in topological
order, padded (padding: parent -1, valid False). parents [B, N] are in verify-pass numbering
(parents[:, 0] = -1), depths [B, N] (root 0), positions [B] = position of the token after the root.

Non-obvious choices:
- Match mode draws the target's token at every node eagerly: a draw is a pure function of (logits,
  seed, position), so the nodes today's lazy `verify_match` never draws change nothing.
- Walks are static loops (max_depth levels, x max_children siblings for rejection trees); a finished row
  keeps stepping with its state frozen by `torch.where`. `path` past accept_length repeats the last
  accepted node, so path[:, -1] is every row's final node.
- A rejection tree row stops at exactly one level, so its residual and position are kept with `where` and
  ONE residual race runs after the walk instead of one per level.
- `rest.sum()` is recomputed after every rejected sibling rather than updated by subtraction: the accept
  test u * sum < rest[token] then compares the same doubles as `verify_tree`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slipstream.engine.sample_static import _race, logprobs_of, processed_probs_static
from slipstream.engine.sampling import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_RESIDUAL_TAIL,
    STREAM_SAMPLE,
    STREAM_TAIL,
    _row_keys,
    _uniform_at,
)
from slipstream.engine.verify import PAD_TOKEN

__all__ = [
    "draw_static",
    "emitted",
    "match_walk",
    "rejection_chain_static",
    "rejection_tree_static",
    "verify_static",
]


def _per_node(x: Tensor, n: int) -> Tensor:
    """A per-row tensor [B] repeated for each of the row's n nodes: [B * n]."""
    return x[:, None].expand(-1, n).reshape(-1)


def _row_at(x: Tensor, at: Tensor) -> Tensor:
    """x[b, at[b]] [B, V] of x [B, M, V]."""
    return x.gather(1, at[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]


def _draws(probs: Tensor, seeds: Tensor, positions: Tensor, depths: Tensor) -> tuple[Tensor, Tensor]:
    """`sample`'s draw (tokens, logprobs) [B, N] at every node of processed probs [B, N, V]."""
    b, n, v = probs.shape
    flat = probs.reshape(b * n, v)
    node_positions = (positions.long()[:, None] + depths.long()).reshape(-1)  # [B * N]
    keys_seeds = _per_node(seeds.long(), n)
    tokens = _race(
        flat,
        _row_keys(keys_seeds, node_positions, STREAM_SAMPLE),
        _row_keys(keys_seeds, node_positions, STREAM_TAIL),
    )
    return tokens.view(b, n), logprobs_of(flat, tokens).view(b, n)


def _node_probs(
    logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, *, filtered: bool
) -> Tensor:
    """Processed target probabilities [B, N, V] at every node, with the row's params."""
    b, n, v = logits.shape
    per_node = [_per_node(x, n) for x in (temperature, top_p, top_k)]
    return processed_probs_static(logits.reshape(b * n, v), *per_node, filtered=filtered).view(b, n, v)


def draw_static(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seeds: Tensor,
    positions: Tensor,
    depths: Tensor,
    *,
    filtered: bool,
) -> tuple[Tensor, Tensor]:
    """The target's own draw at every node: (drawn int64 [B, N], logprobs float32 [B, N]), exactly
    `sampling.sample` at (seed, positions + depth) with the row's params (what `verify_match` draws).

    logits [B, N, V]; temperature, top_p, top_k, seeds, positions [B]; depths [B, N]."""
    probs = _node_probs(logits, temperature, top_p, top_k, filtered=filtered)
    return _draws(probs, seeds, positions, depths)


def match_walk(
    tokens: Tensor, parents: Tensor, valid: Tensor, drawn: Tensor, max_depth: int
) -> tuple[Tensor, Tensor]:
    """`verify_match`'s walk for chains and trees: from the root, step to the child carrying the token
    drawn at the current node (the first, lowest-index, of equal siblings).

    Returns path int64 [B, max_depth + 1] (path[:, 0] = 0; path[:, i] = the i-th accepted node; entries
    past accept_length repeat the last accepted node) and accept_length int64 [B]. max_depth must be at
    least every valid node's depth (deeper nodes are never reached)."""
    b, n = tokens.shape
    index = torch.arange(n, device=tokens.device)  # [N]
    cur = torch.zeros(b, dtype=torch.int64, device=tokens.device)  # [B]: current node
    alive = torch.ones(b, dtype=torch.bool, device=tokens.device)
    accept_length = torch.zeros(b, dtype=torch.int64, device=tokens.device)
    path = [cur]
    for _ in range(max_depth):
        want = drawn.gather(1, cur[:, None])  # [B, 1]
        carries = valid & (parents == cur[:, None]) & (tokens == want)  # [B, N]
        child = torch.where(carries, index, n).amin(-1)  # [B]; n = no such child
        alive = alive & (child < n)
        cur = torch.where(alive, child, cur)
        accept_length = accept_length + alive
        path.append(cur)
    return torch.stack(path, 1), accept_length


def emitted(
    path: Tensor, accept_length: Tensor, drawn: Tensor, drawn_logprobs: Tensor
) -> tuple[Tensor, Tensor]:
    """Tokens and log-probs drawn at the path's nodes (`Verified.tokens` / `.logprobs` of a match row):
    int64 and float32 [B, D + 1], PAD_TOKEN and 0.0 past accept_length."""
    cols = torch.arange(path.shape[1], device=path.device)
    keep = cols[None, :] <= accept_length[:, None]  # [B, D + 1]
    tokens = torch.where(keep, drawn.gather(1, path), PAD_TOKEN)
    logprobs = torch.where(keep, drawn_logprobs.gather(1, path), 0.0)
    return tokens, logprobs


def rejection_chain_static(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    seeds: Tensor,
    positions: Tensor,
    lengths: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """`verify.verify_chain` with fixed shapes: (accept_length int64 [B], tokens int64 [B, k+1] with
    PAD_TOKEN after the emitted ones, logprobs float32 [B, k+1] with 0.0 after).

    draft_tokens [B, k]; draft_probs [B, k, V] or None (point masses); target_probs [B, k+1, V] (row j is
    q after j drafts; rows past a row's length are never read for its result); seeds, positions (of the
    first draft token), lengths [B] in [0, k] (not checked: the host builds them). The residual and the
    bonus draw share one race: each row picks its distribution and its noise streams with `where`."""
    b, k = draft_tokens.shape
    v = target_probs.shape[-1]
    device = target_probs.device
    seeds, positions, lengths = seeds.long(), positions.long(), lengths.long()
    cols = torch.arange(k + 1, device=device)
    drafts = draft_tokens.long().clamp(0, v - 1)  # [B, k]; padding may hold anything
    valid = cols[None, :k] < lengths[:, None]  # [B, k]

    q_x = target_probs[:, :k].gather(2, drafts[..., None])[..., 0]  # [B, k]
    p_x = torch.ones_like(q_x) if draft_probs is None else draft_probs.gather(2, drafts[..., None])[..., 0]
    accept_keys = _row_keys(seeds[:, None], positions[:, None] + cols[None, :k], STREAM_ACCEPT)  # [B, k]
    u = _uniform_at(accept_keys, torch.zeros((), dtype=torch.int64, device=device))  # [B, k]
    accept = (u * p_x.double() < q_x.double()) & valid
    accept_length = accept.long().cumprod(1).sum(1)  # [B]
    rejected = accept_length < lengths  # [B]

    q_at = _row_at(target_probs, accept_length)  # [B, V]: q where the row stops
    dist = q_at
    if k > 0:
        at = accept_length.clamp_max(k - 1)  # a rejected row has accept_length < k
        if draft_probs is None:
            residual = q_at.scatter(1, drafts.gather(1, at[:, None]), 0.0)
        else:
            residual = q_at.clone().sub_(_row_at(draft_probs, at)).clamp_min_(0.0)
        # p >= q everywhere means p == q, where rejection has probability 0 (up to rounding): fall back.
        residual = torch.where((residual.sum(-1) <= 0)[:, None], q_at, residual)
        dist = torch.where(rejected[:, None], residual, q_at)
    pos = positions + accept_length
    keys = torch.where(rejected, _row_keys(seeds, pos, STREAM_RESIDUAL), _row_keys(seeds, pos, STREAM_SAMPLE))
    tail_keys = torch.where(
        rejected, _row_keys(seeds, pos, STREAM_RESIDUAL_TAIL), _row_keys(seeds, pos, STREAM_TAIL)
    )
    final = _race(dist, keys, tail_keys)  # [B]

    out = torch.where(cols[None, :k] < accept_length[:, None], drafts, PAD_TOKEN)
    out = torch.cat([out, out.new_full((b, 1), PAD_TOKEN)], 1)  # [B, k+1]
    out = torch.where(cols[None, :] == accept_length[:, None], final[:, None], out)
    chosen = target_probs.gather(2, out.clamp(0, v - 1)[..., None])[..., 0]  # [B, k+1]
    logprobs = torch.where(cols[None, :] <= accept_length[:, None], chosen.float().log(), 0.0)
    return accept_length, out, logprobs


def _rejection_walk(
    node_tokens: Tensor,
    parents: Tensor,
    valid: Tensor,
    target_probs: Tensor,
    seeds: Tensor,
    positions: Tensor,
    max_depth: int,
    max_children: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`rejection_tree_static`'s walk down the tree, level by level: (path [B, max_depth + 1],
    accept_length [B], the final node [B], the residual float64 [B, V] left where each row stopped: q at
    its final node without the children rejected there). node_tokens [B, N + 1]: clamped, column N for
    "no child"; seeds, positions int64."""
    b, n = parents.shape
    v = target_probs.shape[-1]
    device = target_probs.device
    index = torch.arange(n, device=device)  # [N]
    width = min(max_children, n)
    sibling = torch.arange(width, device=device)  # [C]

    cur = torch.zeros(b, dtype=torch.int64, device=device)  # [B]: current node
    alive = torch.ones(b, dtype=torch.bool, device=device)
    accept_length = torch.zeros(b, dtype=torch.int64, device=device)
    stop_rest = torch.zeros(b, v, dtype=torch.float64, device=device)  # the residual where a row stops
    path = [cur]
    for level in range(max_depth + 1):
        rest = _row_at(target_probs, cur).to(torch.float64, copy=True)  # [B, V]: q, minus rejected kids
        chosen = torch.full((b,), n, dtype=torch.int64, device=device)  # [B]; n = none accepted
        if level < max_depth and width > 0:
            is_child = valid & (parents == cur[:, None])  # [B, N]
            kids = torch.where(is_child, index, n).sort(-1).values[:, :width]  # [B, C], index order
            u = _uniform_at(_row_keys(seeds, positions + level, STREAM_ACCEPT)[:, None], sibling)  # [B, C]
            searching = alive
            for j in range(width):
                child = kids[:, j]  # [B]
                token = node_tokens.gather(1, child[:, None])  # [B, 1]
                mass = rest.gather(1, token)[:, 0]  # [B]
                trying = searching & (child < n)
                # Accept child j with probability rest(token) / sum(rest): q renormalised without the
                # children already rejected.
                accept = trying & (u[:, j] * rest.sum(-1) < mass)
                rest.scatter_(1, token, torch.where(trying & ~accept, 0.0, mass)[:, None])
                chosen = torch.where(accept, child, chosen)
                searching = searching & ~accept
        moved = alive & (chosen < n)
        stop_rest = torch.where((alive & ~moved)[:, None], rest, stop_rest)
        if level < max_depth:
            cur = torch.where(moved, chosen, cur)
            accept_length = accept_length + moved
            path.append(cur)
        alive = moved
    return torch.stack(path, 1), accept_length, cur, stop_rest


def rejection_tree_static(
    tokens: Tensor,
    parents: Tensor,
    valid: Tensor,
    target_probs: Tensor,
    seeds: Tensor,
    positions: Tensor,
    max_depth: int,
    max_children: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`verify.verify_tree` for every row with fixed shapes: recursive rejection over each node's children
    in index order as point masses, then a residual draw. Returns (path [B, max_depth + 1] as in
    `match_walk`, accept_length [B], tokens int64 [B, max_depth + 1] with PAD_TOKEN after, logprobs
    float32 [B, max_depth + 1] with 0.0 after).

    tokens, parents, valid [B, N] in verify-pass numbering; target_probs [B, N, V] (row j = q after node
    j); seeds, positions (of the root's children) [B]. max_depth / max_children must bound every row's
    depth and children per node (children beyond max_children are never tried)."""
    b = tokens.shape[0]
    v = target_probs.shape[-1]
    device = target_probs.device
    seeds, positions = seeds.long(), positions.long()
    # Node tokens, clamped (padding may hold anything), with a column n for "no child".
    node_tokens = torch.cat([tokens.long().clamp(0, v - 1), tokens.new_zeros(b, 1, dtype=torch.int64)], 1)
    path_t, accept_length, cur, stop_rest = _rejection_walk(
        node_tokens, parents, valid, target_probs, seeds, positions, max_depth, max_children
    )
    # Every token with mass was a rejected child: rounding; draw from q.
    q_final = _row_at(target_probs, cur).double()
    stop_rest = torch.where((stop_rest.sum(-1) <= 0)[:, None], q_final, stop_rest)
    pos = positions + accept_length
    final = _race(
        stop_rest, _row_keys(seeds, pos, STREAM_RESIDUAL), _row_keys(seeds, pos, STREAM_RESIDUAL_TAIL)
    )

    cols = torch.arange(max_depth + 1, device=device)[None, :]
    accepted_tokens = node_tokens.gather(1, torch.cat([path_t[:, 1:], path_t[:, :1]], 1))  # [B, D + 1]
    a = accept_length[:, None]
    out = torch.where(cols < a, accepted_tokens, torch.where(cols == a, final[:, None], PAD_TOKEN))
    rows = torch.arange(b, device=device)[:, None]
    chosen_probs = target_probs[rows, path_t, out.clamp(0, v - 1)]  # [B, D + 1]
    logprobs = torch.where(cols <= a, chosen_probs.float().log(), 0.0)
    return path_t, accept_length, out, logprobs


def _select(rows: Tensor, new: tuple[Tensor, ...], old: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Per row [B], `new` where rows else `old` (tensors [B] or [B, w])."""
    return tuple(
        torch.where(rows.view(-1, *[1] * (n.dim() - 1)), n, o) for n, o in zip(new, old, strict=True)
    )


def _fit(x: Tensor, width: int, fill: float) -> Tensor:
    """x [B, w] cut or padded with `fill` to [B, width] (a static shape change)."""
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.cat([x, x.new_full((x.shape[0], width - x.shape[1]), fill)], 1)


def verify_static(
    logits: Tensor,
    tokens: Tensor,
    parents: Tensor,
    valid: Tensor,
    depths: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seeds: Tensor,
    positions: Tensor,
    rejection: Tensor,
    chain: Tensor,
    draft_probs: Tensor | None = None,
    *,
    max_depth: int,
    max_children: int,
    filtered: bool,
    with_match: bool = True,
    with_chain: bool = True,
    with_tree: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`speculator.verify_drafts` for a verify pass: (path [B, D+1], accept_length [B], tokens int64
    [B, D+1], logprobs float32 [B, D+1]) for every row, D = max_depth; padding as in `match_walk` and
    `rejection_tree_static`.

    rejection [B] bool: the row is verified by speculative sampling (host: mode "rejection", a non-empty
    draft, not greedy); other rows by `verify_match`. chain [B] bool: a rejection row's draft is a chain
    (`Proposal.parents is None`: `verify_chain`'s law), else a tree (`verify_tree`'s). draft_probs
    [B, N-1, V] or None: chain rows' draft distributions (point masses where None). The host, which knows
    the rows, may skip a branch no row takes (with_match / with_chain / with_tree False). Every row's
    depth must be <= max_depth (a chain's length too)."""
    b = logits.shape[0]
    width = max_depth + 1
    device = logits.device
    probs = _node_probs(logits, temperature, top_p, top_k, filtered=filtered)  # [B, N, V]
    result = (
        torch.zeros(b, width, dtype=torch.int64, device=device),  # path
        torch.zeros(b, dtype=torch.int64, device=device),  # accept_length
        torch.full((b, width), PAD_TOKEN, dtype=torch.int64, device=device),  # tokens
        torch.zeros(b, width, dtype=torch.float32, device=device),  # logprobs
    )
    if with_match:
        drawn, drawn_logprobs = _draws(probs, seeds, positions, depths)
        path, accept_length = match_walk(tokens, parents, valid, drawn, max_depth)
        match = (path, accept_length, *emitted(path, accept_length, drawn, drawn_logprobs))
        result = _select(~rejection, match, result)
    if with_chain:
        lengths = valid[:, 1:].sum(-1)  # [B]; a chain's valid nodes are a prefix
        accept_length, chain_tokens, chain_logprobs = rejection_chain_static(
            tokens[:, 1:], draft_probs, probs, seeds, positions, lengths
        )
        path = torch.minimum(torch.arange(width, device=device)[None, :], accept_length[:, None])
        chain_result = (
            path, accept_length, _fit(chain_tokens, width, PAD_TOKEN), _fit(chain_logprobs, width, 0.0)
        )  # fmt: skip
        result = _select(rejection & chain, chain_result, result)
    if with_tree:
        tree = rejection_tree_static(tokens, parents, valid, probs, seeds, positions, max_depth, max_children)
        result = _select(rejection & ~chain, tree, result)
    return result
