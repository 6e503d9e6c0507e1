"""Code tasks: "write a function", scored by hidden tests run in the sandbox (tasks/sandbox.py).

A row's `answer` is {"entry_point": name, "tests": [{"args": [...], "expected": ...}, ...]}: the prompt
shows one example, the reward runs every test. `code_rows` deals the built-in PROBLEMS (small, for a
tiny model and for tests) in a seeded order; a JSONL file of rows of the same shape works as any data
file does (`load_rows`). The task name CODE_TASK picks the built-ins in a run's `task`.

`HiddenTests` is the reward ("slipstream.tasks.code_tasks:HiddenTests"): built once per verifier worker,
it probes the sandbox, so a host that cannot isolate code fails the run's start naming what is missing.
It scores 1.0 when the completion's code passes every test and 0.0 otherwise, including code that
loops, forks, eats memory or reaches for the network: that is the policy's doing, and a masked sample
would teach it nothing. A sample is invalid only when it cannot be judged (a row with no tests, the
sandbox failing): the reward raises. Keep the sandbox's `wall_s` under the verifier's `timeout_s`.

    reward = HiddenTests()
    reward(row.question, completion, answer=row.answer)   # 1.0 or 0.0
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slipstream.tasks.datasets import Row
from slipstream.tasks.sandbox import Limits, Sandbox

__all__ = ["CODE_TASK", "PROBLEMS", "CodeProblem", "HiddenTests", "code_prompt", "code_rows", "extract_code"]

CODE_TASK = "code_functions"
_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class CodeProblem:
    entry_point: str
    signature: str  # as the prompt shows it, e.g. "add(a, b)"
    description: str  # completes "Write a Python function `signature` that …"
    tests: tuple[tuple[tuple[Any, ...], Any], ...]  # (args, expected); the first is the prompt's example

    def answer(self) -> dict[str, Any]:
        """The row's answer: what the reward needs, as plain JSON."""
        tests = [{"args": list(args), "expected": expected} for args, expected in self.tests]
        return {"entry_point": self.entry_point, "tests": tests}


PROBLEMS = (
    CodeProblem(entry_point="add", signature="add(a, b)", description="returns the sum of two integers",
                tests=(((2, 3), 5), ((-4, 4), 0), ((0, 0), 0), ((123, 877), 1000))),
    CodeProblem(entry_point="reverse", signature="reverse(s)", description="returns the string s reversed",
                tests=((("abc",), "cba"), (("",), ""), (("racecar",), "racecar"), (("ab c",), "c ba"))),
    CodeProblem(entry_point="is_prime", signature="is_prime(n)",
                description="returns True if the integer n is a prime number, else False",
                tests=(((7,), True), ((1,), False), ((2,), True), ((91,), False), ((97,), True), ((0,), False))),
    CodeProblem(entry_point="fib", signature="fib(n)",
                description="returns the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1",
                tests=(((6,), 8), ((0,), 0), ((1,), 1), ((20,), 6765), ((50,), 12586269025))),
    CodeProblem(entry_point="count_vowels", signature="count_vowels(s)",
                description="returns how many of the characters of s are vowels (a, e, i, o, u, any case)",
                tests=((("hello",), 2), (("",), 0), (("AEIOU xyz",), 5), (("rhythm",), 0))),
    CodeProblem(entry_point="largest", signature="largest(xs)",
                description="returns the largest number in the non-empty list xs",
                tests=((([3, 9, 2],), 9), (([-5, -2, -9],), -2), (([7],), 7), (([1, 1, 1],), 1))),
    CodeProblem(entry_point="factorial", signature="factorial(n)", description="returns n! for n >= 0",
                tests=(((5,), 120), ((0,), 1), ((1,), 1), ((12,), 479001600))),
    CodeProblem(entry_point="evens", signature="evens(xs)",
                description="returns the even numbers of the list xs, in their order",
                tests=((([1, 2, 3, 4],), [2, 4]), (([],), []), (([1, 3],), []), (([0, -2, 5],), [0, -2]))),
    CodeProblem(entry_point="digit_sum", signature="digit_sum(n)",
                description="returns the sum of the decimal digits of the integer n >= 0",
                tests=(((123,), 6), ((0,), 0), ((9999,), 36), ((1000001,), 2))),
    CodeProblem(entry_point="fizzbuzz", signature="fizzbuzz(n)",
                description='returns "Fizz" if n is divisible by 3, "Buzz" if by 5, "FizzBuzz" if by both, '
                            "else str(n)",
                tests=(((3,), "Fizz"), ((10,), "Buzz"), ((30,), "FizzBuzz"), ((7,), "7"), ((0,), "FizzBuzz"))),
)  # fmt: skip


def code_prompt(problem: CodeProblem) -> str:
    """The question for `problem`: the function to write, one example, and where the code goes."""
    args, expected = problem.tests[0]
    call = f"{problem.entry_point}({', '.join(map(repr, args))})"
    return (
        f"Write a Python function `{problem.signature}` that {problem.description}. "
        f"For example, {call} returns {expected!r}. "
        "Answer with the complete function in one ```python code block."
    )


def code_rows(n: int, seed: int) -> list[Row]:
    """`n` rows of the built-in problems, each round of them in its own seeded order."""
    rng = random.Random(f"slipstream.code:{seed}")
    rows: list[Row] = []
    while len(rows) < n:
        order = list(PROBLEMS)
        rng.shuffle(order)
        rows.extend(Row(question=code_prompt(p), answer=p.answer()) for p in order[: n - len(rows)])
    return rows


def extract_code(completion: str, entry_point: str) -> str | None:
    """The last fenced code block that defines `entry_point` (else the last block); the whole completion
    when it has no block but defines it; None when there is no code to run."""
    blocks = _FENCED.findall(completion)
    defining = [b for b in blocks if f"def {entry_point}" in b]
    if defining or blocks:
        return (defining or blocks)[-1]
    return completion if f"def {entry_point}" in completion else None


class HiddenTests:
    """The code reward: 1.0 when the completion's function passes every hidden test of its row, else 0.0."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.sandbox = Sandbox(limits)  # probes the host: raises SandboxUnavailable if it cannot isolate

    def __call__(self, prompt: str, completion: str, *, answer: Any = None, **_: Any) -> float:
        if (
            not isinstance(answer, Mapping)
            or not isinstance(answer.get("tests"), list)
            or not answer["tests"]
        ):
            raise ValueError("the HiddenTests reward needs answer = {'entry_point': name, 'tests': [...]}")
        entry_point = str(answer.get("entry_point", ""))
        if not entry_point.isidentifier():
            raise ValueError(f"answer.entry_point {entry_point!r} is not a function name")
        code = extract_code(completion, entry_point)
        if code is None:
            return 0.0
        return 1.0 if self.sandbox.run(code, entry_point, answer["tests"]).status == "passed" else 0.0
