"""The tuner's vocabulary: speculation arms (`Arm`, `parse_arm`) and its config (`TunerConfig`).

Apart from the bandit (`tuner.py`), so a config can be parsed, checked and embedded in a YAML section
without it.

Arm grammar (`TunerConfig.arms`): ``off`` or ``METHOD[:dD][kK][vV]``: METHOD ngram, eagle, hybrid, history,
cascade or self; D
the depth (default 4), K the top-k (1 = a chain), V the verify budget (0 = depth * topk), as in `SpecConfig`.
Names are canonical (``ngram`` → ``ngram:d4``). Examples: ``ngram:d3``, ``eagle:d6``, ``eagle:d4k4v16``.
`TunerConfig.__post_init__` checks every field and names it in its error, so a bad YAML value fails at load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from slipstream.engine.speculator import SpecConfig, SpecMode

__all__ = ["OFF", "Arm", "TunerConfig", "is_int", "parse_arm"]

_ARM = re.compile(
    r"(?P<method>ngram|eagle|hybrid|history|cascade|self)(?::(?:d(?P<d>\d+))?(?:k(?P<k>\d+))?(?:v(?P<v>\d+))?)?"
)


@dataclass(frozen=True)
class Arm:
    """One way to decode: a drafter kind and its shape (the name grammar is in the module docstring)."""

    name: str
    """Canonical spec string, e.g. "eagle:d4k4v16": the arm's key in decisions, logs and state."""
    method: str
    """"off", "ngram", "eagle", "hybrid", "history", "cascade" or "self"."""
    depth: int = 4
    topk: int = 1
    verify: int = 0

    def spec(self, mode: SpecMode = "rejection") -> SpecConfig:
        """The `SpecConfig` to pass to `Generator.set_spec` (mode: how sampling rows are verified)."""
        if self.method == "off":
            return SpecConfig(method="off", mode=mode)
        return SpecConfig(
            method=self.method,  # type: ignore[arg-type]  # parse_arm admits only SpecConfig's methods
            depth=self.depth,
            topk=self.topk,
            verify=self.verify,
            mode=mode,
        )


OFF = Arm("off", "off")


def parse_arm(text: str) -> Arm:
    """The `Arm` a spec string names ("off", "ngram:d3", "eagle:d4k4v16"); ValueError if malformed."""
    if text == "off":
        return OFF
    m = _ARM.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(
            f"{text!r} is not an arm: expected off or (ngram|eagle|hybrid|history|cascade|self)[:dD][kK][vV], e.g. eagle:d4k4v16"
        )
    method = m.group("method")
    depth, topk, verify = (int(m.group(g) or default) for g, default in (("d", 4), ("k", 1), ("v", 0)))
    try:
        SpecConfig(method=method, depth=depth, topk=topk, verify=verify)
    except ValueError as e:
        raise ValueError(f"{text!r}: {e}") from None
    name = f"{method}:d{depth}" + (f"k{topk}" if topk != 1 else "") + (f"v{verify}" if verify else "")
    return Arm(name, method, depth, topk, verify)


class TunerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The tuner's buckets, arms and exploration; meant to sit in the rollout actor's YAML config."""

    buckets: list[int] = msgspec.field(default_factory=lambda: [1, 2, 3, 5, 9, 17])
    """Lower edges of the batch-size buckets, strictly increasing from 1; the last bucket is open-ended."""
    arms: list[str] = msgspec.field(
        default_factory=lambda: ["off", "ngram:d3", "ngram:d6", "eagle:d3", "eagle:d6", "eagle:d4k4v16"]
    )
    """Arm specs (grammar in the module docstring); "off" is added to every bucket if missing."""
    epsilon: float = 0.1
    """Share of decisions (once every arm is tried) that may explore an arm other than the current best."""
    window: int = 16
    """Reward samples kept per (bucket, arm); the estimate is their median."""
    max_batch: dict[str, int] = msgspec.field(default_factory=dict)
    """Arm → the largest live batch size it is offered at (arms not named: every batch size). A prior the user
    knows and the bandit would pay to learn: where a verify pass costs several plain ones (a CPU core past
    batch ~4), every look at a speculating arm loses, and ε-greedy keeps looking (docs/engine.md, "Tuner").
    vLLM's `disable_by_batch_size`, per arm. "off" cannot be capped."""
    margin: float = 0.0
    """How much a speculating arm's median reward (a speedup over plain decoding) must exceed "off"'s for the
    tuner to exploit it: one look at an arm that breaks even, at a batch where a verify pass costs 2-4 plain
    ones, otherwise settles a bucket on it until the window turns (docs/engine.md, "Tuner")."""
    min_trials: int = 1
    """Samples an available arm needs in a bucket's window before the tuner exploits there (<= window)."""
    hold: int = 4
    """Iterations a bucket keeps a chosen arm; they pool into one reward sample (1 = decide every iteration)."""
    seed: int = 0
    """Seed of the exploration draws."""
    stale_window: int = 32
    """Iterations of a drafter method (eagle, hybrid) over which its acceptance is judged for staleness."""
    stale_accept: float = 0.05
    """A method whose accepted draft tokens per sequence per pass stay below this over a full `stale_window`
    is stale: never chosen until its drafter changes (0 = never stale)."""

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_buckets()
        self._check_max_batch(self._check_arms())

    def _check_numbers(self) -> None:
        for field, least in (("window", 1), ("min_trials", 1), ("hold", 1), ("stale_window", 1)):
            value = getattr(self, field)
            if not is_int(value) or value < least:
                raise ValueError(f"TunerConfig.{field}: must be an integer >= {least}, got {value!r}")
        if not is_int(self.seed):
            raise ValueError(f"TunerConfig.seed: must be an integer, got {self.seed!r}")
        if not _is_real(self.margin) or not 0 <= self.margin < 1:
            raise ValueError(f"TunerConfig.margin: must lie in [0, 1), got {self.margin!r}")
        if self.min_trials > self.window:
            raise ValueError(f"TunerConfig.min_trials: {self.min_trials} exceeds window ({self.window})")
        if not _is_real(self.epsilon) or not 0 <= self.epsilon <= 1:
            raise ValueError(f"TunerConfig.epsilon: must lie in [0, 1], got {self.epsilon!r}")
        if not _is_real(self.stale_accept) or not 0 <= self.stale_accept < float("inf"):
            raise ValueError(
                f"TunerConfig.stale_accept: must be a finite number >= 0, got {self.stale_accept!r}"
            )

    def _check_buckets(self) -> None:
        if not self.buckets or self.buckets[0] != 1:
            raise ValueError(
                f"TunerConfig.buckets: must start at 1 (the first bucket's lower edge), got {self.buckets}"
            )
        for i in range(1, len(self.buckets)):
            lo, hi = self.buckets[i - 1], self.buckets[i]
            if not is_int(hi) or hi <= lo:
                raise ValueError(
                    f"TunerConfig.buckets[{i}]: {hi!r} must be an integer above buckets[{i - 1}] = {lo}"
                )

    def _check_arms(self) -> dict[str, int]:
        """Canonical arm name → its index in `arms` (each parses, none repeats another)."""
        seen: dict[str, int] = {}
        for i, text in enumerate(self.arms):
            try:
                name = parse_arm(text).name
            except ValueError as e:
                raise ValueError(f"TunerConfig.arms[{i}]: {e}") from None
            if name in seen:
                raise ValueError(
                    f"TunerConfig.arms[{i}]: {text!r} repeats arms[{seen[name]}] (both are {name})"
                )
            seen[name] = i
        return seen

    def _check_max_batch(self, arms: dict[str, int]) -> None:
        for text, cap in self.max_batch.items():
            try:
                name = parse_arm(text).name
            except ValueError as e:
                raise ValueError(f"TunerConfig.max_batch: {e}") from None
            if name == "off":
                raise ValueError(
                    "TunerConfig.max_batch: off cannot be capped (it is the fallback everywhere)"
                )
            if name not in arms:
                raise ValueError(f"TunerConfig.max_batch: {text!r} is not one of the arms {list(arms)}")
            if not is_int(cap) or cap < 1:
                raise ValueError(f"TunerConfig.max_batch[{text!r}]: must be an integer >= 1, got {cap!r}")


def is_int(value: object) -> bool:
    """An int that is not a bool (a YAML `true` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """An int or float that is not a bool."""
    return not isinstance(value, bool) and isinstance(value, int | float)
