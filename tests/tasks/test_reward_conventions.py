"""Reward conventions in this process: each framework's function is detected and called as it expects,
weighted terms sum, and every failure is an invalid sample naming why (never a silent 0). The same code
runs in the verifier's workers (tests/actors/test_verifier_batching.py drives it there)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from slipstream.tasks.reward_conventions import (
    Component,
    Convention,
    RewardTerm,
    Sample,
    describe,
    detect,
    load_components,
)
from slipstream.tasks.reward_worker import Called, Calling, Outcome, score

# -- rewards in each convention -------------------------------------------------------------------


def ours(prompt: str, completion: str, *, answer: Any = None, **_: Any) -> float:
    return 1.0 if completion == str(answer) else 0.0


def trl_accuracy(completions: list[str], answer: list[Any], **kwargs: Any) -> list[float | None]:
    """TRL's shape: columns as lists; None where a sample has no reward."""
    return [None if c == "skip" else float(c == str(a)) for c, a in zip(completions, answer, strict=True)]


def trl_chat(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """open-r1's habit: completion[0]["content"] of a conversational completion."""
    assert prompts[0][0]["role"] == "user"
    return [float(len(c[0]["content"])) for c in completions]


def trl_named_only(completions: list[str], solution: list[str]) -> list[float]:
    """No **kwargs: it gets only what it names (`solution` comes from the term's fields)."""
    return [float(c == s) for c, s in zip(completions, solution, strict=True)]


def trl_broken(prompts: list[str], completions: list[str], **kwargs: Any) -> Any:
    match completions[0]:
        case "raise":
            raise RuntimeError("judge offline")
        case "short":
            return [1.0] * (len(completions) - 1)
        case "scalar":
            return 1.0
    return [math.nan if c == "nan" else 0.5 for c in completions]


async def trl_async(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    await asyncio.sleep(0)
    return [0.25] * len(completions)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
    """verl's shape; records what it was given."""
    SEEN.append((data_source, solution_str, ground_truth, extra_info))
    if solution_str == "dict":
        return {"score": 0.75, "acc": True}
    if solution_str == "nodict":
        return {"acc": True}
    return last_word(solution_str) == str(ground_truth)  # a bool, as verl's own scorers may return


def compute_score_batched(
    data_sources: list, solution_strs: list, ground_truths: list, extra_infos: list
) -> list:
    return [float(last_word(s) == str(g)) for s, g in zip(solution_strs, ground_truths, strict=True)]


def last_word(solution: str) -> str:
    """The answer in a solution ("so it is 7" -> "7"): asymmetric, so a swapped solution and ground truth
    ("7" judged against "so it is 7") scores 0."""
    return solution.split()[-1] if solution.split() else ""


SEEN: list[tuple[Any, ...]] = []


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def component(fn: Any, **term: Any) -> Component:
    return Component(RewardTerm(fn="tests.tasks.test_reward_conventions:x", **term), fn, data_source="task")


def samples(*completions: str, **row: Any) -> list[Sample]:
    return [Sample(i, f"p{i}", c, {"answer": "7", **row}) for i, c in enumerate(completions)]


# -- detection --------------------------------------------------------------------------------------


def test_the_convention_is_read_from_the_signature() -> None:
    assert detect(ours) is Convention.COMPLETION
    assert detect(trl_accuracy) is Convention.BATCHED
    assert detect(trl_async) is Convention.BATCHED
    assert detect(compute_score) is Convention.VERL
    assert detect(compute_score_batched) is Convention.VERL_BATCHED
    assert detect(lambda prompt, completion, **row: 0.0) is Convention.COMPLETION
    assert detect(len) is Convention.COMPLETION  # no signature to read
    assert component(trl_accuracy, convention="completion").convention is Convention.COMPLETION


# -- each convention --------------------------------------------------------------------------------


def test_trl_gets_columns_as_lists_and_none_makes_only_its_sample_invalid(
    loop: asyncio.AbstractEventLoop,
) -> None:
    got = component(trl_accuracy).score_batch(samples("7", "8", "skip"), loop)
    assert got == [
        (1.0, None, None),
        (0.0, None, None),
        (None, "none", "none: the reward could not score it"),
    ]


def test_trl_chat_form_fields_and_async(loop: asyncio.AbstractEventLoop) -> None:
    assert component(trl_chat, chat=True).score_batch(samples("abc", "de"), loop) == [
        (3.0, None, None), (2.0, None, None),
    ]  # fmt: skip
    named = component(trl_named_only, fields={"solution": "metadata.solution"})
    got = named.score_batch(samples("a", "b", metadata={"solution": "a"}), loop)
    assert [v[0] for v in got] == [1.0, 0.0]
    assert [v[0] for v in component(trl_async).score_batch(samples("a", "b"), loop)] == [0.25, 0.25]


@pytest.mark.parametrize(
    ("first", "error"),
    [
        ("raise", "raised: RuntimeError: judge offline"),
        ("short", "garbage: returned 2 values for 3 completions"),
        ("scalar", "garbage: a batched reward returned 1.0"),
    ],
)
def test_a_failed_batched_call_invalidates_its_batch(
    loop: asyncio.AbstractEventLoop, first: str, error: str
) -> None:
    got = component(trl_broken).score_batch(samples(first, "a", "b"), loop)
    assert len(got) == 3 and all(v[0] is None and v[2] == error for v in got)
    assert component(trl_broken).score_batch(samples("a", "nan"), loop) == [
        (0.5, None, None), (None, "garbage", "garbage: returned nan (float)"),
    ]  # fmt: skip


def test_a_row_column_named_like_trls_arguments_is_refused(loop: asyncio.AbstractEventLoop) -> None:
    got = component(trl_accuracy).score_batch(samples("7", completions=[1]), loop)
    assert got == [(None, "bad_row", "bad row: ['completions'] are passed by name, not as row fields")]


def test_verl_defaults_overrides_and_results(loop: asyncio.AbstractEventLoop) -> None:
    SEEN.clear()
    verl = component(compute_score)
    (one,) = samples("so it is 7", metadata={"split": "train"})
    assert verl.score_one(one, loop) == (1.0, None, None)  # True counts as 1.0, as in verl
    assert SEEN[-1] == (
        "task",
        "so it is 7",
        "7",
        {"split": "train"},
    )  # data_source: the verifier's, when the row has none; the completion is the solution
    reasoning_gym_row = Sample(
        0, "p", "it is 8", {"answer": "7", "metadata": {"source_dataset": "chain_sum"}}
    )
    assert verl.score_one(reasoning_gym_row, loop) == (0.0, None, None) and SEEN[-1][0] == "chain_sum"
    assert verl.score_one(Sample(0, "p", "dict", {"ground_truth": 1}), loop) == (0.75, None, None)
    assert verl.score_one(Sample(0, "p", "nodict", {"answer": 1}), loop)[1] == "garbage"
    assert verl.score_one(Sample(0, "p", "7", {"question": "q"}), loop) == (
        None, "bad_row", "bad row: no ground truth: none of ['answer', 'ground_truth', 'metadata.ground_truth'] "
        "is in the row",
    )  # fmt: skip
    mapped = component(compute_score, fields={"ground_truth": "metadata.gt", "data_source": "metadata.src"})
    row = {"answer": "wrong", "metadata": {"gt": "7", "src": "gsm8k"}}
    assert mapped.score_one(Sample(0, "p", "so 7", row), loop) == (1.0, None, None)
    assert SEEN[-1][:3] == ("gsm8k", "so 7", "7")
    assert mapped.score_one(Sample(0, "p", "7", {"answer": "7"}), loop)[1:] == (
        "bad_row", "bad row: no field 'metadata.gt' for 'ground_truth'",
    )  # fmt: skip
    verl_row = {"answer": "7", "metadata": {"data_source": "gsm8k", "extra_info": {"index": 3}}}
    assert verl.score_one(Sample(0, "p", "thus 7", verl_row), loop) == (1.0, None, None)
    assert SEEN[-1] == (
        "gsm8k",
        "thus 7",
        "7",
        {"index": 3},
    )  # a verl file's row (tasks/datasets.py) as verl has it
    batched = component(compute_score_batched)
    assert [v[0] for v in batched.score_batch(samples("is 7", "is 6"), loop)] == [1.0, 0.0]


# -- rows that differ: each completion is right only against its own row --------------------------------

ANSWERS = ["3", "14", "15", "92", "65"]


def own_rows() -> list[Sample]:
    """One sample per answer, each completion right for its own row alone; the rows differ in every
    column a reward might read (answer, ground_truth, metadata, a verl file's extra_info)."""
    return [
        Sample(i, f"question {i}", f"so it is {a}", {
            "answer": a, "question": f"q{i}", "metadata": {"solution": a, "extra_info": {"index": i}},
        })
        for i, a in enumerate(ANSWERS)
    ]  # fmt: skip


def trl_by_row(prompts: list[str], completions: list[str], answer: list[str], question: list[str],
               metadata: list[dict], **kwargs: Any) -> list[float]:  # fmt: skip
    """Right only where every column of the completion's position belongs to the same row."""
    return [
        float(last_word(c) == a == m["solution"] and p == f"question {q[1:]}")
        for p, c, a, q, m in zip(prompts, completions, answer, question, metadata, strict=True)
    ]


def trl_chat_by_row(
    prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any
) -> list[float]:
    return [float(last_word(c[0]["content"]) == a) for c, a in zip(completions, answer, strict=True)]


def verl_batched_by_row(
    data_sources: list, solution_strs: list, ground_truths: list, extra_infos: list
) -> list:
    return [
        float(last_word(s) == g == ANSWERS[e["index"]])
        for s, g, e in zip(solution_strs, ground_truths, extra_infos, strict=True)
    ]


def test_batched_rewards_see_each_completion_beside_its_own_row(loop: asyncio.AbstractEventLoop) -> None:
    rows = own_rows()
    assert [v[0] for v in component(trl_by_row).score_batch(rows, loop)] == [1.0] * len(rows)
    chat = component(trl_chat_by_row, chat=True)
    assert [v[0] for v in chat.score_batch(rows, loop)] == [1.0] * len(rows)
    named = component(trl_named_only, fields={"solution": "metadata.solution"})
    rows_named = [Sample(s.job_id, s.prompt, ANSWERS[s.job_id], s.row) for s in rows]
    assert [v[0] for v in named.score_batch(rows_named, loop)] == [1.0] * len(rows)
    verl = component(verl_batched_by_row)
    assert [v[0] for v in verl.score_batch(rows, loop)] == [1.0] * len(rows)
    # The same completions against the rows in another order: right nowhere, so a reordering shows.
    shifted = [
        Sample(s.job_id, s.prompt, rows[(i + 1) % len(rows)].completion, s.row) for i, s in enumerate(rows)
    ]
    assert [v[0] for v in component(trl_by_row).score_batch(shifted, loop)] == [0.0] * len(rows)


def test_per_completion_rewards_see_their_own_row(loop: asyncio.AbstractEventLoop) -> None:
    rows = own_rows()
    mine = component(ours)
    assert [mine.score_one(Sample(s.job_id, s.prompt, ANSWERS[s.job_id], s.row), loop)[0] for s in rows] == [
        1.0
    ] * len(rows)
    verl = component(compute_score)
    SEEN.clear()
    assert [verl.score_one(s, loop)[0] for s in rows] == [1.0] * len(rows)
    assert [(solution, truth) for _, solution, truth, _ in SEEN] == [(f"so it is {a}", a) for a in ANSWERS]


# -- weighted sums, through the worker's scoring loop -------------------------------------------------


def test_weighted_terms_sum_and_report_each_component(loop: asyncio.AbstractEventLoop) -> None:
    terms = (
        RewardTerm(fn="tests.tasks.test_reward_conventions:trl_accuracy", weight=1.0, name="accuracy"),
        RewardTerm(fn="tests.tasks.test_reward_conventions:ours", weight=0.5),
        RewardTerm(fn="slipstream.tasks.rewards:answer_format", weight=0.1, name="format"),
    )
    components = load_components(terms, data_source="task")
    said: list[Any] = []
    jobs = samples("7", "8", "skip", "<answer>7</answer>")
    outcomes = list(score(components, jobs, loop, said.append))
    assert [o.reward for o in outcomes] == [1.5, 0.0, None, pytest.approx(0.1)]
    assert outcomes[0].components == {"accuracy": 1.0, "ours": 1.0, "format": 0.0}
    assert (
        outcomes[2].error == "none: accuracy: the reward could not score it"
        and outcomes[2].blame == "accuracy"
    )
    assert outcomes[2].components == {}  # the batched term failed it, so no later term was called
    # The batched term's one call for all four, then each sample's own calls, one at a time; each call
    # told before it starts and, with its size, time and invalid samples, after it returns.
    calling = [m for m in said if isinstance(m, Calling)]
    assert calling[0] == Calling(job_ids=[0, 1, 2, 3], batched=True, component="accuracy")
    assert calling[1:] == [
        Calling(job_ids=[i], batched=False, component=name) for i in (0, 1, 3) for name in ("ours", "format")
    ]
    assert [type(m) for m in said] == [Calling, Called] * 7
    called = [m for m in said if isinstance(m, Called)]
    assert [(c.component, c.size, c.invalid) for c in called] == [("accuracy", 4, 1)] + [
        (name, 1, 0) for _ in range(3) for name in ("ours", "format")
    ]
    assert all(c.seconds >= 0 and c.started_ns > 0 for c in called)
    assert all(isinstance(o, Outcome) for o in outcomes)


def test_a_lone_reward_keeps_its_errors_unprefixed(loop: asyncio.AbstractEventLoop) -> None:
    (only,) = load_components((RewardTerm(fn="tests.tasks.test_reward_conventions:trl_accuracy"),))
    (outcome,) = score([only], samples("skip"), loop, lambda _: None)
    assert outcome.error == "none: the reward could not score it" and outcome.blame == "trl_accuracy"


def test_terms_are_validated_and_described() -> None:
    with pytest.raises(msgspec.ValidationError, match="weight: inf is not a finite number"):
        msgspec.convert({"fn": "a:b", "weight": math.inf}, RewardTerm)
    with pytest.raises(msgspec.ValidationError, match="Expected `str` matching regex"):
        msgspec.convert({"fn": "not a path"}, RewardTerm)
    terms = (RewardTerm(fn="a.b:acc", weight=0.9), RewardTerm(fn="a.b:fmt", weight=0.1))
    assert describe(terms) == "0.9*a.b:acc + 0.1*a.b:fmt" and describe("a.b:c") == "a.b:c"
    assert [t.label for t in terms] == ["acc", "fmt"]
