"""Built-in rewards, and `load_reward` for any reward named by import path ("pkg.mod:fn").

A reward is called once per completion as `fn(prompt, completion, **row)`, where `row` holds the
dataset row's fields (answer, metadata, …), and returns a float, or None when it cannot score. The
built-ins take the fields they need by name and ignore the rest (`**_`).

The answer is the text inside the last <answer>…</answer> (the RL prompt asks for it there). For
`reasoning_gym` there is no fallback to "the last number" (it would reward numbers echoed from the
question): an untagged completion scores 0.0. `reasoning_gym_final_number`, the demo's reward, does fall
back, for small models that seldom tag. math-verify extracts from free text itself (a \\boxed{} answer,
the last expression). `reasoning_gym_with_format` and `reasoning_gym_final_number` add FORMAT_BONUS for
a well-formed tag: a small model is rarely right at first, and GRPO learns nothing from a flat group.

    fn = load_reward("slipstream.tasks.rewards:reasoning_gym_with_format")
    fn(question, "<answer>-4</answer>", question=question, answer="-4", metadata=row.metadata)
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any

# The `tasks` extra, imported with this module rather than on a first call: a verifier worker loads its
# reward at start, and a first call that spent seconds importing could pass the reward's deadline.
try:
    import reasoning_gym as _rg
except ImportError:
    _rg = None
try:
    import math_verify as _mv
except ImportError:
    _mv = None

FORMAT_BONUS = 0.1  # what a well-formed answer tag adds in `reasoning_gym_with_format`

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def import_named(path: str, what: str, shape: str) -> Any:
    """The object "pkg.module:name" names (a reward, an environment); every failure a ValueError naming
    `what` and the path: "reward 'x.y:z': module x.y has no attribute z"."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r}: must look like 'package.module:{shape}'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # whatever the module raises at import, the message names the path
        raise ValueError(f"{what} {path!r}: cannot import {module_name}: {type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        raise ValueError(f"{what} {path!r}: module {module_name} has no attribute {attr}")
    return getattr(module, attr)


def load_reward(path: str) -> Callable[..., Any]:
    """The reward named "pkg.mod:fn"; a class is instantiated (no arguments) and the instance returned.

    Every failure is a ValueError naming the path: "reward 'x.y:z': module x.y has no attribute z".
    """
    obj = import_named(path, "reward", "function")
    attr = path.partition(":")[2]
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as e:
            raise ValueError(f"reward {path!r}: {attr}() raised {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise ValueError(f"reward {path!r}: {attr} is not callable ({type(obj).__name__})")
    return obj


def extract_answer(completion: str) -> str | None:
    """The stripped text of the last <answer>…</answer> in `completion`, or None without one."""
    found = _ANSWER.findall(completion)
    return found[-1].strip() if found else None


def answer_format(prompt: str, completion: str, **_: Any) -> float:
    """1.0 if `completion` holds exactly one <answer>…</answer> and it is not blank, else 0.0."""
    if completion.count("<answer>") != 1 or completion.count("</answer>") != 1:
        return 0.0
    answer = extract_answer(completion)  # None when the closing tag comes first
    return 1.0 if answer else 0.0


def reasoning_gym(
    prompt: str,
    completion: str,
    *,
    answer: Any = None,
    metadata: Mapping[str, Any] | None = None,
    question: str | None = None,
    **_: Any,
) -> float:
    """The row's own reasoning-gym task scores the tagged answer (rows of `reasoning_gym_rows`).

    Tasks give partial credit as they see fit (basic_arithmetic: 0.5 for "-4.0" against "-4").
    """
    source = (metadata or {}).get("source_dataset")
    if not source:
        raise ValueError(
            "the reasoning_gym reward needs metadata.source_dataset (rows of reasoning_gym_rows)"
        )
    entry = {"question": prompt if question is None else question, "answer": answer, "metadata": metadata}
    return float(_task_scorer(source)(extract_answer(completion), entry))


def reasoning_gym_with_format(prompt: str, completion: str, **row: Any) -> float:
    """`reasoning_gym` + FORMAT_BONUS × `answer_format`."""
    return reasoning_gym(prompt, completion, **row) + FORMAT_BONUS * answer_format(prompt, completion)


def reasoning_gym_final_number(prompt: str, completion: str, **row: Any) -> float:
    """For small models that seldom tag: the tagged answer if there is one, else the last number in the
    completion, scored by the row's task, plus FORMAT_BONUS for a well-formed tag (so the format is still
    learned). The demo's reward: SmolLM2-135M states its answer last but seldom tags it (docs/benchmarks.md)."""
    tagged = extract_answer(completion)
    if tagged is None:
        numbers = _NUMBER.findall(completion)
        completion = f"<answer>{numbers[-1]}</answer>" if numbers else completion
    return reasoning_gym(prompt, completion, **row) + FORMAT_BONUS * (tagged is not None) * answer_format(
        prompt, completion
    )


def math_verify(prompt: str, completion: str, *, answer: Any = None, **_: Any) -> float | None:
    """1.0 if math-verify finds the completion's answer equal to the row's `answer`, else 0.0.

    None (cannot score) when the reference answer itself does not parse. math-verify bounds its own
    parsing with signal.alarm, so it must run in a main thread (the verifier's workers call it there).
    """
    if _mv is None:
        raise RuntimeError("math-verify is missing: pip install 'slipstream[tasks]'")
    if answer is None:
        raise ValueError("the math_verify reward needs the row's answer")
    gold = _mv.parse(str(answer))
    if not gold:
        return None
    tagged = extract_answer(completion)
    return 1.0 if _mv.verify(gold, _mv.parse(completion if tagged is None else tagged)) else 0.0


@functools.cache
def _task_scorer(name: str) -> Callable[[str | None, dict[str, Any]], float]:
    if _rg is None:
        raise RuntimeError("reasoning-gym is missing: pip install 'slipstream[tasks]'")
    return _rg.get_score_answer_fn(name)


__all__ = [
    "FORMAT_BONUS",
    "answer_format",
    "extract_answer",
    "load_reward",
    "math_verify",
    "reasoning_gym",
    "reasoning_gym_final_number",
    "reasoning_gym_with_format",
]
