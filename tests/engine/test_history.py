"""Drafts from the run's own history (engine/history.py, engine/drafters/suffix.py).

The store: bounded per prompt and in total (oldest out), versions hidden from the step that sampled them,
saved and loaded as msgspec. The drafter: the longest match wins, measured backwards past the n-gram it was
found by; the draft grows with the match; history alone, or with the group's siblings. Lossless as every
arm: greedy and reproducible decoding are token-identical with the history arms on and off, and in
rejection mode the law of plain sampling holds (a chi-square test that also rejects a planted bug). A
drafter replaying a run's own outputs is accepted whole: a bug in its draft path shows as rejections.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from slipstream.engine import verify
from slipstream.engine.drafters import Draft, Drafter, DraftState, HybridDrafter, NGramDrafter, SuffixDrafter
from slipstream.engine.generator import Generator, Request
from slipstream.engine.history import History, prompt_key
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.weights import load_model
from tests.engine.test_sampling import chi2_critical, chi2_statistic
from tests.engine.test_spec_lossless import (
    LAW_ALPHA,
    SETTINGS,
    SMALL,
    assert_accounting,
    assert_same_output,
    exact_law,
    repetitive_requests,
    run,
    sampling_params,
)
from tests.engine.test_spec_lossless import (
    PROMPT as LAW_PROMPT,
)

PROMPT = [50, 51, 52, 53]
GREEDY = SamplingParams(temperature=0.0)


def state(rid: str, gid: object, tokens: list[int], prompt_len: int = 4, params: SamplingParams = GREEDY,
          keyed: bool = False) -> DraftState:  # fmt: skip
    return DraftState(request_id=rid, group_id=gid, tokens=tokens, prompt_len=prompt_len, params=params,
                      keyed=keyed)  # fmt: skip


# -- the store ---------------------------------------------------------------------------------------------


def test_the_store_keeps_responses_per_prompt_bounded_and_hides_the_step_that_sampled_them() -> None:
    h = History(per_prompt=3, max_tokens=10_000, n=2, tail=2)
    key, other = prompt_key(PROMPT), prompt_key([1, 2])
    assert key == prompt_key(torch.tensor(PROMPT).tolist()) and key != other
    for version in range(5):
        h.add(key, version, PROMPT, [version, 7, 8])
    assert h.responses(key) == [[2, 7, 8], [3, 7, 8], [4, 7, 8]]  # three a prompt: the oldest went
    assert h.responses(key, before=4) == [[2, 7, 8], [3, 7, 8]] and h.visible(key, 3) == 1
    # Each occurrence is the response after the prompt's last two tokens, newest first, and only from
    # versions before the one asking.
    # (Responses lie one after another in the prompt's text; each occurrence says where its own lies.)
    found = [(text[pos], list(text[lo:hi])) for text, pos, lo, hi in h.occurrences(key, (52, 53), before=10)]
    assert found == [(4, [52, 53, 4, 7, 8]), (3, [52, 53, 3, 7, 8]), (2, [52, 53, 2, 7, 8])]
    assert list(h.occurrences(key, (7, 8), before=10)) == []  # nothing follows a response's last tokens
    assert [text[pos] for text, pos, _, _ in h.occurrences(key, (52, 53), before=4)] == [3, 2]
    assert list(h.occurrences(other, (7, 8), before=10)) == [] and list(h.occurrences(key, (52,), 10)) == []
    # The total bound drops the oldest responses anywhere.
    h.max_tokens = 12
    h.add(other, 5, [1, 2], [9, 9, 9])
    assert h.tokens <= 12 and h.responses(other) == [[9, 9, 9]] and len(h.responses(key)) == 1
    assert h.stats()["evicted"] == 4
    with pytest.raises(ValueError, match=r"History\.n must be >= 1"):
        History(n=0)
    # Evicted responses leave the chains: after many, what is kept is found, and only that.
    churn = History(per_prompt=2, n=2, tail=0)
    for version in range(50):
        churn.add(key, version, PROMPT, [1, 2, version])
    assert [text[pos] for text, pos, _, _ in churn.occurrences(key, (1, 2), before=99)] == [49, 48]
    assert len(churn._prompts[key].text) <= 4 * 3  # re-packed as the dead outweighed the live


def test_the_store_is_journaled_and_a_successor_replays_it(tmp_path: Path) -> None:
    """Every response is appended to the journal as it is added: a process killed at any point leaves a
    file its successor replays (a record cut short ends the replay); a resume drops what it redoes."""
    path = tmp_path / "history" / "rollout-0.journal"
    h = History(tail=3)
    assert h.open_journal(path) == (0, 0)
    for version, key in enumerate(["a", "b", "a", "c"]):
        h.add(key, version, [1, 2, 3, 4], [10 + version, 20, 30])
    back = History(tail=3)
    assert back.open_journal(path) == (4, 0) and back.stats() == h.stats()
    assert back.responses("a") == h.responses("a") == [[10, 20, 30], [12, 20, 30]]
    assert back.drop_from(2) == 2 and back.responses("a") == [[10, 20, 30]] and "c" not in back
    assert History(tail=3).open_journal(path)[0] == 2  # the drop was written through
    back.close()
    with path.open("ab") as f:  # a kill in the middle of a record's write
        f.write((100).to_bytes(4, "little") + b"\x94\xa1a")
    cut = History(tail=3)
    assert cut.open_journal(path) == (2, 7) and cut.responses("a") == [[10, 20, 30]]
    assert History(tail=3).open_journal(path) == (2, 0)  # rewritten without the broken record


# -- the drafter ------------------------------------------------------------------------------------------


def test_the_longest_match_wins_measured_past_the_ngram_it_was_found_by() -> None:
    h = History(n=2, tail=0)
    key = prompt_key(PROMPT)
    h.add(key, 0, PROMPT, [1, 2, 3, 4, 5, 6])  # "... 2 3" then 4
    h.add(key, 1, PROMPT, [9, 2, 3, 7, 8, 6])  # "9 2 3" then 7: matches the request's "9 2 3"
    h.add(key, 2, PROMPT, [0, 2, 3, 4, 4, 4])
    drafter = SuffixDrafter(h, max_extend=8)
    (draft,) = drafter.propose([state("r", 0, [*PROMPT, 9, 2, 3])], depth=3, topk=1, verify=8)
    assert draft.tokens.tolist() == [7, 8, 6]  # the 2-gram occurs thrice; "9 2 3" once: it alone votes
    (short,) = drafter.propose([state("s", 1, [*PROMPT, 5, 2, 3])], depth=3, topk=1, verify=8)
    # Only the 2-gram matches: all three vote (4 twice, then a tie: the newest), as long as the match (2).
    assert short.tokens.tolist() == [4, 4]


def test_the_draft_grows_with_the_match_and_stops_at_the_arms_depth() -> None:
    h = History(n=3, tail=4)
    key = prompt_key(PROMPT)
    response = list(range(100, 140))
    h.add(key, 0, PROMPT, response)
    drafter = SuffixDrafter(h, max_extend=64, growth=0.5)
    for generated in (2, 8, 20):
        (draft,) = drafter.propose([state(f"r{generated}", 0, [*PROMPT, *response[:generated]])], depth=16,
                                   topk=1, verify=16)  # fmt: skip
        matched = 4 + generated  # the prompt's tail is stored before the response
        assert draft.tokens.tolist() == response[generated : generated + min(16, round(0.5 * matched))]


def test_history_alone_or_with_the_siblings_and_the_step_that_sampled_it_unseen() -> None:
    h = History(n=2, tail=4)
    key = prompt_key(PROMPT)
    h.add(key, 0, PROMPT, [1, 2, 3, 4])
    h.add(key, 1, PROMPT, [6, 6, 5, 5])  # this step's own: not history for a group sampled at version 1
    drafter = SuffixDrafter(h)
    drafter.attach("g", key, before=1)
    drafter.observe(state("a", "g", [*PROMPT, 7, 8, 9, 10]))  # a sibling
    asked = [
        state("b", "g", [*PROMPT, 1, 2]),
        state("c", "g", [*PROMPT, 7, 8]),
        state("d", "g", [*PROMPT, 6, 6]),
    ]
    history = drafter.propose(asked, depth=2, topk=1, verify=8)
    assert [d.tokens.tolist() for d in history] == [[3, 4], [], []]
    both = drafter.with_siblings.propose(asked, depth=2, topk=1, verify=8)
    assert [d.tokens.tolist() for d in both] == [[3, 4], [9, 10], []]
    drafter.reset_group("g")  # unattached: all of the prompt's history
    (late,) = drafter.propose([state("e", "g", [*PROMPT, 6, 6])], depth=2, topk=1, verify=8)
    assert late.tokens.tolist() == [5, 5]


class _Head(Drafter):
    """A stand-in EAGLE head: drafts 99s."""

    def propose(self, states, depth, topk, verify):  # type: ignore[no-untyped-def]
        return [Draft.chain([99] * min(depth, verify)) for _ in states]


def test_the_cascade_asks_the_head_only_where_history_and_siblings_have_nothing() -> None:
    h = History(n=2, tail=4)
    h.add(prompt_key(PROMPT), 0, PROMPT, [1, 2, 3, 4])
    suffix = SuffixDrafter(h)
    cascade = HybridDrafter(suffix.with_siblings, _Head())
    drafts = cascade.propose([state("a", 0, [*PROMPT, 1, 2]), state("b", 0, [*PROMPT, 8, 8])], 2, 1, 8)
    assert [d.tokens.tolist() for d in drafts] == [[3, 4], [99, 99]]
    # A long arm drafts long from a match, the head only `head_depth` (its later tokens rarely pay).
    capped = HybridDrafter(suffix.with_siblings, _Head(), head_depth=1)
    drafts = capped.propose([state("c", 0, [*PROMPT, 1, 2]), state("d", 0, [*PROMPT, 8, 8])], 8, 1, 8)
    assert [d.tokens.tolist() for d in drafts] == [[3, 4], [99]]
    # A short match is weak evidence: below `head_below` tokens the head drafts (history alone still does).
    suffix.observe(state("s", 0, [*PROMPT, 8, 5, 6, 9]))
    weak = state("w", 0, [*PROMPT, 7, 5, 6])  # matches "5 6" only: 2 tokens
    assert [d.tokens.tolist() for d in cascade.propose([weak], 2, 1, 8)] == [[99, 99]]
    assert [d.tokens.tolist() for d in suffix.draft([weak], 2, 1, 8, siblings=True)] == [[9]]


def test_keyed_rows_follow_the_race_over_the_history_counts() -> None:
    """Where earlier responses diverge after the match, a keyed row's chain follows the branch its own noise
    picks with the counts as the distribution (as the n-gram drafter's does): across seeds both branches."""
    h = History(n=2, tail=0)
    key = prompt_key(PROMPT)
    for cont in ([3, 5], [3, 5], [4, 6]):
        h.add(key, 0, PROMPT, [1, 2, *cont])
    drafter = SuffixDrafter(h)
    firsts = set()
    for seed in range(64):
        params = SamplingParams(temperature=0.7, seed=seed)
        (draft,) = drafter.propose(
            [state(f"q{seed}", 0, [*PROMPT, 1, 2], params=params, keyed=True)], 2, 1, 8
        )
        assert draft.tokens.tolist() in ([3, 5], [4, 6])
        firsts.add(draft.tokens.tolist()[0])
    assert firsts == {3, 4}


# -- lossless, end to end ------------------------------------------------------------------------------


def history_of(requests: list[Request], completions: list) -> History:
    """A history holding, for each prompt, the responses of an earlier decode of the same requests."""
    h = History()
    for request, completion in zip(requests, completions, strict=True):
        h.add(prompt_key(request.prompt_ids), 0, request.prompt_ids, completion.token_ids)
    return h


def test_greedy_and_reproducible_decoding_are_token_identical_with_the_history_arms(make_checkpoint) -> None:
    model = load_model(make_checkpoint("llama", seed=11), dtype=torch.float64)
    moved = load_model(make_checkpoint("llama", seed=11, initializer_range=0.16), dtype=torch.float64)
    for params in (
        lambda rng, i: SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 32)),
        sampling_params,
    ):
        requests = repetitive_requests(64, seed=7, params=params)
        reference, _ = run(model, requests)
        # An earlier epoch: the same prompts decoded by a policy since moved (another model) with other seeds.
        earlier, _ = run(
            moved, [replace(r, params=replace(r.params, seed=r.params.seed + 99)) for r in requests]
        )
        for method, shape in (
            ("history", {"depth": 6}),
            ("cascade", {"depth": 4}),
            ("history", {"depth": 4, "topk": 3, "verify": 8}),
        ):
            h = history_of(requests, earlier)
            drafters: dict[str, Drafter] = {"history": SuffixDrafter(h), "eagle": NGramDrafter()}
            spec = SpecConfig(method=method, mode="reproducible", **shape)
            completions, stats = run(model, requests, spec=spec, drafters=drafters)
            assert_same_output(completions, reference, logprob_atol=1e-6)
            assert_accounting(completions, stats)
            assert stats["accepted"] > 0 and stats["drafted"] > stats["accepted"], (method, shape)


def test_rejection_mode_keeps_the_law_of_plain_sampling_with_history_drafts(
    make_checkpoint, monkeypatch
) -> None:
    model = load_model(make_checkpoint("llama", seed=2, **SMALL), dtype=torch.float64)
    params = SETTINGS["top-k"]
    exact = exact_law(model, params)
    # A history the target disagrees with: responses made of the tokens it likes least after the prompt, so
    # drafts are offered at every position and often rejected (the residual correction matters).
    probs = exact.view(8, 8).sum(0)
    unlikely = probs.argsort()[:3].tolist()
    h = History(n=1, tail=3)
    rng = random.Random(0)
    for _ in range(12):
        h.add(prompt_key(LAW_PROMPT), 0, LAW_PROMPT, [rng.choice(unlikely) for _ in range(6)])

    def samples(n: int) -> torch.Tensor:
        requests = [Request(request_id=str(i), prompt_ids=LAW_PROMPT, params=replace(params, seed=i, max_tokens=4))
                    for i in range(n)]  # fmt: skip
        gen = Generator(model, num_slots=64, token_budget=512, eos_token_ids=(),
                        spec=SpecConfig(method="history", depth=2, mode="rejection"),
                        drafters={"history": SuffixDrafter(h, growth=4.0)})  # fmt: skip
        tokens = torch.tensor([c.token_ids[1:3] for c in gen.generate(requests)])
        assert 0 < gen.stats["accepted"] < gen.stats["drafted"]
        return tokens[:, 0] * 8 + tokens[:, 1]

    stat, dof = chi2_statistic(samples(4000), exact)
    critical = chi2_critical(dof, LAW_ALPHA)
    assert stat < critical, f"history drafts broke the law: chi2 {stat:.1f} >= {critical:.1f}"
    monkeypatch.setattr(verify, "_residual", lambda q, *rest: q.clone())  # planted: no residual resampling
    stat = chi2_statistic(samples(4000), exact)[0]
    assert stat > critical, f"the test missed the planted bug: chi2 {stat:.1f} < {critical:.1f}"


def test_a_history_of_the_same_outputs_is_accepted_whole(make_checkpoint) -> None:
    """Greedy requests decoded once, then again with their own outputs as history: every draft is right, so
    a bug in the history's draft path (a shifted continuation, a wrong prompt key, a hidden version) shows
    as rejections or as no drafts."""
    model = load_model(make_checkpoint("llama", seed=11), dtype=torch.float64)
    requests = [Request(request_id=f"r{i}", prompt_ids=[i + 1, 2 * i + 3, 5], group_id=f"g{i}",
                        params=SamplingParams(temperature=0.0, max_tokens=24)) for i in range(8)]  # fmt: skip
    first, plain = run(model, requests)
    h = history_of(requests, first)
    drafter = SuffixDrafter(h, growth=2.0)
    for r in requests:
        drafter.attach(r.group_id, prompt_key(r.prompt_ids), before=1)
    again, stats = run(
        model, requests, spec=SpecConfig(method="history", depth=8), drafters={"history": drafter}
    )
    assert_same_output(again, first, logprob_atol=0.0)
    assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"]
    assert stats["target_passes"] * 3 < plain["target_passes"]
