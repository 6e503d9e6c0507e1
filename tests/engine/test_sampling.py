"""Sampling: parameter validation, the processed distribution, keyed noise and the keyed sampler.

Statistical tests use a chi-square goodness-of-fit test at false-alarm rate ALPHA = 1e-3 with the critical
value computed from the chi-square quantile (`chi2_critical`); the seeds are fixed, so they are
deterministic, and a correct sampler fails one with probability 1e-3 over the choice of seeds.
"""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.engine.sampling import (
    HEAD_MIN_PROB,
    MAX_SAMPLE_INDEX,
    MAX_SEED,
    STREAM_SAMPLE,
    SamplingParams,
    _argmax,
    keyed_exponential,
    keyed_pick,
    keyed_rank,
    keyed_uniform,
    params_tensors,
    processed_probs,
    race_sample,
    sample,
    sample_seed,
)

ALPHA = 1e-3


def chi2_critical(dof: int, alpha: float = ALPHA) -> float:
    """The (1 - alpha) quantile of chi-square with `dof` degrees of freedom, by bisection on its tail."""
    lo, hi = 0.0, 10.0 * dof + 100.0
    a = torch.tensor(dof / 2.0, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        tail = float(torch.special.gammaincc(a, torch.tensor(mid / 2.0, dtype=torch.float64)))
        lo, hi = (mid, hi) if tail > alpha else (lo, mid)
    return (lo + hi) / 2


def chi2_statistic(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of integer samples against probs [V]; cells with zero probability must be empty."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a zero-probability outcome"
    expected = probs[support].double() * samples.numel()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def assert_distribution(samples: torch.Tensor, probs: torch.Tensor) -> None:
    stat, dof = chi2_statistic(samples, probs)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} >= critical {chi2_critical(dof):.1f} (dof {dof})"


def batch(b: int, temperature=1.0, top_p=1.0, top_k=0):
    return (
        torch.full((b,), float(temperature)),
        torch.full((b,), float(top_p)),
        torch.full((b,), int(top_k), dtype=torch.int64),
    )


# ---------------------------------------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("max_tokens", 0)],
)
def test_params_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_tensors_and_greedy():
    params = [SamplingParams(temperature=0.0, seed=3), SamplingParams(top_p=0.9, top_k=5, seed=7)]
    assert params[0].greedy and not params[1].greedy
    temperature, top_p, top_k, seeds = params_tensors(params)
    assert temperature.tolist() == [0.0, 1.0]
    assert top_p[1].item() == pytest.approx(0.9)
    assert top_k.tolist() == [0, 5] and seeds.tolist() == [3, 7]
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # keyword-only


def test_sample_seed_is_seed_times_2_to_24_plus_index_inside_int64():
    assert sample_seed(0, 0) == 0 and sample_seed(5, 3) == 5 * 2**24 + 3
    assert (MAX_SEED, MAX_SAMPLE_INDEX) == (2**39, 2**24)
    assert sample_seed(MAX_SEED - 1, MAX_SAMPLE_INDEX - 1) == 2**63 - 1  # the largest int64
    # The sampler takes it as its int64 key.
    assert params_tensors([SamplingParams(seed=sample_seed(MAX_SEED - 1, 7))])[3].tolist() == [
        2**63 - 2**24 + 7
    ]
    for seed, index, name in [
        (-1, 0, "seed"),
        (MAX_SEED, 0, "seed"),
        (True, 0, "seed"),
        (1.0, 0, "seed"),
        (0, -1, "index"),
        (0, MAX_SAMPLE_INDEX, "index"),
    ]:
        with pytest.raises(ValueError, match=rf"sample {name} must be an integer in \[0, 2\*\*"):
            sample_seed(seed, index)


# ---------------------------------------------------------------------------------------------------------
# processed_probs


def test_greedy_rows_are_one_hot_of_argmax():
    logits = torch.randn(5, 300)
    logits[2, 17] = logits[2, 250] = 50.0  # a tie: the first index wins, like torch.argmax
    t, p, k = batch(5, temperature=0.0)
    probs = processed_probs(logits, t, p, k)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(5)) and int((probs > 0).sum()) == 5
    assert probs[2, 17] == 1.0
    assert torch.equal(_argmax(logits), logits.argmax(-1))


def test_temperature_scales_logits():
    logits = torch.randn(3, 100)
    probs = processed_probs(logits, torch.tensor([0.5, 1.0, 2.0]), *batch(3)[1:])
    for row, temp in enumerate((0.5, 1.0, 2.0)):
        torch.testing.assert_close(probs[row], torch.softmax(logits[row] / temp, -1))


def reference_filter(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Top-k then top-p by a full sort, for one row."""
    probs = torch.softmax(logits.double(), -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = top_k if top_k > 0 else probs.numel()
    kept = order[:k]
    mass = probs[kept] / probs[kept].sum()
    before = mass.cumsum(0) - mass
    keep[kept[before < top_p]] = True
    out = torch.where(keep, probs, 0.0)
    return (out / out.sum()).float()


@pytest.mark.parametrize("vocab", [50, 1000, 5000])
@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 1), (1.0, 7), (1.0, 700), (0.5, 0), (0.95, 0), (0.9, 20)])
def test_top_k_top_p_match_sort_reference(vocab, top_p, top_k):
    torch.manual_seed(vocab + top_k)
    logits = torch.randn(6, vocab) * torch.tensor([0.3, 1.0, 2.0, 4.0, 8.0, 16.0])[:, None]
    probs = processed_probs(logits, *batch(6, top_p=top_p, top_k=top_k))
    for row in range(6):
        ref = reference_filter(logits[row], top_p, min(top_k, vocab))
        assert torch.equal(probs[row] > 0, ref > 0), f"row {row}"
        torch.testing.assert_close(probs[row], ref, atol=1e-6, rtol=1e-4)
    if top_k and top_p == 1.0:
        assert ((probs > 0).sum(-1) == min(top_k, vocab)).all()


def test_mixed_rows_are_processed_independently():
    logits = torch.randn(4, 400)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.0])
    top_p = torch.tensor([1.0, 0.8, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 10, 0])
    probs = processed_probs(logits, temperature, top_p, top_k)
    for row in range(4):
        alone = processed_probs(
            logits[row : row + 1], temperature[row : row + 1], top_p[row : row + 1], top_k[row : row + 1]
        )
        assert torch.equal(probs[row], alone[0])
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


# ---------------------------------------------------------------------------------------------------------
# keyed_uniform


def test_keyed_uniform_is_a_pure_function_of_its_key():
    seeds = torch.tensor([0, 1, 2, 2**40, -5])
    positions = torch.tensor([0, 0, 7, 3, 100])
    u = keyed_uniform(seeds, positions, 0, 1000)
    assert u.dtype == torch.float64 and u.shape == (5, 1000)
    assert ((u > 0) & (u < 1)).all()
    # Batch composition and length do not matter; order does not either.
    assert torch.equal(keyed_uniform(seeds[[4, 2]], positions[[4, 2]], 0, 10), u[[4, 2], :10])
    # Every key component matters.
    assert not torch.equal(keyed_uniform(seeds, positions, 1, 1000), u)
    assert not torch.equal(keyed_uniform(seeds, positions + 1, 0, 1000), u)
    assert len(set(u[:, 0].tolist())) == 5


def test_keyed_uniform_is_uniform():
    seeds = torch.arange(64)
    u = keyed_uniform(seeds, torch.zeros(64, dtype=torch.int64), 0, 2000).flatten()
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    bins = (u * 20).long()
    assert_distribution(bins, torch.full((20,), 1 / 20))


# ---------------------------------------------------------------------------------------------------------
# sample / race_sample


def test_sample_is_independent_of_batch_composition():
    torch.manual_seed(0)
    vocab = 3000
    logits = torch.randn(8, vocab) * torch.linspace(0.5, 6, 8)[:, None]
    temperature = torch.tensor([1.0, 0.0, 0.8, 1.0, 1.3, 1.0, 0.0, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 0.7, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 0, 40, 0, 0, 0, 3])
    seeds = torch.arange(8) * 31
    positions = torch.arange(8) + 10
    tokens, logprobs = sample(logits, temperature, top_p, top_k, seeds, positions)
    for perm in (torch.tensor([7, 3, 0]), torch.tensor([5]), torch.arange(8).flip(0)):
        t2, l2 = sample(
            logits[perm], temperature[perm], top_p[perm], top_k[perm], seeds[perm], positions[perm]
        )
        assert torch.equal(t2, tokens[perm]) and torch.equal(l2, logprobs[perm])
    probs = processed_probs(logits, temperature, top_p, top_k)
    torch.testing.assert_close(logprobs, probs[torch.arange(8), tokens].log())
    assert (probs[torch.arange(8), tokens] > 0).all()
    assert tokens[1] == logits[1].argmax() and logprobs[1] == 0.0


def test_sampling_runs_on_the_device_and_draws_the_hosts_tokens(device):
    """Parameters, processed probs, the keyed noise and the race are made on the logits' device, and draw
    the CPU's tokens (the noise is integer hashing of (seed, position): the same bits on every device)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 3000) * torch.linspace(0.5, 6, 6)[:, None]
    settings = [(1.0, 1.0, 0), (0.0, 1.0, 0), (0.8, 0.9, 0), (1.0, 1.0, 40), (1.3, 0.7, 0), (1.0, 0.95, 3)]
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, seed=31 * i) for i, (t, p, k) in enumerate(settings)
    ]
    positions = torch.arange(6) + 10
    expected, expected_logprobs = sample(logits, *params_tensors(params), positions)
    tensors = params_tensors(params, device)
    assert all(t.device.type == device.type for t in tensors)
    tokens, logprobs = sample(logits.to(device), *tensors, positions.to(device))
    assert tokens.device.type == logprobs.device.type == device.type
    assert tokens.tolist() == expected.tolist()
    torch.testing.assert_close(logprobs.cpu(), expected_logprobs, atol=1e-5, rtol=1e-5)
    greedy = [SamplingParams(temperature=0.0)] * 6  # the all-greedy shortcut, too
    tokens, logprobs = sample(logits.to(device), *params_tensors(greedy, device), positions.to(device))
    assert logprobs.device.type == device.type and tokens.tolist() == logits.argmax(-1).tolist()
    seeds = tensors[3]
    u = keyed_uniform(seeds, positions.to(device), STREAM_SAMPLE, 5)
    assert u.device.type == device.type
    assert torch.equal(u.cpu(), keyed_uniform(seeds.cpu(), positions, STREAM_SAMPLE, 5))


def test_same_key_same_token_other_key_other_draws():
    logits = torch.randn(1, 500).expand(400, 500)
    t, p, k = batch(400)
    same, _ = sample(logits, t, p, k, torch.full((400,), 9), torch.full((400,), 4))
    assert (same == same[0]).all()
    varied, _ = sample(logits, t, p, k, torch.arange(400), torch.full((400,), 4))
    assert varied.unique().numel() > 20


@pytest.mark.parametrize("scale", [0.0, 1.0, 3.0, 8.0])
def test_race_sample_has_the_law_of_probs(scale):
    """Head-only (peaked), mixed and tail-only (flat) rows, V not a multiple of the block size. α = 1e-3."""
    torch.manual_seed(1)
    vocab, n = 2001, 20_000  # uniform 1/2001 is below HEAD_MIN_PROB: scale 0 is all tail
    probs = torch.softmax(torch.randn(vocab) * scale, -1)
    if scale >= 3.0:  # a coarse support so that the test has power: keep the 40 most likely tokens
        probs = torch.where(probs >= probs.topk(40).values[-1], probs, 0.0)
        probs /= probs.sum()
        tokens = race_sample(probs.expand(n, vocab), torch.arange(n), torch.full((n,), 3))
        assert_distribution(tokens, probs)
    else:  # flat rows: test the law on 30 equal-mass groups of tokens
        tokens = race_sample(probs.expand(n, vocab), torch.arange(n), torch.full((n,), 3))
        groups = torch.bucketize(
            probs.double().cumsum(0), torch.linspace(0, 1, 31, dtype=torch.float64)[1:-1]
        )
        grouped = torch.zeros(30, dtype=torch.float64).index_add_(0, groups, probs.double())
        assert_distribution(groups[tokens], grouped)


def test_race_sample_planted_bias_is_detected():
    """The statistical check has power: a sampler that ignores 10% of the mass of token 0 fails."""
    probs = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    n = 40_000
    tokens = race_sample(probs.expand(n, 5), torch.arange(n), torch.zeros(n, dtype=torch.int64))
    assert_distribution(tokens, probs)
    biased = probs.clone()
    biased[0] *= 0.9
    biased /= biased.sum()
    stat, dof = chi2_statistic(tokens, biased)
    assert stat > chi2_critical(dof)


def test_keyed_pick_on_the_target_distribution_is_the_sampled_token():
    """Drawing with the sampler's own noise over the same distribution reproduces `sample` exactly when every
    token is in the race's head (p >= HEAD_MIN_PROB) and within the width."""
    torch.manual_seed(2)
    rows, vocab = 2000, 64
    logits = torch.randn(rows, vocab) * 0.3
    temperature = torch.full((rows,), 0.7)
    seeds, positions = torch.arange(rows), torch.arange(rows) % 37 + 5
    probs = processed_probs(logits, temperature, torch.ones(rows), torch.zeros(rows, dtype=torch.int64))
    assert probs.min() > HEAD_MIN_PROB
    tokens, _ = sample(
        logits, temperature, torch.ones(rows), torch.zeros(rows, dtype=torch.int64), seeds, positions
    )
    assert torch.equal(keyed_pick(logits, temperature, seeds, positions, width=vocab), tokens)
    # A draft vocabulary: logits over a subset of ids, picks mapped back to vocabulary ids.
    ids = torch.arange(vocab).flip(0)
    assert torch.equal(
        keyed_pick(logits[:, ids], temperature, seeds, positions, ids=ids, width=vocab), tokens
    )
    # Greedy rows take the argmax.
    greedy = keyed_pick(logits, torch.zeros(rows), seeds, positions)
    assert torch.equal(greedy, logits.argmax(-1))


def test_keyed_pick_guesses_the_draw_better_than_the_argmax():
    """A draft distribution near the target's (logits + noise): the keyed draw agrees with the target's
    sampled token about twice as often as the draft's argmax does (measured 0.66 vs 0.35)."""
    torch.manual_seed(3)
    rows, vocab = 4000, 5000
    logits = torch.randn(rows, vocab) * 3
    temperature = torch.full((rows,), 0.7)
    seeds, positions = torch.arange(rows), torch.full((rows,), 11)
    ones, zeros = torch.ones(rows), torch.zeros(rows, dtype=torch.int64)
    tokens, _ = sample(logits, temperature, ones, zeros, seeds, positions)
    draft = logits + torch.randn(rows, vocab) * 0.5
    keyed = (keyed_pick(draft, temperature, seeds, positions) == tokens).double().mean().item()
    argmax = (draft.argmax(-1) == tokens).double().mean().item()
    assert keyed > argmax + 0.2, (keyed, argmax)


def test_keyed_rank_puts_the_keyed_draw_first_and_keeps_the_values():
    torch.manual_seed(4)
    rows, vocab = 300, 1000
    logits = torch.randn(rows, vocab) * 2
    temperature = torch.full((rows,), 0.7)
    seeds, positions = torch.arange(rows), torch.arange(rows) + 3
    logprobs = torch.log_softmax(logits / 0.7, dim=-1)
    logprobs[:, 500:] = float("-inf")  # a draft vocabulary: the rest can never be drafted
    ranked = keyed_rank(logprobs, seeds, positions)
    pick = keyed_pick(logits[:, :500], temperature, seeds, positions)
    assert torch.equal(ranked.argmax(-1), pick)
    assert torch.equal(ranked.sort(-1).values, logprobs.sort(-1).values)  # the same values, re-dealt
    assert (ranked[:, 500:] == float("-inf")).all()


def test_keyed_exponential_is_the_tensor_race_noise():
    """The plain-Python noise (for drafters weighing a few candidates) is -log of `keyed_uniform`, bit for bit."""
    seeds = [0, 5, -3, 2**40 + 7]
    for seed in seeds:
        for position in (0, 17, 1000):
            u = keyed_uniform(torch.tensor([seed]), torch.tensor([position]), STREAM_SAMPLE, 300)[0]
            for token in (0, 1, 123, 299):
                assert keyed_exponential(seed, position, token) == -math.log(u[token].item())
