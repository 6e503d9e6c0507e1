"""A step's rollout metrics (rl/step.py): what speculation accepted, per batch-size bucket."""

from __future__ import annotations

import torch

from slipstream.protocols.reward import CallTotals
from slipstream.protocols.rollout import GenerateRequest, SamplingSpec
from slipstream.rl.step import StepMetrics, batch_bucket, deal_plan, pool_arm_tables


def test_a_step_reports_what_speculation_accepted_per_batch_bucket() -> None:
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 500)] == [
        "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17-32", "17-32", "33+", "33+",
    ]  # fmt: skip
    m = StepMetrics()
    m.add_iteration(1, "eagle:d3", 2)  # 3 tokens for one sequence: accept length 3
    m.add_iteration(1, "off", 0)  # plain iterations are not what speculation bought
    m.add_iteration(2, "ngram:d3", 1)
    m.add_iteration(4, "eagle:d3", 4)
    m.add_iteration(3, "eagle:d3", 0)
    m.add_iteration(12, "off", 0)
    m.add_iteration(0, "eagle:d3", 5)  # a prefill-only pass: nothing decoded
    assert m.speculated_accept_length() == {"1": 3.0, "2": 1.5, "3-4": round(1 + 4 / 7, 3)}
    assert m.iterations == 6 and m.arms == {"eagle:d3": 3, "off": 2, "ngram:d3": 1}
    assert m.accept_length == 1.0 + 7 / 23  # over every decoding sequence-iteration


def test_a_step_reports_decode_seconds_and_tokens_per_batch_bucket() -> None:
    """Where the rollout's time went by batch size, speculating or not (the long tail is the small buckets)."""
    m = StepMetrics()
    m.add_iteration(1, "off", 0, iter_s=0.05, committed=1)
    m.add_iteration(1, "eagle:d3", 2, iter_s=0.06, committed=3)
    m.add_iteration(12, "off", 0, iter_s=0.1, committed=12)
    m.add_iteration(3, "ngram:d3", 1, iter_s=0.07, committed=4)
    m.add_iteration(0, "off", 0, iter_s=0.4, committed=5)  # prefill only: not a decode iteration
    assert m.decode_seconds_by_batch() == {"1": [0.11, 4], "3-4": [0.07, 4], "9-16": [0.1, 12]}
    assert list(m.decode_seconds_by_batch()) == ["1", "3-4", "9-16"]  # bucket order, not arrival order


def test_a_step_reports_speculation_where_it_ran_and_the_share_of_tokens_it_decoded() -> None:
    """The step line's figures: the accept length over the iterations that speculated (the average over
    every iteration counts the tuner's plain ones as 1.0) and the share of tokens those committed."""
    m = StepMetrics()
    assert m.spec_accept_length == 0.0 and m.spec_token_share == 0.0  # nothing decoded yet
    m.add_iteration(16, "off", 0, committed=16)
    m.add_iteration(2, "hybrid:d3", 3, committed=5)
    m.add_iteration(1, "hybrid:d3", 2, committed=3)
    m.add_iteration(4, "off", 0, committed=4)
    assert m.spec_accept_length == 1.0 + 5 / 3
    assert m.spec_token_share == 8 / 28
    assert m.accept_length == 1.0 + 5 / 23  # diluted by the plain iterations


def test_a_step_sums_each_reward_terms_calls_over_the_verifiers_reports() -> None:
    m = StepMetrics()
    m.add_reward_calls({"judge": CallTotals(calls=2, samples=12, seconds=1.5, max_batch=8, invalid=1)})
    m.add_reward_calls(
        {
            "judge": CallTotals(calls=1, samples=4, seconds=0.5, max_batch=4, invalid=0),
            "exact": CallTotals(calls=16, samples=16, seconds=0.25, max_batch=1, invalid=0),
        }
    )
    assert m.reward_call_s == 2.25
    assert m.reward_terms() == {
        "exact": {
            "calls": 16,
            "samples": 16,
            "seconds": 0.25,
            "batch_mean": 1.0,
            "batch_max": 1,
            "invalid": 0,
        },
        "judge": {
            "calls": 3,
            "samples": 16,
            "seconds": 2.0,
            "batch_mean": 5.33,
            "batch_max": 8,
            "invalid": 1,
        },
    }
    assert StepMetrics().reward_terms() == {} and StepMetrics().reward_call_s == 0.0


def test_a_step_reports_each_arms_acceptance_drafting_cost_and_share_per_bucket() -> None:
    m = StepMetrics()
    m.add_iteration(1, "cascade:d8", accepted=6, iter_s=0.05, committed=7, drafted=8, draft_s=0.002)
    m.add_iteration(1, "cascade:d8", accepted=2, iter_s=0.05, committed=3, drafted=8, draft_s=0.002)
    m.add_iteration(1, "off", accepted=0, iter_s=0.04, committed=1)
    m.add_iteration(6, "off", accepted=0, iter_s=0.1, committed=6)
    table = m.arm_table()
    cascade = table["cascade:d8"]["1"]
    assert cascade["iterations"] == 2 and cascade["accept_length"] == 5.0  # 1 + 8 accepted / 2 sequences
    assert cascade["draft_ms_per_token"] == 0.25 and cascade["token_share"] == round(10 / 17, 4)
    assert cascade["tokens_per_s"] == 100.0 and table["off"]["5-8"]["token_share"] == round(6 / 17, 4)
    # Tables of several steps pool by their counts, not by averaging their ratios.
    other = StepMetrics()
    for _ in range(8):
        other.add_iteration(1, "cascade:d8", accepted=0, iter_s=0.05, committed=1, drafted=8, draft_s=0.002)
    pooled = pool_arm_tables([{"arm_table": table}, {"arm_table": other.arm_table()}, {}])
    assert pooled["cascade:d8"]["1"]["accept_length"] == 1.8 and pooled["cascade:d8"]["1"]["iterations"] == 10


def request(group_id: int) -> GenerateRequest:
    return GenerateRequest(group_id=group_id, prompt_ids=torch.tensor([group_id]), num_samples=4, seed=group_id,
                           sampling=SamplingSpec(max_tokens=8), policy_version=0)  # fmt: skip


def test_groups_go_where_their_prompt_was_decoded_when_that_costs_no_balance() -> None:
    rollouts = ["rollout:0", "rollout:1"]
    requests = [request(g) for g in range(8)]
    equal = lambda r: 1.0  # noqa: E731
    plain = deal_plan(requests, rollouts, equal, {})
    assert sorted(plain.values()) == ["rollout:0"] * 4 + ["rollout:1"] * 4
    homes = {g: rollouts[g < 4] for g in range(8)}  # another split than the plain deal's alternation
    assert deal_plan(requests, rollouts, equal, homes) == homes
    # Six prompts at home on one rollout: four stay (its fair share), the other two move.
    crowded = {g: "rollout:0" for g in range(6)}
    near = deal_plan(requests, rollouts, equal, crowded)
    assert sorted(near.values()) == ["rollout:0"] * 4 + ["rollout:1"] * 4
    assert sum(near[g] == "rollout:0" for g in range(6)) == 4
    # Unequal costs: affinity never ends above the plain deal's largest load.
    cost = lambda r: float(1 + r.group_id % 3)  # noqa: E731
    loads = lambda plan: [sum(cost(r) for r in requests if plan[r.group_id] == n) for n in rollouts]  # noqa: E731
    assert max(loads(deal_plan(requests, rollouts, cost, homes))) <= max(
        loads(deal_plan(requests, rollouts, cost, {}))
    )
    assert deal_plan(requests, rollouts, equal, {g: "rollout:9" for g in range(8)}) == plain  # a gone home
