"""Token sampling: temperature / top-p / top-k, position-keyed randomness, and the per-sample seed.

Every random number here is a pure function of (request seed, position, stream, index), made by a
counter-based hash (splitmix64), not a stateful generator: a request samples the same token at a position
whatever shares its batch, and a drafter and the target can use the *same* noise, which makes "match"
verification token-identical to plain decoding (`verify.py`). `sample_seed` derives each sample's seed
from a run's or group's seed, the same way for `generate` and the rollout. Everything runs on the device of
its inputs (logits, seeds, positions): the noise is hashed there, never made on the host and copied.

Non-obvious choices (costs and details: docs/engine.md, "Sampling"):
- The sampler is an exponential race (equivalently Gumbel-max), P(i) = p_i. Only the head of the
  distribution (p_i >= HEAD_MIN_PROB) races with per-token noise; the tail races as one block and picks
  by inverse CDF when it wins: the same law, a few softmaxes instead of hashing the vocabulary.
- Top-k / top-p find their cut-off by partial sorts of growing width, and keep every token tied with the
  boundary token, so the mask is a function of the distribution, never of a sort order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "GROUP_BITS",
    "HEAD_MIN_PROB",
    "MAX_SAMPLE_INDEX",
    "MAX_SEED",
    "STREAM_ACCEPT",
    "STREAM_RESIDUAL",
    "STREAM_RESIDUAL_TAIL",
    "STREAM_SAMPLE",
    "STREAM_TAIL",
    "SamplingParams",
    "group_seed",
    "keyed_exponential",
    "keyed_pick",
    "keyed_rank",
    "keyed_uniform",
    "params_tensors",
    "processed_probs",
    "race_sample",
    "sample",
    "sample_seed",
]

# Noise streams: independent random sequences at one (seed, position). STREAM_SAMPLE is what plain decoding
# uses; the speculative verifier draws acceptance tests and residual samples from their own streams so that
# they are independent of the draft.
STREAM_SAMPLE = 0
STREAM_TAIL = 1
STREAM_ACCEPT = 2
STREAM_RESIDUAL = 3
STREAM_RESIDUAL_TAIL = 4

# Tokens at or above this probability race with their own keyed noise; the rest race as one block.
HEAD_MIN_PROB = 2.0**-10

# A sample seed is seed * MAX_SAMPLE_INDEX + index (`sample_seed`): 24 index bits leave 39 for the seed,
# inside the int64 keys of the sampler.
MAX_SAMPLE_INDEX = 2**24
"""Samples per seed (a group's samples, or the requests of one `generate` run): indices in [0, 2**24)."""
MAX_SEED = 2**39
"""Seeds of runs and groups are in [0, 2**39)."""
GROUP_BITS = 20
"""A group's seed holds its id in the low 20 bits: runs seeded below 2**19 and ~1M groups a run."""


def group_seed(run_seed: int, group_id: int) -> int:
    """The sampling seed of group `group_id` of a run seeded `run_seed`: `train` and `bench rollout` alike,
    distinct per (run, group), so a requeued or replayed group draws the same tokens."""
    if not (0 <= run_seed < MAX_SEED >> GROUP_BITS and 0 <= group_id < 1 << GROUP_BITS):
        raise ValueError(f"group seed out of range: run seed {run_seed}, group {group_id}")
    return (run_seed << GROUP_BITS) | group_id


# splitmix64 constants as signed int64 (torch has no uint64 arithmetic; int64 multiplication wraps).
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables top-p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables top-k."""
    seed: int = 0
    """Keys all randomness of this request together with the position (int64; `sample_seed` derives one
    per sample from a run's or group's seed)."""
    max_tokens: int = 256
    """Maximum number of generated tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting any of these."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_seed(seed: int, index: int) -> int:
    """The sampling seed of sample `index` under `seed`: seed * 2**24 + index, a non-negative int64.

    The one derivation for every caller: sample i of a rollout group whose request carries `seed`, and
    request i (file order) of `slipstream generate --seed seed`, so the two sample alike. seed: in
    [0, MAX_SEED = 2**39); index: in [0, MAX_SAMPLE_INDEX = 2**24). Distinct pairs give distinct seeds."""
    for name, value, bound, text in (
        ("seed", seed, MAX_SEED, "2**39"),
        ("index", index, MAX_SAMPLE_INDEX, "2**24"),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
            raise ValueError(f"sample {name} must be an integer in [0, {text}), got {value!r}")
    return seed * MAX_SAMPLE_INDEX + index


def params_tensors(
    params: Sequence[SamplingParams], device: torch.device | str | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stack per-request params into (temperature [B], top_p [B], top_k [B], seeds [B]) tensors on `device`
    (the logits' device; None: the CPU)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    seeds = torch.tensor([p.seed for p in params], dtype=torch.int64, device=device)
    return temperature, top_p, top_k, seeds


# ---------------------------------------------------------------------------------------------------------
# Keyed randomness


def _wrap64(x: int) -> int:
    """A Python int as the signed int64 with the same low 64 bits."""
    return (x + 2**63) % 2**64 - 2**63


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: Tensor) -> Tensor:
    """splitmix64 finaliser: a bijection on 64-bit words with full avalanche."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _row_keys(seeds: Tensor, positions: Tensor, stream: int) -> Tensor:
    """One 64-bit key per row from (seed, position, stream); chained so no two inputs collide by sum."""
    k = _mix(seeds.to(torch.int64) * _GOLDEN + 1)
    k = _mix(k + positions.to(torch.int64) * _GOLDEN)
    return _mix(k + _wrap64((stream + 1) * _GOLDEN))


def _uniform_at(keys: Tensor, index: Tensor) -> Tensor:
    """Uniform in (0, 1), float64, for element `index` of the stream keyed by `keys` (broadcast)."""
    z = _mix(keys + (index.to(torch.int64) + 1) * _GOLDEN)
    return (_shr(z, 11).to(torch.float64) + 0.5) * 2.0**-53


def keyed_uniform(seeds: Tensor, positions: Tensor, stream: int, n: int) -> Tensor:
    """Uniforms in (0, 1), float64 [B, n], a pure function of (seed, position, stream, index).

    Independent of batch composition and of n (a prefix of a longer draw is the shorter draw).
    """
    keys = _row_keys(seeds, positions, stream)  # [B]
    return _uniform_at(keys[:, None], torch.arange(n, dtype=torch.int64, device=keys.device)[None, :])


# ---------------------------------------------------------------------------------------------------------
# Blocked views: reductions over [B, V/64, 64] blocks find the few interesting entries of a row without a
# full-vocabulary nonzero, argmax or sort (each of which costs more on a CPU than the softmax itself).

BLOCK = 64


def _blocks(x: Tensor, fill: float) -> Tensor:
    """View rows [B, V] as [B, ceil(V/BLOCK), BLOCK], padding with `fill` only when V is not a multiple."""
    rows, vocab = x.shape
    pad = -vocab % BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.reshape(rows, -1, BLOCK)


def _argmax(x: Tensor) -> Tensor:
    """Row argmax [B] (first maximal index, like torch.argmax), via block maxima."""
    blocks = _blocks(x, float("-inf"))  # [B, nb, BLOCK]
    best_block = blocks.amax(-1).argmax(-1)  # [B]
    inner = blocks[torch.arange(x.shape[0], device=x.device), best_block].argmax(-1)
    return best_block * BLOCK + inner


def _top_values(x: Tensor, width: int) -> Tensor:
    """The `width` largest values of each row, descending [R, width].

    The top-w entries lie in the w blocks with the largest maxima, so only those are searched (exact
    even with ties: the w-th value is found, whichever tied blocks are picked).
    """
    rows, vocab = x.shape
    blocks = _blocks(x, float("-inf"))  # [R, nb, BLOCK]
    nb = blocks.shape[1]
    if width >= vocab or width >= nb:
        return x.topk(width, dim=-1).values if width < vocab else x.sort(-1, descending=True).values
    picked = blocks.amax(-1).topk(width, dim=-1).indices  # [R, width]
    cand = blocks.gather(1, picked[:, :, None].expand(-1, -1, BLOCK)).reshape(rows, -1)
    return cand.topk(width, dim=-1).values


# ---------------------------------------------------------------------------------------------------------
# Distributions


def _rows(x: Tensor, idx: Tensor | None) -> Tensor:
    """x[idx], without the copy when idx is None (all rows)."""
    return x if idx is None else x[idx]


def _cutoffs(probs: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """Per-row probability cut-off [R] for top-k then top-p (top-p on the renormalised top-k set)."""
    rows, vocab = probs.shape
    k_keep = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [R]
    nucleus = top_p < 1
    thresholds = torch.empty(rows, dtype=probs.dtype, device=probs.device)
    pending: Tensor | None = None  # None = all rows
    width = 64
    # Escalate the partial-sort width until each row's cut-off lies inside it: most cut-offs are within the
    # top 64, so a full-vocabulary sort is the rare fallback (very flat rows with top_p < 1).
    while True:
        kp, np_, tp = _rows(k_keep, pending), _rows(nucleus, pending), _rows(top_p, pending)
        bounded_k = kp[kp < vocab]
        width = min(vocab, max(width, int(bounded_k.max()) if bounded_k.numel() else 0))
        sub = _rows(probs, pending)
        vals = _top_values(sub, width)  # [r, width], descending
        csum = vals.cumsum(-1)
        limit = kp.clamp_max(width)  # entries we may keep from `vals`
        k_mass = torch.where(kp >= vocab, sub.sum(-1), csum.gather(1, (limit - 1)[:, None])[:, 0])
        # Keep entry j while the mass strictly before it is below top_p of the (top-k) mass.
        before = csum - vals
        col = torch.arange(width, device=probs.device)[None, :]
        keep = (col < limit[:, None]) & (~np_[:, None] | (before < (tp * k_mass)[:, None]))
        n_keep = keep.sum(-1).clamp_min(1)
        closed = (np_ & (n_keep < limit)) | (kp <= width) | (width == vocab)
        ids = torch.arange(rows, device=probs.device) if pending is None else pending
        thresholds[ids[closed]] = vals[closed].gather(1, (n_keep[closed] - 1)[:, None])[:, 0]
        if bool(closed.all()):
            return thresholds
        pending = ids[~closed]
        width = min(vocab, width * 8)


def processed_probs(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """The distribution the sampler draws from, float32 [B, V], after temperature, top-k, top-p.

    Greedy rows (temperature 0) are the one-hot of the argmax. Speculative verification checks drafts
    against exactly this distribution. Ties with the top-k / top-p boundary token are kept.
    """
    logits = logits.float()
    rows, vocab = logits.shape
    greedy = temperature <= 0  # [B]
    n_greedy = int(greedy.sum())
    if n_greedy == rows:
        probs = torch.zeros_like(logits)
    else:
        scaled = logits
        if bool(((temperature != 1) & ~greedy).any()):
            scaled = logits * torch.where(greedy, 1.0, temperature.float()).reciprocal()[:, None]
        probs = torch.softmax(scaled, dim=-1)  # [B, V]
        filtered = ~greedy & ((top_p < 1) | ((top_k > 0) & (top_k < vocab)))
        n_filtered = int(filtered.sum())
        if n_filtered:
            idx = None if n_filtered == rows else filtered.nonzero()[:, 0]
            sub = _rows(probs, idx)
            cut = _cutoffs(sub, _rows(top_p, idx).float(), _rows(top_k, idx).long())
            sub = sub.masked_fill_(sub < cut[:, None], 0.0)
            sub.mul_(sub.sum(-1, keepdim=True).reciprocal_())
            if idx is not None:
                probs[idx] = sub
    if n_greedy:
        idx = greedy.nonzero()[:, 0]
        if n_greedy < rows:
            probs[idx] = 0.0
        probs[idx, _argmax(logits[idx])] = 1.0
    return probs


# ---------------------------------------------------------------------------------------------------------
# Sampling


def race_sample(
    probs: Tensor,
    seeds: Tensor,
    positions: Tensor,
    stream: int = STREAM_SAMPLE,
    tail_stream: int = STREAM_TAIL,
) -> Tensor:
    """Draw one token per row [B] from probability rows [B, V] with position-keyed noise.

    Exponential race over the head (p >= HEAD_MIN_PROB) plus one block arrival for the tail; see the
    module docstring. Rows need not be normalised; an all-zero row yields V (out of range).
    """
    rows, vocab = probs.shape
    blocks = _blocks(probs, 0.0)  # [B, nb, BLOCK]
    block_mass = blocks.sum(-1)  # [B, nb]; becomes the tail mass per block
    br, bc = (blocks.amax(-1) >= HEAD_MIN_PROB).nonzero(as_tuple=True)  # blocks holding head tokens
    sub = blocks[br, bc]  # [m, BLOCK]
    in_head = sub >= HEAD_MIN_PROB
    block_mass[br, bc] = sub.masked_fill(in_head, 0.0).sum(-1)  # exact zero when no tail tokens
    sr, sc = in_head.nonzero(as_tuple=True)
    hr, hc = br[sr], bc[sr] * BLOCK + sc  # flat head entries
    hp = sub[sr, sc].double()

    keys = _row_keys(seeds, positions, stream)  # [B]
    arrival = -torch.log(_uniform_at(keys[hr], hc)) / hp  # E_i / p_i
    best = torch.full((rows,), float("inf"), dtype=torch.float64, device=probs.device)
    best.scatter_reduce_(0, hr, arrival, reduce="amin")
    winner = torch.full((rows,), vocab, dtype=torch.int64, device=probs.device)
    is_min = arrival == best[hr]
    winner.scatter_reduce_(0, hr[is_min], hc[is_min], reduce="amin")

    tail_u = keyed_uniform(seeds, positions, tail_stream, 2)  # [B, 2]: block arrival, pick
    tail_arrival = -torch.log(tail_u[:, 0]) / block_mass.sum(-1).double()
    tail_rows = (tail_arrival < best).nonzero()[:, 0]
    if tail_rows.numel() > 0:
        # Inverse CDF over the tail, two-level: a block by its tail mass, then a token inside it.
        tail_block_mass = block_mass[tail_rows].double()  # [t, nb]
        block_cdf = tail_block_mass.cumsum(-1)
        target = tail_u[tail_rows, 1:] * block_cdf[:, -1:]  # [t, 1]
        block = torch.searchsorted(block_cdf, target, right=True).clamp_max(block_cdf.shape[1] - 1)
        below = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0.0)
        frac = ((target - below) / tail_block_mass.gather(1, block)).clamp(0.0, 1 - 2**-52)
        inner = blocks[tail_rows, block[:, 0]].double()  # [t, BLOCK]
        inner_cdf = inner.masked_fill_(inner >= HEAD_MIN_PROB, 0.0).cumsum(-1)
        token = torch.searchsorted(inner_cdf, frac * inner_cdf[:, -1:], right=True).clamp_max(BLOCK - 1)
        winner[tail_rows] = (block * BLOCK + token)[:, 0]
    return winner


_M64 = (1 << 64) - 1


def _mix_int(z: int) -> int:
    """`_mix` on a Python int (unsigned 64-bit arithmetic; the tensor version's signed wrap is the same)."""
    z = ((z ^ (z >> 30)) * (_MIX1 & _M64)) & _M64
    z = ((z ^ (z >> 27)) * (_MIX2 & _M64)) & _M64
    return z ^ (z >> 31)


def keyed_exponential(seed: int, position: int, token: int, stream: int = STREAM_SAMPLE) -> float:
    """E_token ~ Exp(1) of the sampler's race at (seed, position): -log of the `keyed_uniform` draw for
    `token`, in plain Python (for drafters that weigh a handful of candidates; no tensor overhead)."""
    golden = _GOLDEN & _M64
    k = _mix_int((seed * golden + 1) & _M64)
    k = _mix_int((k + position * golden) & _M64)
    k = _mix_int((k + (stream + 1) * golden) & _M64)
    z = _mix_int((k + (token + 1) * golden) & _M64)
    return -math.log(((z >> 11) + 0.5) * 2.0**-53)


def _log_arrivals(seeds: Tensor, positions: Tensor, tokens: Tensor, log_q: Tensor) -> Tensor:
    """log(E_i / q_i) [R, w] of `tokens` [R, w] in the sampler's race at each row's (seed, position), with
    log_q [R, w] their draft log-weights up to a per-row constant (it does not change the order)."""
    keys = _row_keys(seeds, positions, STREAM_SAMPLE)
    return torch.log(-torch.log(_uniform_at(keys[:, None], tokens))) - log_q.double()


def keyed_pick(
    logits: Tensor,
    temperature: Tensor,
    seeds: Tensor,
    positions: Tensor,
    ids: Tensor | None = None,
    width: int = 32,
) -> Tensor:
    """A drafter's guess [R] of the token `sample` will draw at each row's position: the winner of the
    sampler's own race (STREAM_SAMPLE noise at that position) run over the draft distribution
    softmax(logits / T) restricted to its `width` most likely tokens. Greedy rows (T = 0) get the argmax.

    This couples draft and target through shared randomness: where the draft distribution q is close to the
    target's p, both races are won by the same token, so a chain drafted this way survives "match"
    verification about as often as greedy drafting does at T = 0 — where an argmax draft survives only
    with probability p(argmax). (The race of arrival times E_i / q_i is Gumbel-max coupling; its
    agreement probability is at least (1 - TV) / (1 + TV) of the two distributions.) It changes no output:
    verification draws the target's token regardless of the draft.

    logits [R, U] are over the draft vocabulary `ids` [U] (None: the whole vocabulary, U = V); top-k / top-p
    are not applied (a guess needs no exact filter).
    """
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits * torch.where(greedy, 1.0, temperature.float()).reciprocal()[:, None]
    top, index = scaled.topk(min(width, scaled.shape[-1]), dim=-1)  # [R, w], descending
    tokens = index if ids is None else ids[index]
    pick = torch.where(greedy, 0, _log_arrivals(seeds, positions, tokens, top).argmin(-1))
    return tokens.gather(1, pick[:, None])[:, 0]


def keyed_rank(logprobs: Tensor, seeds: Tensor, positions: Tensor, width: int = 32) -> Tensor:
    """Draft log-probs [R, V] re-dealt so that their ranking follows the sampler's race at each row's
    position: the `width` most likely tokens keep the same *set* of values, but the largest goes to the
    token whose arrival E_i / q_i comes first, the second largest to the second, and so on. A tree built
    on these scores (`tree.build_tree`) puts the keyed draw (`keyed_pick`) on its first branch and hedges
    with the next arrivals, while keeping the draft's calibration of how far to trust a level. The rows
    are log-softmaxes at the sampling temperature; -inf entries stay -inf."""
    top, index = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)  # [R, w], descending
    arrival = _log_arrivals(seeds, positions, index, top).masked_fill(top.isinf(), float("inf"))
    order = arrival.argsort(-1)  # [R, w]: by arrival
    return logprobs.scatter(1, index.gather(1, order), top)


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    """Sample one token per row; returns (tokens int64 [B], logprobs float32 [B]).

    `positions` is the index (over prompt + response) the sampled token will occupy. The log-prob is that
    of the processed distribution (what the sampler used), 0 for greedy rows.
    """
    if bool((temperature <= 0).all()):  # all greedy: no distribution to build
        return _argmax(logits.float()), logits.new_zeros(logits.shape[0], dtype=torch.float32)
    probs = processed_probs(logits, temperature, top_p, top_k)  # [B, V]
    tokens = race_sample(probs, seeds, positions)
    logprobs = probs.gather(1, tokens[:, None])[:, 0].log()
    return tokens, logprobs
