"""Multi-turn environments (tasks/environments.py): the contract's shipped examples answer turns as documented,
the calculator evaluates arithmetic without eval and refuses the rest, and a whole episode can be played."""

from __future__ import annotations

import pytest

from slipstream.tasks.datasets import Row
from slipstream.tasks.environments import Calculator, GuessNumber, Observation, evaluate_arithmetic


def test_arithmetic_is_evaluated_and_everything_else_refused() -> None:
    assert evaluate_arithmetic("2 + 3 * (4 - 1)") == 11
    assert evaluate_arithmetic("-7 // 2") == -4 and evaluate_arithmetic("2 ** 10") == 1024
    assert evaluate_arithmetic("1.5 * 4") == 6.0
    for bad, why in [
        ("__import__('os').system('true')", "Call is not arithmetic"),
        ("x + 1", "Name is not arithmetic"),
        ("2 ** 10 ** 9", "exponent 1000000000 is past 64"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than 200"),
        ("'a' * 3", "Constant is not arithmetic"),
    ]:
        with pytest.raises(ValueError, match=why.replace("(", r"\(").replace("*", r"\*")):
            evaluate_arithmetic(bad)


def test_a_calculator_episode_from_tool_calls_to_the_reward() -> None:
    episode = Calculator(Row(question="What is 12 * 34 + 5?", answer="413"))
    assert episode.opening()[-1] == {"role": "user", "content": "What is 12 * 34 + 5?"}
    assert "</calc>" in episode.stop_sequences
    assert episode.reply("Let me compute. <calc>12 * 34</calc>") == Observation(text="<result>408</result>")
    assert episode.reply("<calc>408 / 0</calc>") == Observation(text="<error>division by zero</error>")
    assert episode.reply("So <answer>413</answer>") == Observation(text="", done=True, reward=1.0)
    wrong = Calculator(Row(question="?", answer="7"))
    assert wrong.reply("<answer>8</answer>").reward == 0.0
    assert wrong.reply("I give up.") == Observation(
        text="", done=True, reward=0.0
    )  # neither a call nor an answer
    greedy = Calculator(Row(question="?", answer="1"), max_calls=2)
    greedy.reply("<calc>1+1</calc>")
    greedy.reply("<calc>1+1</calc>")
    last = greedy.reply("<calc>1+1</calc>")
    assert last.done and last.reward == 0.0 and "more than 2 calls" in last.text
    shown = Calculator(Row(question="What is 2 + 2?", answer="4"), example=True).opening()
    assert [m["role"] for m in shown] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert shown[-1]["content"] == "What is 2 + 2?" and shown[2]["content"] == "<calc>3 + 4</calc>"


def test_the_guessing_game_answers_each_guess_and_rewards_fewer_turns() -> None:
    game = GuessNumber(Row(question="g", answer=37))
    assert game.reply("50") == Observation(text="lower", role="user")
    assert game.reply("I think 20") == Observation(text="higher", role="user")
    assert game.reply("hmm") == Observation(text="answer with one number", role="user")
    end = game.reply("37")
    assert end.done and end.reward == pytest.approx(1 / 4)
    seeded = GuessNumber(Row(question="g", metadata={"seed": 5}))
    assert seeded.secret == GuessNumber(Row(question="other", metadata={"seed": 5})).secret
    lost = GuessNumber(Row(question="g", answer=3), max_turns=2)
    lost.reply("1")
    assert lost.reply("2") == Observation(text="no: it was 3", role="user", done=True, reward=0.0)
    # from_answer off: a task's rows (whose answers may be 0 or negative) only seed the secret, in range.
    drawn = [
        GuessNumber(Row(question=f"q{i}", answer=-4), high=16, from_answer=False).secret for i in range(40)
    ]
    assert all(1 <= d <= 16 for d in drawn) and len(set(drawn)) > 5
    assert drawn[0] == GuessNumber(Row(question="q0", answer=9), high=16, from_answer=False).secret
