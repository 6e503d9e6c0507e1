"""Fixed-shape, device-side sampling: what `sampling.sample` computes, with no host reads.

The GPU engine replays each step as a CUDA graph, so nothing here reads the device back (no `.item()`,
`nonzero`, boolean-mask indexing) and no shape depends on data. Each function computes its result for
every row and selects per row with `torch.where` where `sampling` gathers a subset with `nonzero`. On the
CPU in fp32 the tokens and log-probs are bitwise those of `processed_probs` / `race_sample` / `sample`:
the same float operations run on the same values in the same order (tests/engine/test_sample_static.py).
(Where today's functions are batch-invariant: a multi-threaded CPU splits a one-row sum over >= 32768
entries across threads, so their one-row subsets there can differ in the last bit from a batch.)

Non-obvious choices:
- Top-k / top-p: one full descending sort per row replaces the escalating partial sorts of `_cutoffs`.
  The keep rule is the same, and the cumsum of a sorted prefix does not depend on the sort's width, so
  the cut-off is the same value. The host says whether any row filters (`filtered`), never the device.
- Head race: a row of mass at most 1 holds at most 1 / HEAD_MIN_PROB = 1024 head tokens, all of them
  among its 1024 largest entries, so one `topk` finds them and only those are hashed: the vocabulary is
  never hashed (that would be ~20 int64 passes over [rows, V]). Arrivals, the tie rule (lowest id among
  minimal arrivals) and the tail's inverse CDF are `race_sample`'s, computed for all rows.
- Tail block masses reduce the same 64 values in the same [.., 64] layout as `race_sample`, so the float
  sums, hence the tail's arrival and pick, are bitwise equal.
- Greedy rows are the one-hot of the argmax; the race returns its index with log-prob log(1) = 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slipstream.engine.sampling import (
    BLOCK,
    HEAD_MIN_PROB,
    STREAM_SAMPLE,
    STREAM_TAIL,
    _blocks,
    _row_keys,
    _uniform_at,
)

__all__ = ["HEAD_SLOTS", "logprobs_of", "processed_probs_static", "race_sample_static", "sample_static"]

HEAD_SLOTS = round(1 / HEAD_MIN_PROB)
"""Most head tokens (p >= HEAD_MIN_PROB) a row of mass <= 1 can hold: the head race's candidate width."""


def processed_probs_static(
    logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, *, filtered: bool
) -> Tensor:
    """`sampling.processed_probs` with fixed shapes: float32 [R, V] after temperature, top-k, top-p.

    filtered: chosen by the host from the request params. False promises that no row has top_p < 1 or
    0 < top_k < V (the cut-off work is skipped: a broken promise returns unfiltered rows); True computes
    every row's exact cut-off and applies it where the row asks for it. Greedy rows (T <= 0) are the
    one-hot of the argmax (first maximal index).
    """
    logits = logits.float()
    greedy = temperature <= 0  # [R]
    # Multiplying by 1.0 is exact, so scaling every row equals `processed_probs` skipping T == 1 rows.
    scale = torch.where(greedy, 1.0, temperature.float()).reciprocal()  # [R]
    probs = torch.softmax(logits * scale[:, None], dim=-1)  # [R, V]
    if filtered:
        probs = _filter(probs, top_p, top_k, ~greedy)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _filter(probs: Tensor, top_p: Tensor, top_k: Tensor, sampled: Tensor) -> Tensor:
    """Top-k then top-p (on the renormalised top-k set) for the rows that ask, ties with the boundary kept.

    `_cutoffs`' rule on a full sort: its partial sorts see a prefix of these values, and the float cumsum
    accumulates sequentially, so `csum`, `before` and the cut-off value are the same numbers."""
    vocab = probs.shape[-1]
    k_keep = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()  # [R]; vocab = no top-k
    nucleus = top_p < 1  # [R]
    asks = sampled & (nucleus | (k_keep < vocab))  # [R]
    vals = probs.sort(-1, descending=True).values  # [R, V]
    csum = vals.cumsum(-1)  # [R, V]
    top_k_mass = csum.gather(1, (k_keep - 1)[:, None])[:, 0]
    k_mass = torch.where(k_keep >= vocab, probs.sum(-1), top_k_mass)  # [R]
    # Keep entry j while the mass strictly before it is below top_p of the (top-k) mass; `before` grows
    # with j (monotone rounding), so `keep` is a prefix and its length is the cut-off's rank.
    before = csum - vals
    col = torch.arange(vocab, device=probs.device)
    nucleus_ok = before < (top_p.float() * k_mass)[:, None]
    keep = (col < k_keep[:, None]) & (~nucleus[:, None] | nucleus_ok)  # [R, V]
    n_keep = keep.sum(-1).clamp_min(1)  # [R]
    cut = vals.gather(1, (n_keep - 1)[:, None])  # [R, 1]
    kept = probs.masked_fill(probs < cut, 0.0)
    kept.mul_(kept.sum(-1, keepdim=True).reciprocal_())
    return torch.where(asks[:, None], kept, probs)


def _tail_mass(blocks: Tensor) -> Tensor:
    """Tail mass per block [R, nb] of blocks [R, nb, BLOCK]: head entries zeroed, then the 64 summed.

    `race_sample` sums head-free blocks with `blocks.sum(-1)` and head blocks as a gathered [m, 64] copy
    with head entries zeroed; both are the same 64-value contiguous reduction as this one (a head-free
    block is unchanged by the fill), so the masses are bitwise equal."""
    return blocks.masked_fill(blocks >= HEAD_MIN_PROB, 0.0).sum(-1)


def _race(probs: Tensor, keys: Tensor, tail_keys: Tensor) -> Tensor:
    """`race_sample` over rows [R, V] given each row's head-noise key [R] and tail-noise key [R] (so one
    race can serve rows drawing from different streams). An all-zero row yields V.

    Requires each row's mass < 1 + HEAD_MIN_PROB (true of probabilities, residuals and `rest`): then
    every head token is among the row's HEAD_SLOTS largest entries."""
    vocab = probs.shape[-1]
    inf = float("inf")

    # Head: an exponential race E_i / p_i among head tokens, noise keyed by token id.
    cand, ids = probs.topk(min(vocab, HEAD_SLOTS), dim=-1, sorted=False)  # [R, w]
    head = cand >= HEAD_MIN_PROB  # [R, w]
    arrival = torch.where(head, -torch.log(_uniform_at(keys[:, None], ids)) / cand.double(), inf)
    best = arrival.amin(-1)  # [R]; inf without head tokens
    # Lowest id among the minimal arrivals, as `race_sample`'s scatter_reduce(amin).
    winner = torch.where(head & (arrival == best[:, None]), ids, vocab).amin(-1)  # [R]

    # Tail: one arrival for the whole tail, then an inverse-CDF pick, computed for every row.
    blocks = _blocks(probs, 0.0)  # [R, nb, BLOCK]
    tail_mass = _tail_mass(blocks)  # [R, nb]
    tail_u = _uniform_at(tail_keys[:, None], torch.arange(2, device=probs.device))  # [R, 2]
    tail_arrival = -torch.log(tail_u[:, 0]) / tail_mass.sum(-1).double()  # [R]
    block_mass = tail_mass.double()  # [R, nb]
    block_cdf = block_mass.cumsum(-1)
    target = tail_u[:, 1:] * block_cdf[:, -1:]  # [R, 1]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_max(block_cdf.shape[1] - 1)  # [R, 1]
    below = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0.0)
    frac = ((target - below) / block_mass.gather(1, block)).clamp(0.0, 1 - 2**-52)  # NaN where no tail
    inner = blocks.gather(1, block[:, :, None].expand(-1, -1, BLOCK))[:, 0].double()  # [R, BLOCK]
    inner_cdf = inner.masked_fill(inner >= HEAD_MIN_PROB, 0.0).cumsum(-1)
    token = torch.searchsorted(inner_cdf, frac * inner_cdf[:, -1:], right=True).clamp_max(BLOCK - 1)
    tail_token = (block * BLOCK + token)[:, 0]  # [R]
    return torch.where(tail_arrival < best, tail_token, winner)


def race_sample_static(
    probs: Tensor,
    seeds: Tensor,
    positions: Tensor,
    stream: int = STREAM_SAMPLE,
    tail_stream: int = STREAM_TAIL,
) -> Tensor:
    """`sampling.race_sample` with fixed shapes: one token per row [R] from rows [R, V] (float32 or
    float64, unnormalised allowed up to mass 1 + HEAD_MIN_PROB); an all-zero row yields V."""
    return _race(probs, _row_keys(seeds, positions, stream), _row_keys(seeds, positions, tail_stream))


def logprobs_of(probs: Tensor, tokens: Tensor) -> Tensor:
    """log p(token) per row [R], float32 like `sample`; a token V (all-zero row) reads entry V - 1."""
    return probs.gather(1, tokens.clamp_max(probs.shape[-1] - 1)[:, None])[:, 0].float().log()


def sample_static(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seeds: Tensor,
    positions: Tensor,
    *,
    filtered: bool,
) -> tuple[Tensor, Tensor]:
    """`sampling.sample` with fixed shapes: (tokens int64 [R], logprobs float32 [R]); greedy rows give
    the argmax and 0.0. `filtered` as in `processed_probs_static`."""
    probs = processed_probs_static(logits, temperature, top_p, top_k, filtered=filtered)  # [R, V]
    tokens = race_sample_static(probs, seeds, positions)
    return tokens, logprobs_of(probs, tokens)
