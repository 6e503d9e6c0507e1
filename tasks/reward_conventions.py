"""Reward conventions: other frameworks' reward functions, called as they expect, and weighted sums.

A reward is named by import path; how it is called is read from its signature (`detect`), or set:
- "completion" (ours): `fn(prompt, completion, **row)` per completion → float | None.
- "batched" (TRL, a parameter named `completions`): `fn(prompts=[…], completions=[…], **columns)`, each
  row field a list over the batch → one float | None per completion. `chat` passes TRL's conversational
  form ([{"role", "content"}] lists) instead of text.
- "verl" (a parameter `solution_str`): `compute_score(data_source=, solution_str=, ground_truth=,
  extra_info=)` per completion; "verl_batched" (`solution_strs`) takes the plural lists. A dict result
  gives its "score", a bool counts as 0/1 (verl's own rules). ground_truth is the first present of
  GROUND_TRUTH, data_source of DATA_SOURCE, else the verifier's `data_source`; extra_info of
  metadata.extra_info (a verl file's), else the metadata. A term's `fields` overrides them, or adds
  keywords: {"solution": "metadata.solution"}.
A `RewardTerm` list sums `weight × reward`; any component's None, raise or garbage makes the sample
invalid, naming the component (TRL would sum the others; we never score a partial sum). A batched call
that raises or returns the wrong length invalidates its batch's samples only.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "DATA_SOURCE",
    "GROUND_TRUTH",
    "Component",
    "Convention",
    "RewardTerm",
    "Sample",
    "Verdict",
    "call_reward",
    "clip",
    "combine",
    "describe",
    "detect",
    "judge",
    "load_components",
    "named",
]

Verdict = tuple[float | None, str | None, str | None]  # (reward, reason, error): reason and error when None

REWARD_PATH = r"^\w+(\.\w+)*:\w+$"
GROUND_TRUTH = ("answer", "ground_truth", "metadata.ground_truth")  # where verl's ground_truth is looked for
DATA_SOURCE = ("data_source", "metadata.data_source", "metadata.source_dataset")  # and its data_source
_TRL_NAMES = ("prompts", "completions")
_VERL_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")
_CLIP = 300  # characters of a returned value or exception message kept in an error


class Convention(StrEnum):
    COMPLETION = "completion"
    BATCHED = "batched"
    VERL = "verl"
    VERL_BATCHED = "verl_batched"


class RewardTerm(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One component of a weighted reward."""

    fn: Annotated[str, msgspec.Meta(pattern=REWARD_PATH)]  # "pkg.mod:fn": a function or a class
    weight: float = 1.0  # its reward is multiplied by this before the components are summed
    name: str = ""  # how its component is reported; the function's name when empty
    convention: Literal["auto", "completion", "batched", "verl", "verl_batched"] = (
        "auto"  # auto: by signature
    )
    fields: dict[str, str] = {}  # extra keyword → row field ("answer", "metadata.solution")
    chat: bool = False  # batched: prompts and completions as TRL's conversational message lists

    def __post_init__(self) -> None:
        if not math.isfinite(self.weight):
            raise ValueError(f"weight: {self.weight} is not a finite number")

    @property
    def label(self) -> str:
        return self.name or self.fn.rpartition(":")[2]


class Sample(msgspec.Struct, array_like=True, frozen=True):
    """One completion to score (a verifier `Job`'s fields)."""

    job_id: int
    prompt: str
    completion: str
    row: dict[str, Any]


def detect(fn: Callable[..., Any]) -> Convention:
    """The convention `fn`'s parameter names say it follows; ours when they say nothing."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return Convention.COMPLETION
    if "solution_strs" in names:
        return Convention.VERL_BATCHED
    if "solution_str" in names:
        return Convention.VERL
    if "completions" in names:
        return Convention.BATCHED
    return Convention.COMPLETION


def describe(reward: str | Sequence[RewardTerm]) -> str:
    """One line naming the reward: its path, or the weighted sum of its terms."""
    if isinstance(reward, str):
        return reward
    return " + ".join(f"{t.weight:g}*{t.fn}" for t in reward)


def load_components(terms: Sequence[RewardTerm], data_source: str = "") -> list[Component]:
    """Each term's reward loaded (`load_reward`: a ValueError names a path that cannot load)."""
    # Imported here, not by the module: the actor imports this module but runs no reward code, and the
    # built-ins' dependencies take seconds and tens of MB to import (a worker's forkserver has them).
    from slipstream.tasks.rewards import load_reward

    return [Component(t, load_reward(t.fn), data_source) for t in terms]


class Component:
    """One loaded term: scores samples as its convention says, each verdict judged (`judge`)."""

    def __init__(self, term: RewardTerm, fn: Callable[..., Any], data_source: str = "") -> None:
        self.term, self.fn, self.name, self.weight = term, fn, term.label, term.weight
        self.convention = detect(fn) if term.convention == "auto" else Convention(term.convention)
        self.batched = self.convention in (Convention.BATCHED, Convention.VERL_BATCHED)
        self.data_source = data_source
        try:
            params = inspect.signature(fn).parameters.values()
            self._accepts: set[str] | None = (
                None if any(p.kind is p.VAR_KEYWORD for p in params) else {p.name for p in params}
            )
        except (TypeError, ValueError):
            self._accepts = None

    def score_one(self, sample: Sample, loop: asyncio.AbstractEventLoop) -> Verdict:
        """One call for one sample ("completion" and "verl")."""
        try:
            extra = {kw: _lookup(sample.row, path, kw) for kw, path in self.term.fields.items()}
            if self.convention is Convention.VERL:
                kwargs = {k: v[0] for k, v in self._verl_kwargs([sample]).items()}
                return _verl_verdict(self._call(kwargs, loop))
        except _BadRow as e:
            return None, "bad_row", f"bad row: {e}"
        except BaseException as e:  # a reward that exits costs its sample, not the worker
            return _raised(e)
        return call_reward(self.fn, sample.prompt, sample.completion, {**sample.row, **extra}, loop)

    def score_batch(self, samples: Sequence[Sample], loop: asyncio.AbstractEventLoop) -> list[Verdict]:
        """One call for all of `samples` ("batched" and "verl_batched"); a failure costs all of them."""
        n = len(samples)
        try:
            if self.convention is Convention.VERL_BATCHED:
                kwargs = {f"{k}s": v for k, v in self._verl_kwargs(samples).items()}
            else:
                kwargs = self._trl_kwargs(samples)
            values = self._call(kwargs, loop)
        except _BadRow as e:
            return [(None, "bad_row", f"bad row: {e}")] * n
        except BaseException as e:
            return [_raised(e)] * n
        if isinstance(values, str | bytes | Mapping) or not hasattr(values, "__len__"):
            return [(None, "garbage", f"garbage: a batched reward returned {clip(repr(values))}")] * n
        if len(values) != n:
            return [(None, "garbage", f"garbage: returned {len(values)} values for {n} completions")] * n
        if self.convention is Convention.VERL_BATCHED:
            return [_verl_verdict(v) for v in values]
        return [judge(v) for v in values]

    def _call(self, kwargs: dict[str, Any], loop: asyncio.AbstractEventLoop) -> Any:
        if self._accepts is not None:  # a function without **kwargs gets only what it names
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepts}
        value = self.fn(**kwargs)
        if inspect.isawaitable(value):
            value = loop.run_until_complete(value)
        return value

    def _trl_kwargs(self, samples: Sequence[Sample]) -> dict[str, Any]:
        prompts: list[Any] = [s.prompt for s in samples]
        completions: list[Any] = [s.completion for s in samples]
        if self.term.chat:
            prompts = [[{"role": "user", "content": p}] for p in prompts]
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        columns = sorted({k for s in samples for k in s.row})
        if clash := [c for c in columns if c in _TRL_NAMES]:
            raise _BadRow(f"{clash} are passed by name, not as row fields")
        kwargs: dict[str, Any] = {"prompts": prompts, "completions": completions}
        kwargs.update({c: [s.row.get(c) for s in samples] for c in columns})
        for kw, path in self.term.fields.items():
            kwargs[kw] = [_lookup(s.row, path, kw, default=None) for s in samples]
        return kwargs

    def _verl_kwargs(self, samples: Sequence[Sample]) -> dict[str, list[Any]]:
        fields = self.term.fields
        out: dict[str, list[Any]] = {k: [] for k in _VERL_NAMES}
        for s in samples:
            row = s.row
            if "ground_truth" in fields:
                truth = _lookup(row, fields["ground_truth"], "ground_truth")
            elif (truth := _first(row, GROUND_TRUTH)) is _MISSING:
                raise _BadRow(f"no ground truth: none of {list(GROUND_TRUTH)} is in the row")
            if "data_source" in fields:
                source = _lookup(row, fields["data_source"], "data_source")
            elif (source := _first(row, DATA_SOURCE)) is _MISSING:
                source = self.data_source
            if "extra_info" in fields:
                info = _lookup(row, fields["extra_info"], "extra_info")
            elif (info := _first(row, ("metadata.extra_info",))) is _MISSING:  # a verl file's own column
                info = dict(row.get("metadata") or {})
            for kw, value in zip(_VERL_NAMES, (source, s.completion, truth, info), strict=True):
                out[kw].append(value)
            for kw, path in fields.items():
                if kw not in _VERL_NAMES:
                    out.setdefault(kw, []).append(_lookup(row, path, kw))
        return out


def judge(value: object) -> Verdict:
    """(reward, reason, error) for what a reward function returned."""
    if value is None:
        return None, "none", "none: the reward could not score it"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            reward = float(value)
        except (TypeError, ValueError, OverflowError):
            reward = math.nan
        if math.isfinite(reward):
            return reward, None, None
    return None, "garbage", f"garbage: returned {clip(repr(value))} ({type(value).__name__})"


def call_reward(
    fn: Callable[..., Any], prompt: str, completion: str, row: dict[str, Any], loop: asyncio.AbstractEventLoop
) -> Verdict:
    """One call of `fn` as a worker makes it: awaited in `loop` if async, any exception caught."""
    try:
        value = fn(prompt, completion, **row)
        if inspect.isawaitable(value):
            value = loop.run_until_complete(value)
    except BaseException as e:  # SystemExit too: a reward that exits costs its sample, not the worker
        return _raised(e)
    return judge(value)


def clip(text: str) -> str:
    return text if len(text) <= _CLIP else text[:_CLIP] + "…"


def combine(components: Sequence[Component], parts: Mapping[str, float]) -> Verdict:
    """The weighted sum of a sample's components (each already valid)."""
    total = math.fsum(c.weight * parts[c.name] for c in components)
    if not math.isfinite(total):
        return None, "garbage", f"garbage: the weighted sum is {total}"
    return total, None, None


def named(verdict: Verdict, name: str) -> Verdict:
    """`verdict`'s error with the component's name after its reason: "raised: fmt: ValueError: …"."""
    reward, reason, error = verdict
    head, _, rest = (error or "").partition(": ")
    return reward, reason, f"{head}: {name}: {rest}"


class _BadRow(ValueError):
    pass


_MISSING = object()


def _lookup(row: Mapping[str, Any], path: str, kw: str, default: Any = _MISSING) -> Any:
    found = _get(row, path)
    if found is _MISSING:
        if default is not _MISSING:
            return default
        raise _BadRow(f"no field {path!r} for {kw!r}")
    return found


def _first(row: Mapping[str, Any], paths: Sequence[str]) -> Any:
    for path in paths:
        if (found := _get(row, path)) is not _MISSING and found is not None:
            return found
    return _MISSING


def _get(row: Mapping[str, Any], path: str) -> Any:
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _verl_verdict(value: Any) -> Verdict:
    if isinstance(value, Mapping):
        if "score" not in value:
            return None, "garbage", f"garbage: a dict with no 'score': {clip(repr(value))}"
        value = value["score"]
    if isinstance(value, bool):
        value = float(value)
    return judge(value)


def _raised(e: BaseException) -> Verdict:
    return None, "raised", f"raised: {type(e).__name__}: {clip(str(e))}"
