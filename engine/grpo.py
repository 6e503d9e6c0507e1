"""GRPO maths: group advantages, the learner's log-probs under the sampling distribution, and the loss.

Pure functions on tensors, no collectives: the learner passes padded [num_seqs, max_len] micro-batches with
the global token / sequence counts, so the losses of all micro-batches and ranks sum to one big batch's.

Non-obvious choices:
- An invalid sample (reward raised, hung or returned garbage) is left out of its group's baseline with
  advantage 0; its tokens also leave the loss mask (`GroupAdvantages.sample_mask`).
- `processed_logprobs` scores tokens under what the rollout sampled from (temperature, top-k, top-p with
  `sampling.processed_probs`'s cut-off, ties kept), so the step-0 ratio is 1. Re-implemented because the
  sampler's is CPU-only; its backward recomputes each row chunk, so autograd keeps no [N, V] float32 copy.
- The PPO ratio is against the rollout's log-probs (the behaviour policy). With truncated importance
  sampling on, it is against the learner's log-probs at the start of the step, and the capped weight
  corrects learner vs rollout (verl's TIS); weighting a ratio already against the rollout corrects twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import torch
from torch import Tensor

__all__ = [
    "GroupAdvantages",
    "LossConfig",
    "group_advantages",
    "grpo_loss",
    "pad_sequences",
    "processed_logprobs",
]


class LossConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the GRPO policy loss (a struct, so a run config's misspelt key fails naming the field)."""

    eps_low: float = 0.2
    """Ratio clip below 1 - eps_low (0.2, PPO's): how far a token's probability may fall in one step."""
    eps_high: float = 0.28
    """Ratio clip above 1 + eps_high (0.28, DAPO's "clip-higher"): lets rare good tokens grow, keeps entropy up."""
    aggregation: Literal["token-mean", "seq-mean"] = "token-mean"
    """"token-mean" (default, DAPO / Dr.GRPO): every token of the global batch weighs the same, so long
    answers are not down-weighted; "seq-mean": mean over sequences of each sequence's token mean."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to a reference model (0.0: none, so no reference forward; RLVR runs without it)."""
    tis_cap: float | None = None
    """Truncated importance weight cap C (None or 0: off, as the ratio already takes the rollout as the
    behaviour policy; 2.0 is the usual value for verl's TIS when on, e.g. with a bf16/fp8 rollout)."""
    normalize_std: bool = True
    """Divide advantages by the group's reward std (True, GRPO); False is Dr.GRPO (no difficulty bias)."""
    drop_zero_adv_groups: bool = False
    """Drop groups whose advantages are all 0 (False: they carry no policy gradient anyway, and dropping them
    only shrinks the token-mean denominator, silently raising the step size as groups saturate)."""

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.aggregation not in ("token-mean", "seq-mean"):
            raise ValueError(f"aggregation must be 'token-mean' or 'seq-mean', got {self.aggregation!r}")
        if not 0 <= self.kl_coef < float("inf"):
            raise ValueError(f"kl_coef must be finite and >= 0, got {self.kl_coef}")
        # A cap below 1 would down-weight even exactly on-policy tokens: a misconfiguration, not a choice.
        if self.tis_cap is not None and self.tis_cap != 0 and not 1 <= self.tis_cap < float("inf"):
            raise ValueError(f"tis_cap must be None, 0 (off) or finite and >= 1, got {self.tis_cap}")

    @property
    def tis(self) -> bool:
        """Whether truncated importance sampling is on."""
        return bool(self.tis_cap)


# ---------------------------------------------------------------------------------------------------------
# Advantages


@dataclass(frozen=True, kw_only=True)
class GroupAdvantages:
    """Per-sample advantages of a batch of prompt groups."""

    advantages: Tensor
    """[num_groups, G]; 0 for invalid samples and in zero-advantage groups."""
    valid: Tensor
    """[num_groups, G] bool, as given."""
    zero_adv_groups: Tensor
    """[num_groups] bool: fewer than 2 valid samples, or all valid rewards equal."""
    zero_adv_share: float
    """Share of zero-advantage groups in the batch (logged every step)."""

    def sample_mask(self, drop_zero_adv_groups: bool = False) -> Tensor:
        """[num_groups, G] bool: the samples whose tokens enter the loss."""
        if drop_zero_adv_groups:
            return self.valid & ~self.zero_adv_groups[:, None]
        return self.valid


def group_advantages(
    rewards: Tensor, valid: Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> GroupAdvantages:
    """Group-relative advantages: (r - mean) / (std + eps) over each group's valid samples (std unbiased, as
    torch.std in TRL and verl), or r - mean when not `normalize_std`. rewards, valid: [num_groups, G]."""
    if rewards.dim() != 2 or rewards.shape != valid.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and valid {tuple(valid.shape)} must be equal 2-D")
    valid = valid.bool()
    r = torch.where(valid, rewards, 0.0)  # invalid rewards may be NaN: never let them into a sum
    if not bool(r.isfinite().all()):
        raise ValueError("rewards: a sample marked valid has a non-finite reward")
    n = valid.sum(-1)  # [num_groups]
    mean = r.sum(-1) / n.clamp_min(1)
    centred = torch.where(valid, r - mean[:, None], 0.0)
    hi = torch.where(valid, r, float("-inf")).amax(-1)
    lo = torch.where(valid, r, float("inf")).amin(-1)
    # Decided exactly rather than by std < eps: a float mean of equal rewards can miss them by an ulp.
    zero = (n < 2) | (hi == lo)
    if normalize_std:
        std = (centred.square().sum(-1) / (n - 1).clamp_min(1)).sqrt()
        centred = centred / (std + eps)[:, None]
    advantages = centred.masked_fill(zero[:, None], 0.0)
    share = float(zero.float().mean()) if zero.numel() else 0.0
    return GroupAdvantages(advantages=advantages, valid=valid, zero_adv_groups=zero, zero_adv_share=share)


# ---------------------------------------------------------------------------------------------------------
# Log-probs under the processed sampling distribution


def _per_row(x: Tensor | float, rows: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    x = torch.as_tensor(x, dtype=dtype, device=device)
    return x.expand(rows) if x.dim() == 0 else x


def _scaled_support(
    logits: Tensor, tokens: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor
) -> tuple[Tensor, Tensor | None, Tensor]:
    """(logits / T in float32 [R, V], the kept support [R, V] bool or None for all, 1/T [R]).

    Same operations as `sampling.processed_probs`: multiply by the reciprocal of T, softmax, top-k then
    top-p on the top-k mass, cut-off by probability value so boundary ties stay. The sampled token is
    always in the support: a token the rollout drew just inside its nucleus may fall outside the learner's
    (logits differ by rounding); keeping it gives a finite, nearly equal log-prob instead of -inf.
    """
    rows, vocab = logits.shape
    greedy = temperature <= 0
    inv_t = torch.where(greedy, 1.0, temperature).reciprocal()  # [R]
    scaled = logits.float() * inv_t[:, None]  # [R, V]
    bounded_k = (top_k > 0) & (top_k < vocab)
    filtered = ~greedy & ((top_p < 1) | bounded_k)
    if not bool(filtered.any()):
        return scaled, None, inv_t
    idx = filtered.nonzero()[:, 0]
    probs = torch.softmax(scaled[idx], dim=-1)  # [F, V]
    vals = probs.sort(dim=-1, descending=True).values
    csum = vals.cumsum(-1)
    k_keep = torch.where(bounded_k[idx], top_k[idx], vocab)  # [F]
    k_mass = torch.where(k_keep >= vocab, probs.sum(-1), csum.gather(1, (k_keep - 1)[:, None])[:, 0])
    tp = top_p[idx]
    col = torch.arange(vocab, device=logits.device)
    # Counted, not searched for the first miss, exactly like the sampler (rounding can break monotonicity).
    keep_sorted = (col < k_keep[:, None]) & ((tp >= 1)[:, None] | (csum - vals < (tp * k_mass)[:, None]))
    cut = vals.gather(1, (keep_sorted.sum(-1).clamp_min(1) - 1)[:, None])  # [F, 1]
    keep = torch.ones_like(scaled, dtype=torch.bool)
    keep[idx] = probs >= cut
    keep[torch.arange(rows, device=logits.device), tokens] = True
    return scaled, keep, inv_t


def _chunk_logprob(logits: Tensor, tokens: Tensor, t: Tensor, p: Tensor, k: Tensor) -> Tensor:
    scaled, keep, _ = _scaled_support(logits, tokens, t, p, k)
    # Shift by the row max first (always in the support), as softmax does: at T << 1 the scaled logits are
    # large and shifting after a logsumexp would lose their low bits.
    shifted = scaled - scaled.amax(-1, keepdim=True)  # [R, V]
    norm = shifted.exp()
    if keep is not None:
        norm = norm.masked_fill_(~keep, 0.0)
    logp = shifted.gather(1, tokens[:, None])[:, 0] - norm.sum(-1).log()
    return torch.where(t <= 0, 0.0, logp)  # greedy: the sampler reports 0


class _ProcessedLogprobs(torch.autograd.Function):
    """Chunked log-probs whose backward recomputes the chunk's distribution instead of saving it."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, top_p, top_k, chunk_rows, overwrite):  # type: ignore[override]
        ctx.save_for_backward(logits, tokens, temperature, top_p, top_k)
        ctx.chunk_rows = chunk_rows
        ctx.overwrite = overwrite
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for s in range(0, logits.shape[0], chunk_rows):
            c = slice(s, s + chunk_rows)
            out[c] = _chunk_logprob(logits[c], tokens[c], temperature[c], top_p[c], top_k[c])
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, tokens, temperature, top_p, top_k = ctx.saved_tensors
        # Overwrite: each chunk's logits are read before its gradient lands on them, and nothing reads them
        # after, so the [N, V] gradient needs no second [N, V] buffer (a retained graph then fails loudly).
        grad = logits if ctx.overwrite else torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk_rows):
            c = slice(s, s + ctx.chunk_rows)
            scaled, keep, inv_t = _scaled_support(logits[c], tokens[c], temperature[c], top_p[c], top_k[c])
            if keep is not None:
                scaled = scaled.masked_fill_(~keep, float("-inf"))
            # d log q(x) / d logits = (onehot(x) - q) / T on the support; the mask is piecewise constant.
            g = torch.where(temperature[c] <= 0, 0.0, grad_out[c].float() * inv_t)[:, None]  # [R, 1]
            chunk = torch.softmax(scaled, dim=-1).mul_(-g)  # [R, V]
            chunk.scatter_add_(1, tokens[c][:, None], g)
            grad[c] = chunk
        return grad, None, None, None, None, None, None


def processed_logprobs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: Tensor | float,
    top_p: Tensor | float = 1.0,
    top_k: Tensor | int = 0,
    chunk_rows: int = 256,
    overwrite_logits: bool = False,
) -> Tensor:
    """Log-probs float32 [N] of `tokens` [N] under the rollout's processed sampling distribution.

    logits [N, V] in any float dtype (computed in float32); temperature / top_p / top_k are per-row [N] or
    scalars. Greedy rows (temperature 0) get 0, as the sampler reports. Differentiable w.r.t. logits; at
    most `chunk_rows` rows of float32 [rows, V] temporaries exist at once (256 x 150k vocab ~ 150 MB each).
    overwrite_logits: the backward writes the logits' gradient into `logits` itself (saving an [N, V]
    buffer at the learner's peak); for a caller that never reads `logits` after backward.
    """
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(f"logits {tuple(logits.shape)} must be [N, V] and tokens {tuple(tokens.shape)} [N]")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    rows, device = logits.shape[0], logits.device
    t = _per_row(temperature, rows, torch.float32, device)
    p = _per_row(top_p, rows, torch.float32, device)
    k = _per_row(top_k, rows, torch.int64, device)
    return _ProcessedLogprobs.apply(
        logits, tokens.to(device, torch.int64), t, p, k, chunk_rows, overwrite_logits
    )


# ---------------------------------------------------------------------------------------------------------
# Loss


def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    config: LossConfig,
    ref_logprobs: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    num_tokens: int | Tensor | None = None,
    num_seqs: int | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped-ratio policy loss (+ k3 KL to a reference) and detached stats for one micro-batch.

    Per-token tensors are [num_seqs, max_len]; `mask` marks the response tokens of samples in the loss;
    `advantages` is [num_seqs]. Padding may hold anything (NaN included): it reaches neither loss nor grads.
    behaviour_logprobs: what the rollout reported. old_logprobs (TIS only): the learner's log-probs at the
    start of the step; default logprobs.detach(), exact when one optimizer step is taken per rollout batch.
    num_tokens / num_seqs: global counts over all micro-batches and ranks (token-mean / seq-mean
    denominators); default this call's own. Stats are means over this call's masked tokens.
    """
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when kl_coef > 0")
    mask = mask.bool()
    # Sanitise before exp(): garbage in padding would otherwise give inf * 0 = NaN gradients.
    logp = torch.where(mask, logprobs, 0.0)  # [num_seqs, max_len]
    behaviour = torch.where(mask, behaviour_logprobs.to(logp.dtype), 0.0)
    adv = torch.where(mask, advantages.to(logp.dtype)[:, None], 0.0)
    raw_weight = None
    if config.tis:
        old = logp.detach() if old_logprobs is None else torch.where(mask, old_logprobs.to(logp.dtype), 0.0)
        ratio = torch.exp(logp - old)
        raw_weight = torch.exp(old - behaviour).detach()  # a constant: TIS reweights, it is not optimised
    else:
        ratio = torch.exp(logp - behaviour)
    clipped = ratio.clamp(1 - config.eps_low, 1 + config.eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    if raw_weight is not None:
        pg = pg * raw_weight.clamp(max=config.tis_cap)
    per_token = pg
    k3 = None
    if ref_logprobs is not None:
        delta = torch.where(mask, ref_logprobs.to(logp.dtype), 0.0) - logp
        k3 = torch.exp(delta) - delta - 1  # unbiased for KL(pi || ref), always >= 0
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * k3
    per_token = torch.where(mask, per_token, 0.0)

    if config.aggregation == "token-mean":
        denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)
        loss = per_token.sum() / denom.clamp_min(1)
    else:
        lengths = mask.sum(-1)  # [num_seqs]
        seq_means = per_token.sum(-1) / lengths.clamp_min(1)
        denom = (lengths > 0).sum() if num_seqs is None else torch.as_tensor(num_seqs)
        loss = seq_means.sum() / denom.clamp_min(1)
    return loss, _loss_stats(logp, behaviour, ratio, adv, pg, raw_weight, k3, mask, config)


@torch.no_grad()
def _loss_stats(
    logp: Tensor,
    behaviour: Tensor,
    ratio: Tensor,
    adv: Tensor,
    pg: Tensor,
    raw_weight: Tensor | None,
    k3: Tensor | None,
    mask: Tensor,
    config: LossConfig,
) -> dict[str, float]:
    n = int(mask.sum())
    if n == 0:
        return {"tokens": 0.0}
    r, a = ratio[mask].detach(), adv[mask]  # [n]
    log_r = (logp.detach() - behaviour)[mask]  # log(train / rollout)
    stats = {
        "pg_loss": pg[mask].detach().mean(),
        "clip_frac_low": ((r < 1 - config.eps_low) & (a < 0)).float().mean(),
        "clip_frac_high": ((r > 1 + config.eps_high) & (a > 0)).float().mean(),
        "ratio_mean": r.mean(),
        "ratio_max": r.max(),
        "ratio_min": r.min(),
        # Train-rollout mismatch, samples from the rollout mu: k1 and k3 estimates of KL(mu || pi).
        "mismatch_logp_abs_mean": log_r.abs().mean(),
        "mismatch_logp_abs_max": log_r.abs().max(),
        "mismatch_kl_k1": (-log_r).mean(),
        "mismatch_kl_k3": (log_r.exp() - 1 - log_r).mean(),
    }
    if k3 is not None:
        stats["kl_ref"] = k3[mask].detach().mean()
    if raw_weight is not None:
        w = raw_weight[mask]
        stats["tis_weight_mean"] = w.clamp(max=config.tis_cap).mean()
        stats["tis_clip_frac"] = (w > config.tis_cap).float().mean()
    values = torch.stack([v.double() for v in stats.values()]).tolist()  # one device sync
    return {"tokens": float(n), **dict(zip(stats, values, strict=True))}


# ---------------------------------------------------------------------------------------------------------
# Batching


def pad_sequences(seqs: Sequence[Tensor], pad: float = 0) -> tuple[Tensor, Tensor]:
    """Right-pad 1-D tensors into (padded [B, L], mask [B, L] bool, True on real entries); keeps autograd."""
    if len(seqs) == 0:
        raise ValueError("pad_sequences needs at least one sequence")
    padded = torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True, padding_value=pad)
    lengths = torch.tensor([len(s) for s in seqs], device=padded.device)
    mask = torch.arange(padded.shape[1], device=padded.device)[None, :] < lengths[:, None]
    return padded, mask
