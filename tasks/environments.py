"""Multi-turn environments: what answers the policy between its turns (issue 42), by import path like a reward.

An environment is a factory `env(row) -> Episode` named by "pkg.module:name" (a class works: its instances
are episodes). An episode holds one sample's state: `opening()` gives the messages the episode starts
with, and `reply(turn)` answers the policy's turn — a tool call, a move, an attempt — with an `Observation`
(the text it appends, whether the episode is done, and the reward when it is). `stop_sequences` end a turn
before the policy's end-of-turn token: the rollout pauses the sample there (engine `Generator.pause`),
asks the environment, appends the rendered observation on the same KV cache (`resume`) and decodes on.
`reply` may be a coroutine (remote tools, judges); the caller bounds it with a deadline, and an episode
that raises, hangs or answers garbage makes its sample invalid, as a reward does.

Shipped: `Calculator` (arithmetic tasks with a `<calc>…</calc>` tool evaluated safely, exact-match reward
on the final answer) and `GuessNumber` (a game where the answer to each guess decides the next turn).
Hosted by the environment actor (actors/environment.py), driven turn by turn by the rollout
(engine/episodes.py); what is built and what is not: docs/environments.md.
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
import random
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from slipstream.tasks.datasets import Row
from slipstream.tasks.rewards import import_named

__all__ = [
    "Calculator",
    "EnvironmentFactory",
    "Episode",
    "GuessNumber",
    "Observation",
    "check_environment",
    "evaluate_arithmetic",
    "load_environment",
]


@dataclass(frozen=True, kw_only=True)
class Observation:
    """An environment's answer to one turn."""

    text: str
    """What is appended to the conversation as a message of `role` (empty: nothing; only with done)."""
    done: bool = False
    reward: float | None = None
    """The episode's reward, with done (None: the run's reward function scores the transcript)."""
    role: str = "tool"


class Episode(Protocol):
    """One sample's conversation with an environment."""

    stop_sequences: Sequence[str]
    """Texts that end a policy turn early (a tool call's closing tag); the policy's end-of-turn ends one too."""

    def opening(self) -> list[dict[str, str]]:
        """The chat messages the episode starts with (the prompt)."""
        ...

    def reply(self, turn: str) -> Observation | Awaitable[Observation]:
        """The answer to the policy's turn (its text, up to and including a stop sequence)."""
        ...


EnvironmentFactory = Callable[[Row], Episode]

_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_EXPR = 200  # characters
_MAX_POWER = 64  # an exponent past this is refused, not computed (2 ** 10 ** 9 would hang the host)


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % ** and parentheses) without eval:
    ValueError naming what is refused (names, calls, huge powers, division by zero, too long)."""
    if len(expression) > _MAX_EXPR:
        raise ValueError(f"expression longer than {_MAX_EXPR} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
                raise ValueError(f"exponent {right} is past {_MAX_POWER}")
            try:
                return _OPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
        raise ValueError(f"{type(node).__name__} is not arithmetic")

    return value(tree.body)


_CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


@dataclass
class Calculator:
    """An arithmetic task with a calculator tool: the policy may write `<calc>EXPR</calc>` (answered with
    `<result>VALUE</result>` or `<error>…</error>`) any number of times, up to `max_calls`, then
    `<answer>…</answer>`; reward 1.0 if the answer equals the row's, else 0.0. A turn with neither ends the
    episode with reward 0.0. `example`: the opening holds one worked exchange (a call, its result, the
    answer) before the question: SmolLM2-135M then tags its answers and sometimes calls the tool, where
    with the instruction alone it did neither in 16 samples (deploy/configs/multiturn.yaml)."""

    row: Row
    max_calls: int = 4
    example: bool = False
    stop_sequences: Sequence[str] = ("</calc>",)
    calls: int = field(default=0, init=False)

    SYSTEM = (
        "Solve the problem. To compute, write <calc>expression</calc> and wait for the result. "
        "Finish with <answer>number</answer>."
    )

    EXAMPLE = (
        {"role": "user", "content": "State the final answer to the following arithmetic problem: 3 + 4 ="},
        {"role": "assistant", "content": "<calc>3 + 4</calc>"},
        {"role": "tool", "content": "<result>7</result>"},
        {"role": "assistant", "content": "<answer>7</answer>"},
    )

    def opening(self) -> list[dict[str, str]]:
        example = [dict(m) for m in self.EXAMPLE] if self.example else []
        return [
            {"role": "system", "content": self.SYSTEM},
            *example,
            {"role": "user", "content": self.row.question},
        ]

    def reply(self, turn: str) -> Observation:
        answer = _ANSWER.search(turn)
        if answer is not None:
            return Observation(text="", done=True, reward=float(_same(answer.group(1), self.row.answer)))
        call = _CALL.search(turn)
        if call is None:
            return Observation(text="", done=True, reward=0.0)
        self.calls += 1
        if self.calls > self.max_calls:
            return Observation(text=f"<error>more than {self.max_calls} calls</error>", done=True, reward=0.0)
        try:
            result = evaluate_arithmetic(call.group(1))
        except ValueError as exc:
            return Observation(text=f"<error>{exc}</error>")
        text = str(int(result)) if float(result).is_integer() else f"{result:.6g}"
        return Observation(text=f"<result>{text}</result>")


@dataclass
class GuessNumber:
    """A game: the environment holds a number in [1, high] (the row's `answer`, or with `from_answer` off or
    no answer, one drawn from the row's seed or question); each turn the policy writes a guess, the
    environment answers "higher", "lower" or "correct". Reward on success: 1 / turns taken (fewer is
    better), 0.0 after `max_turns`; a turn without a number is a lost turn."""

    row: Row
    high: int = 100
    max_turns: int = 8
    from_answer: bool = True
    stop_sequences: Sequence[str] = ()
    turns: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        answer = self.row.answer
        seed = self.row.metadata.get("seed", self.row.question)
        if self.from_answer and answer is not None:
            self.secret = int(answer)
        else:
            self.secret = random.Random(str(seed)).randint(1, self.high)

    def opening(self) -> list[dict[str, str]]:
        prompt = f"I am thinking of a whole number from 1 to {self.high}. Guess it: answer with one number."
        return [{"role": "user", "content": prompt}]

    def reply(self, turn: str) -> Observation:
        self.turns += 1
        numbers = re.findall(r"-?\d+", turn)
        if numbers and int(numbers[-1]) == self.secret:
            return Observation(text="correct", role="user", done=True, reward=1.0 / self.turns)
        if self.turns >= self.max_turns:
            return Observation(text=f"no: it was {self.secret}", role="user", done=True, reward=0.0)
        if not numbers:
            return Observation(text="answer with one number", role="user")
        hint = "higher" if int(numbers[-1]) < self.secret else "lower"
        return Observation(text=hint, role="user")


def _same(given: str, expected: Any) -> bool:
    """Whether an answer equals the expected one (as numbers where both parse, else as stripped text)."""
    try:
        return float(given.strip()) == float(str(expected).strip())
    except ValueError:
        return given.strip() == str(expected).strip()


def load_environment(path: str, options: Mapping[str, Any] | None = None) -> EnvironmentFactory:
    """The environment named "pkg.module:name" (a class or a function taking a `Row`), called with `options`
    as keyword arguments after the row. Every failure is a ValueError naming the path."""
    factory = import_named(path, "environment", "Name")
    if not callable(factory):
        attr = path.partition(":")[2]
        raise ValueError(f"environment {path!r}: {attr} is not callable ({type(factory).__name__})")
    return functools.partial(factory, **dict(options or {})) if options else factory


def check_environment(path: str, options: Mapping[str, Any] | None = None) -> None:
    """What a run config checks at start: `path` loads (ValueError "env: …") and its factory takes a row and
    `options` (ValueError "options: …", e.g. a misspelt keyword)."""
    try:
        factory = load_environment(path)
    except ValueError as e:
        raise ValueError(f"env: {e}") from None
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some callables have none to read: they are called as they are
        return
    try:
        signature.bind(None, **dict(options or {}))
    except TypeError as e:
        raise ValueError(f"options: {path} does not take them: {e}") from None
