"""The built-in rewards on hand-written completions, with real reasoning-gym rows and real math-verify."""

import json

import pytest

from slipstream.tasks import rewards
from slipstream.tasks.datasets import Row, reasoning_gym_rows
from slipstream.tasks.rewards import (
    FORMAT_BONUS,
    answer_format,
    extract_answer,
    load_reward,
    math_verify,
    reasoning_gym,
    reasoning_gym_with_format,
)


def fields(row: Row) -> dict:
    return {"question": row.question, "answer": row.answer, "metadata": dict(row.metadata)}


@pytest.fixture(scope="module")
def row() -> Row:
    (row,) = [r for r in reasoning_gym_rows("basic_arithmetic", 8, seed=0) if r.answer == "-4"]
    return row  # "Calculate 5 - 3 - 6." → "-4"


def test_extract_answer_takes_the_last_tag_stripped() -> None:
    assert extract_answer("think <answer> 3 </answer> no, <answer>-4</answer>.") == "-4"
    assert extract_answer("<answer>\n12\n</answer>") == "12"
    assert extract_answer("the answer is -4") is None
    assert extract_answer("<answer>-4") is None
    assert extract_answer("</answer>-4<answer>") is None


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("5 - 3 = 2, 2 - 6 = -4. <answer>-4</answer>", 1.0),  # correct
        ("<answer>4</answer>", 0.0),  # wrong
        ("5 - 3 - 6 = -4", 0.0),  # no tag: no fallback to the last number
        ("<answer>-4", 0.0),  # malformed: never closed
        ("<answer>-4.0</answer>", 0.5),  # the task's own partial credit
        ("<answer>2</answer> wait <answer>-4</answer>", 1.0),  # the last tag is the answer
    ],
)
def test_reasoning_gym_scores_with_the_tasks_own_scorer(row: Row, completion: str, expected: float) -> None:
    assert reasoning_gym(row.question, completion, **fields(row)) == expected


def test_reasoning_gym_scores_other_tasks_and_rows_that_went_through_json() -> None:
    (chain,) = reasoning_gym_rows("chain_sum", 1, seed=0)
    through_json = json.loads(json.dumps(fields(chain)))  # tuples in metadata become lists on the wire
    good = f"<answer>{chain.answer}</answer>"
    assert reasoning_gym(chain.question, good, **through_json) == 1.0
    assert reasoning_gym(chain.question, good, **through_json, id="extra fields are ignored") == 1.0


def test_reasoning_gym_needs_the_source_dataset(row: Row) -> None:
    with pytest.raises(ValueError, match=r"metadata\.source_dataset"):
        reasoning_gym(row.question, "<answer>-4</answer>", answer="-4", metadata={})


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("reasoning <answer>-4</answer>", 1.0),
        ("<answer>4</answer>", 1.0),  # wrong, but well formed
        ("<answer> </answer>", 0.0),  # blank
        ("-4", 0.0),  # no tag
        ("<answer>-4", 0.0),  # never closed
        ("</answer>-4<answer>", 0.0),  # closed before it opens
        ("<answer>1</answer><answer>-4</answer>", 0.0),  # two answers
    ],
)
def test_answer_format(completion: str, expected: float) -> None:
    assert answer_format("q", completion) == expected


def test_reasoning_gym_with_format_adds_a_small_bonus(row: Row) -> None:
    def score(completion: str) -> float:
        return reasoning_gym_with_format(row.question, completion, **fields(row))

    assert score("<answer>-4</answer>") == pytest.approx(1.0 + FORMAT_BONUS)
    assert score("<answer>4</answer>") == pytest.approx(FORMAT_BONUS)  # wrong but well formed
    assert score("-4") == 0.0
    assert 0.1 <= FORMAT_BONUS <= 0.2


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so x = 1/2. <answer>\\frac{1}{2}</answer>", "0.5", 1.0),  # equal as numbers
        ("<answer>0.5</answer>", "$\\frac{1}{2}$", 1.0),
        ("<answer>3</answer>", "4", 0.0),  # wrong
        ("2 + 2 = \\boxed{4}", "4", 1.0),  # no tag: math-verify reads the whole completion
        ("I do not know", "4", 0.0),  # nothing to parse
        ("so x = 4 </answer>", 4, 1.0),  # malformed tag: the whole text is read; a JSON number answer
    ],
)
def test_math_verify(completion: str, answer: object, expected: float) -> None:
    assert math_verify("q", completion, answer=answer) == expected


def test_math_verify_cannot_score_without_a_parseable_reference() -> None:
    assert math_verify("q", "<answer>4</answer>", answer="no number here") is None
    with pytest.raises(ValueError, match="answer"):
        math_verify("q", "<answer>4</answer>")


class Doubler:
    def __init__(self) -> None:
        self.factor = 2.0

    def __call__(self, prompt: str, completion: str, **row: object) -> float:
        return self.factor


NOT_CALLABLE = 3


def test_load_reward_functions_and_classes() -> None:
    assert load_reward("slipstream.tasks.rewards:answer_format") is rewards.answer_format
    instance = load_reward("tests.tasks.test_rewards:Doubler")
    assert isinstance(instance, Doubler) and instance("p", "c") == 2.0


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_colon", "reward 'no_colon': must look like 'package.module:function'"),
        ("nope.mod:fn", "reward 'nope.mod:fn': cannot import nope.mod: ModuleNotFoundError"),
        ("slipstream.tasks.rewards:nope", "module slipstream.tasks.rewards has no attribute nope"),
        ("tests.tasks.test_rewards:NOT_CALLABLE", "NOT_CALLABLE is not callable (int)"),
        ("math:inf", "inf is not callable (float)"),
    ],
)
def test_load_reward_errors_name_the_path(path: str, message: str) -> None:
    with pytest.raises(ValueError, match="reward") as err:
        load_reward(path)
    assert message in str(err.value)
