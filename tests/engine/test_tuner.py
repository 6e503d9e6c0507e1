"""Tuner: a synthetic cost model in place of a model and a clock, so each bandit property is checked in
a fraction of a second and the "true best" arm is known in closed form.

The cost model (`CostModel`) is a caricature of one decode iteration at batch b with a chain of depth d:
the target pass costs max(1, verify_cost * b * (1 + d)) (latency-bound until the verified tokens fill the
device, then compute-bound), plus node_cost * b * d for a verify that is not free, plus draft_cost * b * d
for a drafter that runs a network (EAGLE's head; the n-gram lookup is free). Committed tokens: each
sequence accepts each draft token with probability `accept` until the first rejection or the end of the
chain, plus one bonus/correction token, so at batch 1 the count is the real skewed, bimodal accept length.
Iteration time carries lognormal noise (sigma 0.2). The tuner is driven exactly as the rollout actor
drives it: choose, run, record.

Bounds stated below were measured over 200 seeds with the default TunerConfig; the tests run fewer seeds,
fixed, so they are deterministic.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import dataclass

import msgspec
import pytest

from slipstream.engine.speculator import SpecConfig
from slipstream.engine.tuner import Arm, Decision, StaleDrafter, Tuner, TunerConfig, parse_arm
from slipstream.runtime.config import ConfigError, convert


@dataclass(frozen=True)
class ArmModel:
    accept: float = 0.0
    """Probability that each draft token is accepted (given its predecessors were)."""
    depth: int = 0
    """Chain length (0: plain decoding)."""
    draft_cost: float = 0.0
    """Seconds per draft token per sequence."""
    node_cost: float = 0.0
    """Seconds per verified draft node per sequence beyond the target pass."""

    def mean_tokens(self) -> float:
        return sum(self.accept**i for i in range(self.depth + 1))


@dataclass(frozen=True)
class CostModel:
    arms: dict[str, ArmModel]
    verify_cost: float = 0.06
    sigma: float = 0.2

    def mean_seconds(self, batch: int, arm: str) -> float:
        m = self.arms[arm]
        target = max(1.0, self.verify_cost * batch * (1 + m.depth))
        return target + (m.node_cost + m.draft_cost) * batch * m.depth

    def throughput(self, batch: int, arm: str) -> float:
        return batch * self.arms[arm].mean_tokens() / self.mean_seconds(batch, arm)

    def best(self, batch: int) -> str:
        return max(self.arms, key=lambda arm: self.throughput(batch, arm))

    def iteration(self, rng: random.Random, batch: int, arm: str) -> tuple[int, float]:
        """(committed tokens, seconds) of one iteration."""
        m = self.arms[arm]
        committed = batch
        if m.depth and m.accept > 0:
            log_accept = math.log(m.accept)
            for _ in range(batch):  # accepted drafts: geometric, cut at the chain's end
                committed += min(m.depth, int(math.log(1.0 - rng.random()) / log_accept))
        return committed, self.mean_seconds(batch, arm) * math.exp(rng.gauss(0.0, self.sigma))


# eagle deep wins at batch 1, ngram shallow at batch 4, plain decoding at batch 32 (gaps >= 25%)
MIXED = CostModel(
    {
        "off": ArmModel(),
        "ngram:d3": ArmModel(accept=0.7, depth=3),
        "ngram:d7": ArmModel(accept=0.7, depth=7),
        "eagle:d3": ArmModel(accept=0.9, depth=3, draft_cost=0.06),
        "eagle:d7": ArmModel(accept=0.9, depth=7, draft_cost=0.06),
    }
)
MIXED_BEST = {1: "eagle:d7", 4: "ngram:d3", 32: "off"}

# drafts rarely accepted and verification not free: every speculative arm loses at every batch size
LOSING = CostModel(
    {
        "off": ArmModel(),
        "ngram:d3": ArmModel(accept=0.2, depth=3, node_cost=0.25),
        "ngram:d7": ArmModel(accept=0.2, depth=7, node_cost=0.25),
        "eagle:d3": ArmModel(accept=0.3, depth=3, draft_cost=0.06, node_cost=0.25),
        "eagle:d7": ArmModel(accept=0.3, depth=7, draft_cost=0.06, node_cost=0.25),
    }
)

BATCHES = (1, 4, 32)


def drive(
    tuner: Tuner, model: CostModel, rng: random.Random, batch: int, available=None
) -> tuple[Decision, int, float]:
    """One iteration as the rollout actor runs it: choose, run, record."""
    decision = tuner.choose(batch, available)
    committed, seconds = model.iteration(rng, batch, decision.arm)
    tuner.record(batch, decision.arm, committed, seconds)
    return decision, committed, seconds


def decisions_until(
    tuner: Tuner, model: CostModel, rng: random.Random, batch: int, arm: str, limit: int
) -> int:
    """Iterations until `arm` is the tuner's exploit choice (limit if never)."""
    for n in range(1, limit):
        drive(tuner, model, rng, batch)
        if tuner.best(batch) == arm:
            return n
    return limit


def gap(model: CostModel, batch: int) -> float:
    """Throughput of the best arm over the runner-up's."""
    best, second = sorted((model.throughput(batch, arm) for arm in model.arms), reverse=True)[:2]
    return best / second


# ---------------------------------------------------------------------------------------------------------
# Learning


# Decisions (= iterations) per bucket after which the exploit choice is the true best in every bucket.
# Measured over 200 seeds: wrong somewhere in 13.5% of seeds at 100, 4% at 300, 2.5% at 600 — nearly all at
# batch 1, where one iteration commits a single accept length and a close runner-up can lead for a while.
# Re-measured 2026-11-26, 200 seeds at 300 (this test's cost model and seeds 1000+): 183 found with
# explorations held for `hold` iterations, 184 with explorations as looks of `hold` sequence-passes (one
# iteration at batch >= hold); 17 of this test's first 20 seeds, 35 of 40.
FIND_WITHIN = 300
SEEDS = 20
MIN_FOUND = 17


def test_cost_model_has_a_different_best_arm_per_bucket():
    assert {b: MIXED.best(b) for b in BATCHES} == MIXED_BEST
    assert all(gap(MIXED, b) > 1.25 for b in BATCHES)
    assert all(LOSING.best(b) == "off" and gap(LOSING, b) > 1.35 for b in BATCHES)


def test_finds_the_best_arm_of_each_bucket():
    found = 0
    efficiency = dict.fromkeys(BATCHES, 0.0)
    for seed in range(SEEDS):
        tuner = Tuner(TunerConfig(arms=list(MIXED.arms), seed=seed))
        rng = random.Random(1000 + seed)
        counts = dict.fromkeys(BATCHES, 0)
        tokens, seconds = dict.fromkeys(BATCHES, 0), dict.fromkeys(BATCHES, 0.0)
        chosen: dict[int, str | None] = {}
        while min(counts.values()) < 2 * FIND_WITHIN:
            batch = rng.choice(BATCHES)  # the live batch wanders between buckets, as in a rollout
            _, committed, took = drive(tuner, MIXED, rng, batch)
            counts[batch] += 1
            if counts[batch] == FIND_WITHIN:
                chosen[batch] = tuner.best(batch)
            elif counts[batch] > FIND_WITHIN:
                tokens[batch] += committed
                seconds[batch] += took
        found += chosen == MIXED_BEST
        for b in BATCHES:
            efficiency[b] += tokens[b] / seconds[b] / MIXED.throughput(b, MIXED_BEST[b]) / SEEDS
    assert found >= MIN_FOUND, f"best arm of every bucket found in {found} of {SEEDS} seeds"
    # It really learns: after the cold start, throughput is within epsilon's price of the best arm's
    # (measured over 200 seeds: 0.95 of the best arm's at each batch size).
    assert all(e > 0.85 for e in efficiency.values()), efficiency


# Measured over 200 seeds: at decision 300 off was the exploit choice in every bucket but one (batch 1, a
# lucky speculative arm that exploitation then corrected); the share of "off" over the next 400 decisions
# was at least 0.89 in every bucket (mean 0.96 at batch 1, where exploring is cheapest).
SETTLE_WITHIN = 300
OFF_WINDOW = 400  # decisions per bucket over which the share of "off" is measured after settling
SLACK = 0.05


def test_settles_on_off_where_every_speculative_arm_loses():
    spent, plain = dict.fromkeys(BATCHES, 0.0), dict.fromkeys(BATCHES, 0.0)
    for seed in range(10):
        config = TunerConfig(arms=list(LOSING.arms), seed=seed)
        tuner = Tuner(config)
        rng = random.Random(2000 + seed)
        counts = dict.fromkeys(BATCHES, 0)
        tail: dict[int, list[str]] = {b: [] for b in BATCHES}
        while min(counts.values()) < SETTLE_WITHIN + OFF_WINDOW:
            batch = rng.choice(BATCHES)
            decision, _, _ = drive(tuner, LOSING, rng, batch)
            counts[batch] += 1
            if counts[batch] == SETTLE_WITHIN:
                assert tuner.best(batch) == "off", (seed, batch, tuner.summary())
            elif SETTLE_WITHIN < counts[batch] <= SETTLE_WITHIN + OFF_WINDOW:
                tail[batch].append(decision.arm)
        for batch, arms in tail.items():
            share = arms.count("off") / len(arms)
            assert share >= 1 - config.epsilon - SLACK, (seed, batch, share)
            spent[batch] += sum(LOSING.mean_seconds(batch, arm) for arm in arms)
            plain[batch] += len(arms) * LOSING.mean_seconds(batch, "off")
    # In time, what exploring costs: at batch >= hold an exploration is one iteration (a look), not `hold` of
    # them. Throughput against "off" alone over these 10 seeds: 0.96 at batch 4 and 32 (0.91 and 0.89 when
    # explorations were held for `hold` iterations: 50 seeds); about 0.92 at batch 1 either way.
    for batch in BATCHES:
        if batch >= config.hold:
            assert plain[batch] / spent[batch] > 0.94, (batch, plain[batch] / spent[batch])


def test_arms_measured_at_different_batch_sizes_of_one_bucket_compare_per_sequence():
    """Bucket 9-16. "off" costs 50 + 2b ms for b tokens; ngram commits 1.1b tokens in 60 + 4b ms: slower
    at every batch size. Adversarial schedule: ngram is only ever measured at batch 16 (early in a rollout),
    off at batch 9 (late). Raw tokens/s would rank ngram first (17.6 / 0.124 = 142 against 9 / 0.068 =
    132); per sequence, off wins (14.7 against 8.9), as it does at any one batch size."""
    tuner = Tuner(TunerConfig(buckets=[1, 9, 17], arms=["off", "ngram:d3"], hold=1))
    for _ in range(8):
        tuner.record(16, "ngram:d3", 1.1 * 16, 0.060 + 0.004 * 16)
        tuner.record(9, "off", 9, 0.050 + 0.002 * 9)
    assert tuner.best(12) == "off"


def test_arms_measured_at_different_batch_sizes_compare_by_speedup_over_plain():
    """Bucket 5-8 on a CPU, where an iteration costs less at a smaller batch: plain decoding takes
    20 + 5b ms, and ngram commits 1.2b tokens in 1.3x that, a 0.92x speedup at every batch size. Adversarial
    schedule: ngram is only measured at batch 5, "off" in this bucket only at batch 8. Per sequence, ngram
    would win (1.2 / 0.0585 = 20.5 against 1 / 0.060 = 16.7); against the plain cost model, timed at the
    batch sizes "off" ran at anywhere in the rollout, it loses (0.92 against 1.0)."""

    def plain(b: int) -> float:
        return 0.020 + 0.005 * b

    tuner = Tuner(TunerConfig(buckets=[1, 2, 3, 5, 9, 17], arms=["off", "ngram:d3"], hold=1))
    for b in (1, 2, 3, 4, 12, 16):  # plain decoding timed in other buckets
        tuner.record(b, "off", b, plain(b))
    for _ in range(8):
        tuner.record(5, "ngram:d3", 1.2 * 5, 1.3 * plain(5))
        tuner.record(8, "off", 8, plain(8))
    assert tuner.best(6) == "off"
    assert tuner.estimate(6, "ngram:d3") == pytest.approx(1.2 / 1.3)
    assert tuner.estimate(6, "off") == pytest.approx(1.0)
    assert tuner.plain_seconds(5) == pytest.approx(plain(5))  # interpolated between batch 4 and 8
    # Without plain decoding timed at other sizes the reward is per sequence, and this schedule fools it.
    blind = Tuner(TunerConfig(buckets=[1, 2, 3, 5, 9, 17], arms=["off", "ngram:d3"], hold=1))
    for _ in range(8):
        blind.record(5, "ngram:d3", 1.2 * 5, 1.3 * plain(5))
        blind.record(8, "off", 8, plain(8))
    assert blind.best(6) == "ngram:d3"


def test_plain_cost_model_interpolates_and_extrapolates_with_a_non_negative_slope():
    tuner = Tuner(TunerConfig(arms=["ngram:d3"], hold=1))
    assert tuner.plain_seconds(4) is None
    tuner.record(4, "off", 4, 0.040)
    assert tuner.plain_seconds(1) == tuner.plain_seconds(16) == pytest.approx(0.040)  # one size: constant
    for seconds in (0.060, 0.062, 0.500):  # a median per size: one stray iteration does not move it
        tuner.record(8, "off", 8, seconds)
    assert tuner.plain_seconds(8) == pytest.approx(0.062)
    assert tuner.plain_seconds(6) == pytest.approx(0.051)
    assert tuner.plain_seconds(12) == pytest.approx(0.062 + 4 * 0.0055)  # the least-squares slope
    assert tuner.plain_seconds(1) == pytest.approx(0.040 - 3 * 0.0055)
    tuner.record(2, "off", 2, 0.090)  # noise that makes the fitted slope negative: held flat outside
    assert tuner.plain_seconds(20) == pytest.approx(0.062)
    tuner.record(1, "ngram:d3", 3, 0.045)
    assert tuner.plain_seconds(1) == pytest.approx(0.090)  # only "off" iterations time plain decoding
    steep = Tuner(TunerConfig(arms=["ngram:d3"], hold=1))
    steep.record(3, "off", 3, 0.010)
    steep.record(11, "off", 11, 0.090)
    assert steep.plain_seconds(1) == pytest.approx(0.005)  # floored at half the smallest size's time


def test_exploration_is_rationed_by_time_not_by_iterations():
    # At batch 32 every speculative arm takes 4-15x as long per iteration as plain decoding, so its turn
    # to be explored is taken with probability 1/k: far fewer explorations than epsilon of the decisions.
    tuner = Tuner(TunerConfig(arms=list(MIXED.arms), seed=0))
    rng = random.Random(0)
    decisions = [drive(tuner, MIXED, rng, 32)[0] for _ in range(4000)]
    explored = sum(d.why == "explore" for d in decisions) * tuner.config.hold
    assert explored / len(decisions) < tuner.config.epsilon / 2
    spent = sum(MIXED.mean_seconds(32, d.arm) for d in decisions[-2000:] if d.why != "untried")
    wasted = sum(MIXED.mean_seconds(32, d.arm) for d in decisions[-2000:] if d.arm != "off")
    assert wasted / spent < 1.5 * tuner.config.epsilon


# ---------------------------------------------------------------------------------------------------------
# Availability, non-stationarity, forgetting


def test_unavailable_methods_are_never_chosen_and_are_tried_once_available():
    tuner = Tuner(TunerConfig(arms=list(MIXED.arms), seed=3, epsilon=0.5))
    rng = random.Random(3)
    for available in ({"ngram"}, lambda method: method == "ngram", ()):
        for _ in range(300):
            decision, _, _ = drive(tuner, MIXED, rng, 1, available)
            assert not decision.arm.startswith("eagle")
            if available == ():
                assert decision.arm == "off" and decision.why == "forced"
    assert tuner.best(1, {"ngram"}) in ("ngram:d3", "ngram:d7")
    # a drafter exists now: the eagle arms are untried in this bucket, so they are played next
    first = tuner.choose(1)
    assert first.arm.startswith("eagle") and first.why == "untried"


# Decisions until an exploited arm that got worse is dropped: window / 2 fresh samples of hold iterations
# each (32), plus the sample in progress and the explorations in between. Measured over 300 seeds: 32 to
# 52, median 40.
ADAPT_WITHIN = 14 * 4


def test_follows_an_arm_that_gets_worse_within_about_half_a_window():
    good = CostModel({"off": ArmModel(), "ngram:d3": ArmModel(accept=0.7, depth=3)})
    bad = CostModel({"off": ArmModel(), "ngram:d3": ArmModel(accept=0.05, depth=3, node_cost=0.2)})
    assert good.best(4) == "ngram:d3" and bad.best(4) == "off"
    worst = 0
    for seed in range(20):
        tuner = Tuner(TunerConfig(arms=["ngram:d3"], seed=seed))
        rng = random.Random(seed)
        for _ in range(200):
            drive(tuner, good, rng, 4)
        assert tuner.best(4) == "ngram:d3"
        worst = max(worst, decisions_until(tuner, bad, rng, 4, "off", limit=10 * ADAPT_WITHIN))
    assert worst <= ADAPT_WITHIN, worst


def test_finds_an_arm_that_gets_better_by_exploration_and_at_once_after_forget():
    bad = CostModel({"off": ArmModel(), "eagle:d3": ArmModel(accept=0.1, depth=3, node_cost=0.2)})
    good = CostModel({"off": ArmModel(), "eagle:d3": ArmModel(accept=0.9, depth=3)})
    for use_forget in (False, True):
        tuner = Tuner(TunerConfig(arms=["eagle:d3"], seed=5))
        rng = random.Random(5)
        for _ in range(400):
            drive(tuner, bad, rng, 4)
        assert tuner.best(4) == "off"
        if use_forget:  # a new drafter version: its old rewards are stale
            assert tuner.forget("eagle") == 1
            assert tuner.estimate(4, "eagle:d3") is None
        n = decisions_until(tuner, good, rng, 4, "eagle:d3", limit=5000)
        hold = tuner.config.hold
        if use_forget:
            assert n <= 2 * hold  # the hold in progress, then one sample of the re-tried arm
        else:
            # Only exploration refreshes a window that is not exploited: window / 2 samples at a rate of
            # epsilon per decision, less for an arm slower than the best and less for one that pays less.
            # Measured over 300 seeds (2026-11-26, exploration thinned by the reward's share): median 596
            # decisions, 95th percentile 2025, at most 6631 (median 430, at most 1743 before).
            assert n <= 2000, n


# ---------------------------------------------------------------------------------------------------------
# Stale drafters

# MIXED with the EAGLE head collapsed (e.g. lagging a policy update): its drafts are never accepted
COLLAPSED = CostModel(
    MIXED.arms
    | {arm: ArmModel(accept=0.0, depth=d, draft_cost=0.06) for arm, d in (("eagle:d3", 3), ("eagle:d7", 7))}
)


def drive_drafts(
    tuner: Tuner, model: CostModel, rng: random.Random, batch: int
) -> tuple[Decision, StaleDrafter | None]:
    """One iteration as the rollout actor runs it, draft counts fed back too."""
    decision, committed, _ = drive(tuner, model, rng, batch)
    depth = model.arms[decision.arm].depth
    return decision, tuner.record_acceptance(decision.arm, batch, committed - batch, batch * depth)


def test_a_drafter_whose_acceptance_collapses_is_benched_while_off_and_ngram_still_run():
    tuner = Tuner(TunerConfig(arms=list(MIXED.arms), seed=4))
    rng = random.Random(4)
    for _ in range(300):
        _, stale = drive_drafts(tuner, MIXED, rng, rng.choice(BATCHES))
        assert stale is None
    assert tuner.best(1) == MIXED_BEST[1] == "eagle:d7" and tuner.stale() == {}
    eagle_runs, marks = 0, []
    for _ in range(1000):
        decision, stale = drive_drafts(tuner, COLLAPSED, rng, rng.choice(BATCHES))
        eagle_runs += decision.arm.startswith("eagle")
        marks += [stale] if stale is not None else []
        if marks:
            break
    # Reported once, after at most one window of eagle iterations since the collapse.
    assert marks and eagle_runs <= tuner.config.stale_window
    (mark,) = marks
    assert mark.method == "eagle" and mark.acceptance < 0.05 and mark.iterations == 32
    assert tuner.stale() == {"eagle": mark}
    chosen = Counter()
    for _ in range(2000):
        decision, stale = drive_drafts(tuner, COLLAPSED, rng, rng.choice(BATCHES))
        assert stale is None
        chosen[decision.arm] += 1
    assert not any(arm.startswith("eagle") for arm in chosen)
    assert {"off", "ngram:d3", "ngram:d7"} <= chosen.keys()
    assert all(s["best"] is None or not s["best"].startswith("eagle") for s in tuner.summary())


def test_a_new_drafter_revives_a_stale_method_and_its_arms_are_retried_at_once():
    tuner = Tuner(TunerConfig(arms=["ngram:d3", "eagle:d3", "hybrid:d3"], hold=1, stale_window=4))
    for arm in ("off", "ngram:d3", "eagle:d3", "hybrid:d3"):
        tuner.record(1, arm, 2, 1.0)
    for _ in range(4):
        tuner.record_acceptance("eagle:d3", 2, 0, 6)
    mark = tuner.stale()["eagle"]
    assert mark == StaleDrafter("eagle", 0.0, 4)
    assert tuner.refresh("ngram") is None and tuner.refresh("hybrid") is None  # neither is stale
    assert tuner.refresh("eagle") == mark and tuner.stale() == {}
    assert tuner.refresh("eagle") is None  # already cleared
    # Its rewards measured the collapsed head: gone, so the new head is tried first.
    assert tuner.estimate(1, "eagle:d3") is None and tuner.estimate(1, "ngram:d3") == 2.0
    assert tuner.choose(1) == Decision(1, 0, "1", "eagle:d3", "untried", None)
    # And it is judged on its own iterations: one more zero is not a full window.
    assert tuner.record_acceptance("eagle:d3", 2, 0, 6) is None
    for _ in range(3):
        stale = tuner.record_acceptance("eagle:d3", 2, 0, 6)
    assert stale is not None and tuner.forget("eagle") == 0 and tuner.stale() == {}  # forget clears it too


def test_a_window_not_yet_full_or_at_the_threshold_marks_nothing_and_ngram_is_never_judged():
    config = TunerConfig(
        arms=["ngram:d3", "eagle:d3", "hybrid:d3"], hold=1, stale_window=8, stale_accept=0.05
    )
    tuner = Tuner(config)
    assert tuner.record_acceptance("eagle:d3", 5, 2, 15) is None
    for _ in range(6):
        assert tuner.record_acceptance("eagle:d3", 5, 0, 15) is None
    assert tuner.record_acceptance("eagle:d3", 5, 0, 0) is None  # drafted nothing: not counted
    assert tuner.record_acceptance("off", 5, 0, 0) is None
    assert tuner.record_acceptance("eagle:d3", 5, 0, 15) is None  # full: 2 / 40 = 0.05, not below
    # Sliding: the accepted iteration leaves the window.
    assert tuner.record_acceptance("eagle:d3", 5, 0, 15) == StaleDrafter("eagle", 0.0, 8)
    assert tuner.record_acceptance("eagle:d3", 5, 0, 15) is None  # reported once
    for _ in range(100):
        assert tuner.record_acceptance("ngram:d3", 5, 0, 15) is None
        assert tuner.record_acceptance("hybrid:d3", 5, 1, 15) is None  # per method: hybrid accepts 0.2
    assert set(tuner.stale()) == {"eagle"}
    chosen = set()
    for _ in range(200):
        decision = tuner.choose(5, {"ngram", "eagle", "hybrid"})
        tuner.record(5, decision.arm, 5, 1.0)
        chosen.add(decision.arm)
    assert chosen == {"off", "ngram:d3", "hybrid:d3"}
    with pytest.raises(ValueError, match="accepted <= drafted"):
        tuner.record_acceptance("eagle:d3", 5, 16, 15)
    with pytest.raises(ValueError, match="batch_size"):
        tuner.record_acceptance("hybrid:d3", 0, 0, 15)
    with pytest.raises(ValueError, match="unknown arm"):
        tuner.record_acceptance("eagle:d6", 5, 0, 15)


def test_stale_marks_and_acceptance_windows_round_trip_and_older_state_has_none():
    config = TunerConfig(arms=["ngram:d3", "eagle:d3", "hybrid:d3"], stale_window=4)
    original = Tuner(config)
    for _ in range(4):
        original.record_acceptance("eagle:d3", 3, 0, 9)
    original.record_acceptance("hybrid:d3", 3, 0, 9)
    state = json.loads(json.dumps(original.state_dict()))
    restored = Tuner(config)
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    assert restored.stale() == original.stale() == {"eagle": StaleDrafter("eagle", 0.0, 4)}
    assert all(not restored.choose(3).arm.startswith("eagle") for _ in range(100))
    for _ in range(2):
        assert restored.record_acceptance("hybrid:d3", 3, 0, 9) is None
    assert restored.record_acceptance("hybrid:d3", 3, 0, 9) is not None  # the 4th, counting the saved one
    older = {k: v for k, v in state.items() if k not in ("acceptance", "stale")}
    fresh = Tuner(config)
    fresh.load_state_dict(older)
    assert fresh.stale() == {} and fresh.state_dict()["acceptance"] == {
        "eagle": [],
        "hybrid": [],
        "cascade": [],
    }


# ---------------------------------------------------------------------------------------------------------
# Persistence


def test_state_round_trip_through_json_gives_identical_decisions():
    config = TunerConfig(arms=list(MIXED.arms), seed=11)
    original = Tuner(config)
    rng = random.Random(11)
    for _ in range(150):
        drive(original, MIXED, rng, rng.choice(BATCHES))
    state = json.loads(json.dumps(original.state_dict()))
    restored = Tuner(msgspec.structs.replace(config, seed=999))  # the restored generator state wins
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict() | {"config": restored.state_dict()["config"]}
    assert restored.summary() == original.summary()
    rng_a, rng_b = random.Random(12), random.Random(12)
    for _ in range(300):
        batch = rng_a.choice(BATCHES)
        assert rng_b.choice(BATCHES) == batch
        a, _, _ = drive(original, MIXED, rng_a, batch)
        b, _, _ = drive(restored, MIXED, rng_b, batch)
        assert a == b


def test_load_refuses_state_of_other_buckets_or_arms():
    state = Tuner(TunerConfig(arms=["ngram:d3"])).state_dict()
    with pytest.raises(ValueError, match="buckets"):
        Tuner(TunerConfig(arms=["ngram:d3"], buckets=[1, 4])).load_state_dict(state)
    with pytest.raises(ValueError, match="arms"):
        Tuner(TunerConfig(arms=["ngram:d4"])).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        Tuner(TunerConfig(arms=["ngram:d3"])).load_state_dict(state | {"version": 0})


def test_version_1_state_loads_with_samples_at_their_bucket_edge():
    tuner = Tuner(TunerConfig(arms=["ngram:d3"], hold=2))
    tuner.record(5, "ngram:d3", 10, 0.5)  # the arm's first look (one iteration at batch >= hold)
    tuner.record(5, "ngram:d3", 10, 0.5)  # pending: half of a sample
    state = json.loads(json.dumps(tuner.state_dict()))
    state["version"] = 1
    del state["plain"]
    state["windows"][3][1] = [[3.0, 1.0]]  # version 1: (tokens per sequence, seconds)
    state["pending"] = [[p[:3] for p in pending] for pending in state["pending"]]
    restored = Tuner(TunerConfig(arms=["ngram:d3"], hold=2))
    restored.load_state_dict(state)
    assert restored.estimate(5, "ngram:d3") == 3.0
    restored.record(5, "off", 5, 0.25)
    restored.record(5, "off", 5, 0.25)
    # Version 1 (and 2) kept no iteration counts: a sample pooled the saving config's hold.
    assert restored.state_dict()["windows"][3][1] == [[3.0, 1.0, 5.0, 2]]
    restored.record(5, "ngram:d3", 10, 0.5)  # completes the restored pending sample: 2 iterations at 5
    assert restored.state_dict()["windows"][3][1][-1] == [4.0, 1.0, 5.0, 2]


def test_state_loads_into_a_shorter_window_keeping_the_newest_samples():
    long = Tuner(TunerConfig(arms=["ngram:d3"], window=8, hold=1, epsilon=0.0))
    for i in range(8):
        long.record(1, "off", i + 1, 1.0)
    short = Tuner(TunerConfig(arms=["ngram:d3"], window=2, hold=1, epsilon=0.0))
    short.load_state_dict(long.state_dict())
    assert short.estimate(1, "off") == 7.5


# ---------------------------------------------------------------------------------------------------------
# Config, arms, buckets


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"arms": ["off", "eagle:x3"]}, r"TunerConfig\.arms\[1\]: 'eagle:x3' is not an arm"),
        ({"arms": ["medusa:d3"]}, r"TunerConfig\.arms\[0\]"),
        ({"arms": ["ngram:k2d3"]}, r"TunerConfig\.arms\[0\]"),  # letters out of order
        ({"arms": ["eagle:d0"]}, r"TunerConfig\.arms\[0\]: 'eagle:d0': SpecConfig\.depth"),
        ({"arms": ["ngram:d4", "ngram"]}, r"TunerConfig\.arms\[1\]: 'ngram' repeats arms\[0\]"),
        ({"arms": ["eagle:d4k1v0", "eagle:d4"]}, r"TunerConfig\.arms\[1\]: 'eagle:d4' repeats"),
        ({"buckets": [1, 4, 4]}, r"TunerConfig\.buckets\[2\]: 4 must be an integer above buckets\[1\] = 4"),
        ({"buckets": [1, 8, 2]}, r"TunerConfig\.buckets\[2\]"),
        ({"buckets": [2, 4]}, r"TunerConfig\.buckets: must start at 1"),
        ({"buckets": []}, r"TunerConfig\.buckets: must start at 1"),
        ({"epsilon": 1.5}, r"TunerConfig\.epsilon: must lie in \[0, 1\]"),
        ({"epsilon": -0.1}, r"TunerConfig\.epsilon"),
        ({"window": 0}, r"TunerConfig\.window: must be an integer >= 1"),
        ({"min_trials": 0}, r"TunerConfig\.min_trials"),
        ({"window": 2, "min_trials": 3}, r"TunerConfig\.min_trials: 3 exceeds window \(2\)"),
        ({"hold": 0}, r"TunerConfig\.hold"),
        ({"stale_window": 0}, r"TunerConfig\.stale_window: must be an integer >= 1"),
        ({"stale_accept": -0.1}, r"TunerConfig\.stale_accept: must be a finite number >= 0"),
        ({"stale_accept": float("inf")}, r"TunerConfig\.stale_accept"),
        ({"stale_accept": True}, r"TunerConfig\.stale_accept"),
        ({"margin": -0.01}, r"TunerConfig\.margin: must lie in \[0, 1\)"),
        ({"margin": 1.0}, r"TunerConfig\.margin"),
        (
            {"arms": ["eagle:d3"], "max_batch": {"eagle:d5": 4}},
            r"TunerConfig\.max_batch: 'eagle:d5' is not one",
        ),
        ({"arms": ["eagle:d3"], "max_batch": {"off": 4}}, r"TunerConfig\.max_batch: off cannot be capped"),
        (
            {"arms": ["eagle:d3"], "max_batch": {"eagle:x": 4}},
            r"TunerConfig\.max_batch: 'eagle:x' is not an arm",
        ),
        (
            {"arms": ["eagle:d3"], "max_batch": {"eagle:d3": 0}},
            r"TunerConfig\.max_batch\['eagle:d3'\]: must be",
        ),
    ],
)
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        TunerConfig(**fields)


def test_config_from_yaml_values_is_checked_at_load():
    class Rollout(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        tuner: TunerConfig = msgspec.field(default_factory=TunerConfig)

    assert convert({"tuner": {"arms": ["eagle:d5"], "epsilon": 0.05}}, Rollout).tuner.epsilon == 0.05
    with pytest.raises(ConfigError, match=r"arms\[0\]: 'eagle:5' is not an arm"):
        convert({"tuner": {"arms": ["eagle:5"]}}, Rollout)
    with pytest.raises(ConfigError, match=r"tuner\.epsilonn: unknown field"):
        convert({"tuner": {"epsilonn": 0.1}}, Rollout)


def test_default_config_is_valid_and_off_is_always_an_arm():
    tuner = Tuner()
    assert [a.name for a in tuner.arms] == TunerConfig().arms
    without_off = Tuner(TunerConfig(arms=["eagle:d5", "ngram:d3"]))
    assert [a.name for a in without_off.arms] == ["off", "eagle:d5", "ngram:d3"]
    assert [a.name for a in Tuner(TunerConfig(arms=[])).arms] == ["off"]


@pytest.mark.parametrize(
    ("text", "arm"),
    [
        ("off", Arm("off", "off")),
        ("ngram", Arm("ngram:d4", "ngram", 4, 1, 0)),
        ("ngram:d3", Arm("ngram:d3", "ngram", 3, 1, 0)),
        ("eagle:d4k4v16", Arm("eagle:d4k4v16", "eagle", 4, 4, 16)),
        ("eagle:d4k1v0", Arm("eagle:d4", "eagle", 4, 1, 0)),
        ("eagle:d6v3", Arm("eagle:d6v3", "eagle", 6, 1, 3)),
        ("self:d7", Arm("self:d7", "self", 7, 1, 0)),
        ("hybrid:d5", Arm("hybrid:d5", "hybrid", 5, 1, 0)),
    ],
)
def test_arm_grammar_and_canonical_names(text, arm):
    assert parse_arm(text) == arm
    assert parse_arm(arm.name) == arm


def test_arm_spec_is_what_the_generator_takes():
    assert parse_arm("eagle:d4k4v16").spec("reproducible") == SpecConfig(
        method="eagle", depth=4, topk=4, verify=16, mode="reproducible"
    )
    assert parse_arm("off").spec() == SpecConfig(method="off")
    tuner = Tuner(TunerConfig(arms=["ngram:d3"]))
    assert tuner.arm("ngram:d3k1v0").spec().depth == 3
    with pytest.raises(ValueError, match="unknown arm 'eagle:d3'"):
        tuner.arm("eagle:d3")


def test_bucket_mapping_and_labels():
    tuner = Tuner()  # edges 1, 2, 3, 5, 9, 17
    expected = {1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 8: 3, 9: 4, 16: 4, 17: 5, 32: 5, 10_000: 5}
    assert {b: tuner.bucket(b) for b in expected} == expected
    assert [tuner.label(b) for b in range(6)] == ["1", "2", "3-4", "5-8", "9-16", "17+"]
    assert Tuner(TunerConfig(buckets=[1])).label(0) == "1+"
    for bad in (0, -3):  # no decodes, nothing to speculate: a caller bug, not bucket 0
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            tuner.choose(bad)
        with pytest.raises(ValueError, match="batch_size"):
            tuner.record(bad, "off", 1, 1.0)


# ---------------------------------------------------------------------------------------------------------
# Decisions, records, summary


def test_hold_keeps_an_arm_for_that_many_iterations_and_pools_them_into_one_sample():
    tuner = Tuner(TunerConfig(arms=["ngram:d3", "eagle:d3"], hold=3, seed=0))
    decisions = []
    for _ in range(30):
        d = tuner.choose(1)  # at batch 1 a first look spans hold iterations too
        tuner.record(1, d.arm, 3, 2.0)
        decisions.append(d)
    for start in range(0, 30, 3):
        run = decisions[start : start + 3]
        assert len({d.arm for d in run}) == 1
        assert [d.why for d in run][1:] == ["hold", "hold"] and run[0].why != "hold"
    assert [d.why for d in decisions[:9:3]] == ["untried"] * 3
    arms = tuner.summary()[0]["arms"]
    assert sum(a["trials"] for a in arms.values()) == 10  # 30 iterations, 3 per sample
    assert all(a["seconds"] == 2.0 for a in arms.values() if a["trials"])  # per iteration
    assert all(sample[1:] == [6.0, 1.0, 3] for w in tuner.state_dict()["windows"][0] for sample in w)


def test_an_arms_first_look_in_a_bucket_spans_hold_sequence_passes_then_hold_iterations():
    tuner = Tuner(TunerConfig(arms=["ngram:d3", "eagle:d3"], hold=4, epsilon=0.0))
    slow = {"off": 1.0, "ngram:d3": 3.0, "eagle:d3": 3.0}  # seconds a pass; each commits one token a row
    decisions = []
    for _ in range(7):
        d = tuner.choose(8)
        tuner.record(8, d.arm, 8, slow[d.arm])
        decisions.append((d.arm, d.why))
    # At batch 8 one iteration spans 4 sequence-passes: one each for the cold start (not 4 of each loser),
    # then the winner, held 4 iterations.
    assert decisions == [
        ("off", "untried"),
        ("ngram:d3", "untried"),
        ("eagle:d3", "untried"),
        ("off", "exploit"),
        ("off", "hold"),
        ("off", "hold"),
        ("off", "hold"),
    ]
    assert [a["trials"] for a in tuner.summary()[3]["arms"].values()] == [2, 1, 1]
    tuner.forget("eagle")  # a re-try after forget is a first look again
    d = tuner.choose(8)
    assert (d.arm, d.why) == ("eagle:d3", "untried")
    tuner.record(8, d.arm, 8, 3.0)
    assert tuner.choose(8).why == "exploit"
    # At batch 2 a first look takes two iterations, pooled into one sample.
    runs = [tuner.choose(2) for _ in range(2)]
    assert [(d.arm, d.why) for d in runs] == [("off", "untried"), ("off", "hold")]
    tuner.record(2, "off", 2, 1.0)
    assert tuner.estimate(2, "off") is None
    tuner.record(2, "off", 2, 1.0)
    assert tuner.estimate(2, "off") == 1.0 and tuner.state_dict()["windows"][1][0] == [[2.0, 2.0, 2.0, 2]]


def test_an_exploration_is_a_look_too_one_iteration_at_a_large_batch_then_back_to_the_best():
    tuner = Tuner(TunerConfig(arms=["ngram:d3"], hold=4, epsilon=0.5, seed=0))
    slow = {"off": 1.0, "ngram:d3": 1.0}  # equally fast: an exploration is never refused for its cost
    decisions = []
    for _ in range(40):
        d = tuner.choose(8)
        tuner.record(8, d.arm, 8 if d.arm == "off" else 4, slow[d.arm])  # ngram commits half as much
        decisions.append((d.arm, d.why))
    assert decisions[:2] == [("off", "untried"), ("ngram:d3", "untried")]
    explored = [i for i, (_, why) in enumerate(decisions) if why == "explore"]
    assert explored and all(decisions[i][0] == "ngram:d3" for i in explored)
    # Each exploration is one iteration (4 sequence-passes at batch 8), not `hold` of them: the next decision
    # is a fresh one (an exploit, then held as exploits are, or another exploration), never a hold of it.
    assert all(decisions[i + 1][1] in ("exploit", "explore") for i in explored if i + 1 < len(decisions))
    assert ("off", "hold") in decisions  # exploits are still held
    ngram = tuner.state_dict()["windows"][3][1]
    assert all(sample[3] == 1 for sample in ngram)  # samples of one iteration each


def test_record_ignores_a_clock_that_did_not_move_and_checks_its_arguments():
    tuner = Tuner(TunerConfig(arms=["ngram:d3"], hold=1))
    tuner.record(1, "ngram:d3", 5, 0.0)
    tuner.record(1, "ngram:d3", 5, -1.0)
    assert tuner.estimate(1, "ngram:d3") is None
    tuner.record(1, "ngram:d3", 5, 0.5)
    assert tuner.estimate(1, "ngram:d3") == 10.0
    with pytest.raises(ValueError, match="committed_tokens"):
        tuner.record(1, "ngram:d3", -1, 0.5)
    with pytest.raises(ValueError, match="unknown arm"):
        tuner.record(1, "eagle:d3", 1, 0.5)


def test_untried_arms_are_ordered_by_the_neighbouring_bucket():
    tuner = Tuner(TunerConfig(arms=["ngram:d3", "eagle:d3", "eagle:d6"], hold=1))
    for arm, rate in (("off", 1.0), ("ngram:d3", 1.5), ("eagle:d3", 2.0), ("eagle:d6", 3.0)):
        tuner.record(2, arm, rate, 1.0)  # bucket "2" is measured; bucket "1" is not
    order = []
    for _ in range(4):
        d = tuner.choose(1)
        assert d.why == "untried"
        order.append(d.arm)
        tuner.record(1, d.arm, 1, 1.0)
    assert order == ["eagle:d6", "eagle:d3", "ngram:d3", "off"]


def test_decisions_are_deterministic_given_the_seed_and_log_as_json():
    runs = []
    for _ in range(2):
        tuner = Tuner(TunerConfig(arms=list(MIXED.arms), seed=7))
        rng = random.Random(7)
        runs.append([drive(tuner, MIXED, rng, rng.choice(BATCHES))[0] for _ in range(200)])
    assert runs[0] == runs[1]
    assert {d.why for d in runs[0]} == {"untried", "exploit", "explore", "hold"}
    logged = json.loads(json.dumps([d.as_dict() for d in runs[0]]))
    assert set(logged[0]) == {"batch_size", "bucket", "label", "arm", "why", "estimate"}
    summary = json.loads(json.dumps(tuner.summary()))
    assert [s["bucket"] for s in summary] == ["1", "2", "3-4", "5-8", "9-16", "17+"]
    assert summary[0]["best"] == tuner.best(1) and summary[1]["best"] is None


def test_forget_only_touches_that_method():
    tuner = Tuner(TunerConfig(arms=["ngram:d3", "eagle:d3"], hold=1))
    for arm in ("off", "ngram:d3", "eagle:d3"):
        tuner.record(1, arm, 2, 1.0)
        tuner.record(8, arm, 2, 1.0)
    assert tuner.forget("eagle") == 2
    assert tuner.estimate(1, "eagle:d3") is None and tuner.estimate(8, "eagle:d3") is None
    assert tuner.estimate(1, "ngram:d3") == 2.0 and tuner.estimate(1, "off") == 2.0
    assert tuner.choose(1) == Decision(1, 0, "1", "eagle:d3", "untried", None)


def test_a_speculating_arm_is_exploited_only_if_it_beats_off_by_the_margin():
    """One look at an arm that about breaks even (here 1.02x plain) settled a long-tail run's 9-16 bucket on
    an EAGLE chain that cost 2.8 plain iterations a pass (docs/training.md); with a margin it stays on off,
    and an arm that clearly pays is still exploited."""

    def settle(margin: float, speedup: float) -> str | None:
        tuner = Tuner(TunerConfig(arms=["off", "eagle:d3"], hold=1, epsilon=0.0, margin=margin))
        for _ in range(3):
            tuner.record(12, "off", 12, 0.080)
            tuner.record(12, "eagle:d3", 12 * speedup, 0.080)
        return tuner.best(12)

    assert settle(0.0, 1.02) == "eagle:d3"
    assert settle(0.05, 1.02) == "off"
    assert settle(0.05, 1.3) == "eagle:d3"
    tuner = Tuner(TunerConfig(arms=["off", "eagle:d3"], hold=1, epsilon=0.0, margin=0.05))
    for _ in range(3):
        tuner.record(12, "off", 12, 0.080)
        tuner.record(12, "eagle:d3", 12.24, 0.080)
    assert tuner.choose(12).arm == "off" and tuner.estimate(12, "eagle:d3") == pytest.approx(1.02)


def test_an_arm_is_offered_only_up_to_its_max_batch():
    """A capped arm is never chosen (not even looked at) above its cap: past batch ~4 on a CPU core every look
    at a speculating arm loses (docs/training.md); below the cap the bandit runs as before."""
    tuner = Tuner(TunerConfig(arms=["off", "eagle:d3", "ngram:d3"], hold=1, max_batch={"eagle:d3": 4}))
    chosen: dict[int, set[str]] = {4: set(), 5: set(), 16: set()}
    for _ in range(200):
        for batch in chosen:
            arm = tuner.choose(batch).arm
            chosen[batch].add(arm)
            tuner.record(batch, arm, batch * (2.0 if arm == "eagle:d3" else 1.0), 0.05)
    assert chosen[4] == {"off", "eagle:d3", "ngram:d3"}
    assert chosen[5] == chosen[16] == {"off", "ngram:d3"}
    assert tuner.best(4) == "eagle:d3" and tuner.best(5) in ("off", "ngram:d3")
    only_off = Tuner(TunerConfig(arms=["off", "eagle:d3"], max_batch={"eagle:d3": 2}))
    assert only_off.choose(3) == Decision(3, 2, "3-4", "off", "forced", None)


def test_arms_wider_than_the_captured_node_bucket_are_not_offered() -> None:
    """On the fixed-shape path (CUDA graphs) a verify pass holds at most the largest captured node bucket a
    row: an arm drafting more would be cut and measured as another arm, so it is never offered."""
    tuner = Tuner(TunerConfig(arms=["off", "eagle:d3", "ngram:d7", "eagle:d5k4v24"], hold=1, seed=1))

    def chosen(batches: tuple[int, ...]) -> set[str]:
        arms = set()
        for _ in range(80):
            for batch in batches:
                arm = tuner.choose(batch).arm
                arms.add(arm)
                tuner.record(batch, arm, batch * 1.5, 0.05)
        return arms

    assert tuner.limit_nodes(8) == ["eagle:d5k4v24"]
    assert chosen((1, 4, 16)) == {"off", "eagle:d3", "ngram:d7"}
    assert tuner.limit_nodes(4) == ["ngram:d7", "eagle:d5k4v24"]
    assert chosen((2, 8)) == {"off", "eagle:d3"}
    assert tuner.limit_nodes(None) == []  # the dynamic path: no limit
    assert "eagle:d5k4v24" in chosen((1,))


def test_a_fixed_shape_generator_says_its_captured_nodes(make_checkpoint) -> None:  # type: ignore[no-untyped-def]
    import torch

    from slipstream.engine.generator import Generator
    from slipstream.engine.weights import load_model

    model = load_model(make_checkpoint("llama", seed=3), dtype=torch.float32)
    assert Generator(model, num_slots=2, max_len=64, max_draft=5, static=True).max_nodes == 8
    assert Generator(model, num_slots=2, max_len=64, max_draft=40, static=True).max_nodes == 16
    assert Generator(model, num_slots=2, max_len=64, max_draft=40, static=False).max_nodes is None
