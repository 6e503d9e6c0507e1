"""GRPO maths: hand-computed advantages and losses for each option, the global normalisation across
micro-batches, and agreement of the learner's log-probs with what `sampling.sample` reports.

Hand cases run in float64 with tight tolerances; sampler agreement runs in float32 (what both sides use).
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from slipstream.engine.grpo import (
    LossConfig,
    group_advantages,
    grpo_loss,
    pad_sequences,
    processed_logprobs,
)
from slipstream.engine.sampling import processed_probs, sample

F64 = torch.float64
NAN = float("nan")


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0
    )


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=True)


def logs(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64).log()


# ---------------------------------------------------------------------------------------------------------
# LossConfig


def test_config_defaults():
    c = LossConfig()
    assert (c.eps_low, c.eps_high, c.aggregation, c.kl_coef) == (0.2, 0.28, "token-mean", 0.0)
    assert c.tis_cap is None and not c.tis
    assert c.normalize_std and not c.drop_zero_adv_groups
    assert LossConfig(tis_cap=2.0).tis and not LossConfig(tis_cap=0).tis
    with pytest.raises(TypeError):
        LossConfig(0.1)  # keyword-only
    with pytest.raises(AttributeError):  # frozen
        c.eps_low = 0.1  # type: ignore[misc]
    with pytest.raises(msgspec.ValidationError, match="eps_lo"):  # a misspelt key in a run config
        msgspec.convert({"eps_lo": 0.1}, LossConfig)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("eps_low", -0.1),
        ("eps_low", 1.0),
        ("eps_high", -0.01),
        ("aggregation", "mean"),
        ("kl_coef", -1.0),
        ("kl_coef", math.inf),
        ("tis_cap", 0.5),
        ("tis_cap", math.inf),
    ],
)
def test_config_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value})


# ---------------------------------------------------------------------------------------------------------
# Advantages


def test_advantages_std_and_invalid_out_of_baseline():
    rewards = torch.tensor([[1.0, 0.0, 1.0, NAN], [2.0, 4.0, 0.0, 6.0]], dtype=F64)
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    out = group_advantages(rewards, valid, eps=1e-6)
    # Group 0: mean over the 3 valid = 2/3, unbiased std = sqrt((1/9 + 4/9 + 1/9) / 2) = sqrt(1/3).
    s0 = math.sqrt(1 / 3) + 1e-6
    # Group 1: mean 3, unbiased variance (1 + 1 + 9 + 9) / 3.
    s1 = math.sqrt(20 / 3) + 1e-6
    close(out.advantages, [[1 / 3 / s0, -2 / 3 / s0, 1 / 3 / s0, 0.0], [-1 / s1, 1 / s1, -3 / s1, 3 / s1]])
    assert not out.zero_adv_groups.any() and out.zero_adv_share == 0.0
    assert torch.equal(out.sample_mask(), valid)


def test_advantages_dr_grpo_no_std():
    rewards = torch.tensor([[1.0, 0.0, 1.0, NAN], [2.0, 4.0, 0.0, 6.0]], dtype=F64)
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    out = group_advantages(rewards, valid, normalize_std=False)
    close(out.advantages, [[1 / 3, -2 / 3, 1 / 3, 0.0], [-1.0, 1.0, -3.0, 3.0]])


@pytest.mark.parametrize("normalize_std", [True, False])
def test_zero_advantage_groups_and_share(normalize_std):
    rewards = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0],  # all equal
            [0.1, 0.1, 0.1, 5.0],  # equal among the valid (the float mean of 0.1s is not 0.1)
            [3.0, NAN, NAN, NAN],  # one valid sample
            [NAN, NAN, NAN, NAN],  # none valid
            [0.0, 1.0, 0.0, 0.0],  # informative
        ],
        dtype=F64,
    )
    valid = torch.tensor(
        [[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool
    )
    out = group_advantages(rewards, valid, normalize_std=normalize_std)
    assert out.zero_adv_groups.tolist() == [True, True, True, True, False]
    assert out.zero_adv_share == pytest.approx(0.8)
    assert torch.equal(out.advantages[:4], torch.zeros(4, 4, dtype=F64))  # exactly zero, not 1e-11
    assert (out.advantages[4] != 0).all()
    assert torch.equal(out.sample_mask(False), valid)
    expected = valid.clone()
    expected[:4] = False
    assert torch.equal(out.sample_mask(True), expected)


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(torch.tensor([[1.0, NAN]]), torch.tensor([[True, True]]))
    with pytest.raises(ValueError, match="must be equal"):
        group_advantages(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------------
# processed_logprobs against the sampler


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.3, 8.0, rows)[:, None]  # flat to peaked rows
    return torch.randn(rows, vocab, generator=g) * scale


def sampled(logits, t, p, k):
    rows = logits.shape[0]
    return sample(logits, t, p, k, torch.arange(rows) + 11, torch.arange(rows) * 7 + 3)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [
        (1.0, 1.0, 0),
        (0.6, 1.0, 0),
        (1.0, 0.9, 0),
        (0.8, 1.0, 5),
        (1.3, 0.8, 20),
        (0.5, 0.95, 1),
        (1.0, 0.3, 0),
    ],
)
def test_logprobs_match_sampler(temperature, top_p, top_k):
    logits = random_logits(48, 1000, seed=top_k + int(100 * top_p))
    t = torch.full((48,), temperature)
    p = torch.full((48,), top_p)
    k = torch.full((48,), top_k, dtype=torch.int64)
    tokens, reported = sampled(logits, t, p, k)
    ours = processed_logprobs(logits, tokens, temperature=t, top_p=p, top_k=k, chunk_rows=16)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reported, atol=1e-5, rtol=0)
    # Scalars broadcast to every row.
    torch.testing.assert_close(
        processed_logprobs(logits, tokens, temperature=temperature, top_p=top_p, top_k=top_k), ours
    )


def mixed_params(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(rows, generator=g) * 1.5 + 0.05
    t[::5] = 0.0  # greedy rows
    p = torch.where(torch.rand(rows, generator=g) < 0.5, torch.rand(rows, generator=g) * 0.9 + 0.05, 1.0)
    k = torch.where(torch.rand(rows, generator=g) < 0.5, torch.randint(1, 40, (rows,), generator=g), 0)
    return t, p, k


def test_logprobs_match_sampler_mixed_rows_and_whole_support():
    logits = random_logits(40, 700, seed=3)
    t, p, k = mixed_params(40, seed=4)
    tokens, reported = sampled(logits, t, p, k)
    ours = processed_logprobs(logits, tokens, temperature=t, top_p=p, top_k=k, chunk_rows=6)
    torch.testing.assert_close(ours, reported, atol=1e-5, rtol=0)
    assert torch.equal(ours[t == 0], torch.zeros(int((t == 0).sum())))  # greedy: 0, as the sampler says
    # Every token the sampler could draw, not only the drawn one: same support and the same values.
    probs = processed_probs(logits, t, p, k)
    rows, cols = (probs > 0).nonzero(as_tuple=True)
    every = processed_logprobs(logits[rows], cols, temperature=t[rows], top_p=p[rows], top_k=k[rows])
    expected = torch.where(t[rows] == 0, 0.0, probs[rows, cols].log())
    torch.testing.assert_close(every, expected, atol=1e-5, rtol=0)


def test_logprobs_keep_boundary_ties_like_sampler():
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(-3, 4, (32, 64), generator=g).float()  # many exact ties
    t, p, k = torch.ones(32), torch.full((32,), 0.6), torch.full((32,), 3, dtype=torch.int64)
    probs = processed_probs(logits, t, p, k)
    assert ((probs > 0).sum(-1) > 3).any()  # the case exists: ties with the k-th token are kept
    rows, cols = (probs > 0).nonzero(as_tuple=True)
    every = processed_logprobs(logits[rows], cols, temperature=t[rows], top_p=p[rows], top_k=k[rows])
    torch.testing.assert_close(every, probs[rows, cols].log(), atol=1e-5, rtol=0)


def reference_logprobs(logits, tokens, t, p, k):
    """Plain autograd: log-softmax of logits / T over the sampler's support (which holds the sampled token)."""
    support = processed_probs(logits.detach(), t, p, k) > 0
    scaled = logits / torch.where(t > 0, t, 1.0)[:, None]
    logp = scaled.masked_fill(~support, float("-inf")).log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    return torch.where(t > 0, logp, 0.0)


def test_logprobs_gradient_matches_autograd_and_chunking():
    base = random_logits(30, 500, seed=6)
    t, p, k = mixed_params(30, seed=7)
    tokens, _ = sampled(base, t, p, k)
    weights = torch.randn(30, generator=torch.Generator().manual_seed(8))
    ref_logits = base.clone().requires_grad_()
    (weights * reference_logprobs(ref_logits, tokens, t, p, k)).sum().backward()
    grads = []
    for chunk_rows in (1, 7, 1000):
        logits = base.clone().requires_grad_()
        (
            weights
            * processed_logprobs(logits, tokens, temperature=t, top_p=p, top_k=k, chunk_rows=chunk_rows)
        ).sum().backward()
        grads.append(logits.grad)
        torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads[0], grads[2], atol=0, rtol=0)
    grad = grads[1]
    assert grad.isfinite().all()
    # Every sampled row learns, unless its support is one token (log-prob 0 whatever the logits).
    spread = (processed_probs(base, t, p, k) > 0).sum(-1) > 1
    assert spread.sum() > 15 and (grad[spread].abs().sum(-1) > 0).all()
    assert torch.equal(grad[~spread], torch.zeros_like(grad[~spread]))
    assert torch.equal(grad[t == 0], torch.zeros_like(grad[t == 0]))  # greedy rows do not


def test_overwriting_the_logits_gives_the_same_gradient_in_their_place():
    """The learner's memory saving: the [N, V] gradient lands in the logits' own storage, bitwise equal
    to a separate buffer's, and a second backward through the overwritten logits fails instead of lying."""
    base = random_logits(30, 500, seed=6)
    t, p, k = mixed_params(30, seed=7)
    tokens, _ = sampled(base, t, p, k)
    grads = []
    for overwrite in (False, True):
        leaf = base.clone().requires_grad_()
        logits = leaf * 1.0  # a non-leaf, as the model's head output is; its gradient reaches `leaf` as is
        logp = processed_logprobs(logits, tokens, temperature=t, top_p=p, top_k=k, chunk_rows=7,
                                  overwrite_logits=overwrite)  # fmt: skip
        logp.sum().backward(retain_graph=True)
        grads.append(leaf.grad)
        assert torch.equal(logits.detach(), leaf.grad if overwrite else base)  # the gradient took their place
        if overwrite:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                logp.sum().backward()
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


def test_logprobs_bf16_input():
    logits = random_logits(8, 300, seed=9).bfloat16().requires_grad_()
    t = torch.full((8,), 0.7)
    tokens, reported = sampled(
        logits.detach().float(), t, torch.full((8,), 0.9), torch.zeros(8, dtype=torch.int64)
    )
    ours = processed_logprobs(logits, tokens, temperature=t, top_p=0.9)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reported, atol=1e-5, rtol=0)
    ours.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.isfinite().all()


def test_token_outside_learner_support_stays_finite():
    # top_k = 1 keeps only token 0; a rollout that drew token 1 (its logits differed by rounding) still
    # gets a finite log-prob: the support is widened by that token only.
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]], requires_grad=True)
    logp = processed_logprobs(logits, torch.tensor([1]), temperature=1.0, top_k=1)
    close(logp, [-math.log1p(math.e)], atol=1e-6)
    logp.sum().backward()
    assert logits.grad.isfinite().all() and logits.grad[0, 2:].eq(0).all()


# ---------------------------------------------------------------------------------------------------------
# grpo_loss


def one_token_batch(ratios, advantages):
    """num_seqs sequences of one token each with the given ratio against behaviour 0."""
    logp = leaf([[math.log(r)] for r in ratios])
    behaviour = torch.zeros(len(ratios), 1, dtype=F64)
    return logp, behaviour, torch.tensor(advantages, dtype=F64), torch.ones(len(ratios), 1, dtype=torch.bool)


def test_clip_high_only_when_advantage_positive():
    logp, b, adv, mask = one_token_batch([1.5, 1.5], [1.0, -1.0])
    loss, stats = grpo_loss(logp, b, adv, mask, config=LossConfig())
    # A > 0: max(-1.5, -1.28) = -1.28, clipped, no gradient. A < 0: max(1.5, 1.28) = 1.5, not clipped.
    close(loss, (-1.28 + 1.5) / 2)
    loss.backward()
    close(logp.grad[:, 0], [0.0, 1.5 / 2])  # d(-A r)/d logp = -A r
    assert stats["clip_frac_high"] == 0.5 and stats["clip_frac_low"] == 0.0
    close(stats["ratio_max"], 1.5)
    close(stats["ratio_min"], 1.5)


def test_eps_low_and_eps_high_are_asymmetric():
    # r = 1.25, A = +1: inside clip-higher (1.28) but outside a symmetric 1.2.
    logp, b, adv, mask = one_token_batch([1.25], [1.0])
    loss, _ = grpo_loss(logp, b, adv, mask, config=LossConfig())
    close(loss, -1.25)
    loss.backward()
    close(logp.grad, [[-1.25]])
    logp, b, adv, mask = one_token_batch([1.25], [1.0])
    loss, stats = grpo_loss(logp, b, adv, mask, config=LossConfig(eps_high=0.2))
    close(loss, -1.2)
    loss.backward()
    close(logp.grad, [[0.0]])
    assert stats["clip_frac_high"] == 1.0
    # r = 0.75, A = -1: below 1 - eps_low = 0.8, so clipped at 0.8; r = 0.85 is not.
    logp, b, adv, mask = one_token_batch([0.75, 0.85], [-1.0, -1.0])
    loss, stats = grpo_loss(logp, b, adv, mask, config=LossConfig())
    close(loss, (0.8 + 0.85) / 2)
    loss.backward()
    close(logp.grad[:, 0], [0.0, 0.85 / 2])
    assert stats["clip_frac_low"] == 0.5 and stats["clip_frac_high"] == 0.0


def unequal_batch():
    """seq 0: one token, ratio 1.1, A = 2; seq 1: three tokens, ratios 1.0 / 1.2 / 0.9, A = -1; padding NaN."""
    logp = leaf([[math.log(1.1), NAN, NAN], [0.0, math.log(1.2), math.log(0.9)]])
    behaviour = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    return logp, behaviour, torch.tensor([2.0, -1.0], dtype=F64), mask


def test_token_mean_and_seq_mean_by_hand():
    # Per-token losses: seq 0: -2 * 1.1 = -2.2; seq 1 (A = -1, all inside the clip): 1.0, 1.2, 0.9.
    loss, stats = grpo_loss(*unequal_batch(), config=LossConfig(aggregation="token-mean"))
    close(loss, (-2.2 + 3.1) / 4)
    assert stats["tokens"] == 4.0
    loss, _ = grpo_loss(*unequal_batch(), config=LossConfig(aggregation="seq-mean"))
    close(loss, (-2.2 + 3.1 / 3) / 2)
    # A sequence with no loss tokens does not count in seq-mean's default denominator.
    logp, b, adv, mask = unequal_batch()
    pad = torch.zeros(1, 3, dtype=F64)
    loss, _ = grpo_loss(
        torch.cat([logp, pad]),
        torch.cat([b, pad]),
        torch.cat([adv, torch.tensor([5.0], dtype=F64)]),
        torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)]),
        config=LossConfig(aggregation="seq-mean"),
    )
    close(loss, (-2.2 + 3.1 / 3) / 2)


def random_batch(seed: int, num_seqs: int = 6, max_len: int = 9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (num_seqs,), generator=g)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    behaviour = -torch.rand(num_seqs, max_len, generator=g, dtype=F64) * 3
    logp = behaviour + 0.4 * torch.randn(num_seqs, max_len, generator=g, dtype=F64)  # ratios beyond the clip
    ref = behaviour + 0.3 * torch.randn(num_seqs, max_len, generator=g, dtype=F64)
    adv = torch.randn(num_seqs, generator=g, dtype=F64)
    return logp, behaviour, adv, mask, ref


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("tis_cap", [None, 1.5])
def test_micro_batches_with_global_counts_add_up(aggregation, tis_cap):
    config = LossConfig(aggregation=aggregation, kl_coef=0.05, tis_cap=tis_cap)
    logp, b, adv, mask, ref = random_batch(seed=10)
    whole = logp.clone().requires_grad_()
    full, _ = grpo_loss(whole, b, adv, mask, config=config, ref_logprobs=ref)
    full.backward()
    parts = logp.clone().requires_grad_()
    counts = {"num_tokens": int(mask.sum()), "num_seqs": int(mask.any(-1).sum())}
    total = sum(
        grpo_loss(parts[s], b[s], adv[s], mask[s], config=config, ref_logprobs=ref[s], **counts)[0]
        for s in (slice(0, 2), slice(2, 6))
    )
    total.backward()
    close(total, full)
    close(parts.grad, whole.grad)
    assert whole.grad.abs().sum() > 0


def test_kl_k3_by_hand():
    # A = 0, so only the KL term: delta = ref - logp = log(0.25 / 0.5); k3 = e^delta - delta - 1.
    logp = leaf([[math.log(0.5)]])
    ref = logs([[0.25]])
    k3 = 0.5 - math.log(0.5) - 1
    args = (logp, logs([[0.5]]), torch.zeros(1, dtype=F64), torch.ones(1, 1, dtype=torch.bool))
    loss, stats = grpo_loss(*args, config=LossConfig(kl_coef=0.1), ref_logprobs=ref)
    close(loss, 0.1 * k3)
    close(stats["kl_ref"], k3)
    loss.backward()
    close(logp.grad, [[0.1 * (1 - 0.5)]])  # d k3 / d logp = 1 - e^delta
    # Without a coefficient the reference is only logged.
    loss, stats = grpo_loss(*args, config=LossConfig(), ref_logprobs=ref)
    close(loss, 0.0)
    close(stats["kl_ref"], k3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(*args, config=LossConfig(kl_coef=0.1))


def test_tis_cap_by_hand():
    # Learner 0.5 vs rollout 0.1: weight 5, capped at 2. Learner 0.3 vs rollout 0.2: weight 1.5.
    logp = leaf([[math.log(0.5), math.log(0.3)]])
    behaviour = logs([[0.1, 0.2]])
    adv, mask = torch.tensor([1.0], dtype=F64), torch.ones(1, 2, dtype=torch.bool)
    loss, stats = grpo_loss(logp, behaviour, adv, mask, config=LossConfig(tis_cap=2.0))
    # The ratio is against the learner's own (detached) log-probs: 1, so each token gives -A * weight.
    close(loss, -(2.0 + 1.5) / 2)
    loss.backward()
    close(logp.grad, [[-2.0 / 2, -1.5 / 2]])
    close(stats["tis_weight_mean"], 1.75)
    close(stats["tis_clip_frac"], 0.5)
    close(stats["ratio_max"], 1.0)
    close(stats["mismatch_logp_abs_max"], math.log(5))  # mismatch is always learner vs rollout
    # Without TIS the same tokens are ratios 5 and 1.5 against the rollout, both clipped at 1.28.
    loss, _ = grpo_loss(logp, behaviour, adv, mask, config=LossConfig())
    close(loss, -1.28)
    # Explicit old log-probs (several optimizer steps per batch): ratio = learner / old.
    loss, _ = grpo_loss(
        logp, behaviour, adv, mask, config=LossConfig(tis_cap=2.0), old_logprobs=logs([[0.4, 0.3]])
    )
    close(loss, -(1.25 * 2.0 + 1.0 * 1.5) / 2)


def test_masked_tokens_contribute_nothing():
    config = LossConfig(kl_coef=0.1, tis_cap=2.0)
    logp, b, adv, mask, ref = random_batch(seed=11)
    mask[3] = False  # a whole sequence out (an invalid sample)
    clean = logp.clone().requires_grad_()
    loss, stats = grpo_loss(clean, b, adv, mask, config=config, ref_logprobs=ref)
    loss.backward()
    garbage = torch.tensor([NAN, math.inf, -math.inf, 1e30], dtype=F64)
    fill = garbage[torch.arange(mask.numel()) % 4].reshape(mask.shape)
    dirty = torch.where(mask, logp, fill).requires_grad_()
    adv_dirty = adv.clone()
    adv_dirty[3] = NAN
    loss2, stats2 = grpo_loss(
        dirty,
        torch.where(mask, b, fill),
        adv_dirty,
        mask,
        config=config,
        ref_logprobs=torch.where(mask, ref, fill),
    )
    loss2.backward()
    close(loss2, loss)
    close(dirty.grad, clean.grad)
    assert torch.equal(dirty.grad[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    assert stats2 == stats


def test_gradient_at_ratio_one_is_minus_advantage_over_num_tokens():
    # End to end through processed_logprobs: at logp = behaviour, d loss = -sum_t A_t grad(logp_t) / num_tokens.
    num_seqs, max_len, vocab = 3, 4, 50
    base = random_logits(num_seqs * max_len, vocab, seed=12)
    t, p, k = torch.full((12,), 0.9), torch.full((12,), 0.95), torch.full((12,), 10, dtype=torch.int64)
    tokens, rollout = sampled(base, t, p, k)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.5, 2.0])
    logits = base.clone().requires_grad_()
    logp = processed_logprobs(logits, tokens, temperature=t, top_p=p, top_k=k).reshape(num_seqs, max_len)
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask, config=LossConfig(), num_tokens=20)
    loss.backward()
    assert stats["ratio_min"] == stats["ratio_max"] == 1.0 and stats["mismatch_logp_abs_max"] == 0.0
    torch.testing.assert_close(logp.detach().flatten(), rollout, atol=1e-5, rtol=0)  # the step-0 check
    expected_logits = base.clone().requires_grad_()
    lp = processed_logprobs(expected_logits, tokens, temperature=t, top_p=p, top_k=k).reshape(
        num_seqs, max_len
    )
    (-(adv[:, None] * mask) * lp / 20).sum().backward()
    torch.testing.assert_close(logits.grad, expected_logits.grad, atol=1e-7, rtol=1e-5)
    assert logits.grad.abs().sum() > 0


def test_mismatch_stats_by_hand():
    # log(train / rollout) = 0.1 and -0.2, A = 0 (stats only).
    logp = leaf([[0.1, -0.2]])
    _, stats = grpo_loss(
        logp,
        torch.zeros(1, 2, dtype=F64),
        torch.zeros(1, dtype=F64),
        torch.ones(1, 2, dtype=torch.bool),
        config=LossConfig(),
    )
    close(stats["mismatch_logp_abs_mean"], 0.15)
    close(stats["mismatch_logp_abs_max"], 0.2)
    close(stats["mismatch_kl_k1"], 0.05)
    close(stats["mismatch_kl_k3"], ((math.exp(0.1) - 1.1) + (math.exp(-0.2) - 0.8)) / 2)
    close(stats["ratio_mean"], (math.exp(0.1) + math.exp(-0.2)) / 2)
    assert all(type(v) is float for v in stats.values())


def test_empty_mask_gives_zero_loss():
    logp = leaf([[NAN, NAN]])
    loss, stats = grpo_loss(
        logp,
        torch.zeros(1, 2, dtype=F64),
        torch.ones(1, dtype=F64),
        torch.zeros(1, 2, dtype=torch.bool),
        config=LossConfig(),
    )
    loss.backward()
    assert loss.item() == 0.0 and stats == {"tokens": 0.0}
    assert torch.equal(logp.grad, torch.zeros(1, 2, dtype=F64))


# ---------------------------------------------------------------------------------------------------------
# pad_sequences


def test_pad_sequences():
    padded, mask = pad_sequences([torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])], pad=-1)
    assert padded.tolist() == [[1, 2, 3], [4, -1, -1], [5, 6, -1]]
    assert mask.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    x = torch.tensor([0.5, 0.25], requires_grad=True)
    padded, _ = pad_sequences([x, torch.tensor([1.0])])
    padded.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError):
        pad_sequences([])
