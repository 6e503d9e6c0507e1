"""`slipstream bench rollout`'s configuration: `RolloutBenchConfig` and the settings it composes.

    slipstream bench rollout --config my.yaml tuner.buckets=[1,4] --json

deploy/configs/bench-rollout.yaml holds the same defaults (tests/benchmarks/test_rollout_bench.py keeps
them equal); `load_config` reads such a file, then the command line's shorthand flags, then `key.sub=value`
overrides. The non-obvious choice: the buckets and every mode's tuner arms are checked (as a TunerConfig
would) when the config is built, so a bad arm of the last mode fails before the first mode starts its
actors. The benchmark itself: benchmarks/rollout.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from slipstream.engine.tuner import TunerConfig
from slipstream.runtime import config as run_config

__all__ = [
    "MODES",
    "SHORTHANDS",
    "DrafterSettings",
    "Mode",
    "ModeArms",
    "RolloutBenchConfig",
    "RolloutSettings",
    "TunerSettings",
    "load_config",
]

Mode = Literal["plain", "ngram", "adaptive"]
MODES: tuple[Mode, ...] = ("plain", "ngram", "adaptive")
Positive = Annotated[int, msgspec.Meta(ge=1)]


def _list(*items: Any) -> Any:
    """A list default (msgspec wants a factory for non-empty ones)."""
    return msgspec.field(default_factory=lambda: list(items))


class ModeArms(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The tuner's arms in each mode (grammar: engine/tuner.py). Quote "off" in YAML: bare, it is false."""

    plain: list[str] = _list("off")  # plain decoding: the baseline every speedup is measured against
    # Deep n-gram chains pay off in the tail, where a lone long response often repeats itself or a sibling.
    ngram: list[str] = _list("off", "ngram:d3", "ngram:d5", "ngram:d8")  # what a user without a drafter gets
    # EAGLE trees and depth 7 lost in every bucket on one CPU thread per device, and every arm costs
    # exploration; "hybrid" drafts with the n-gram tables where they match and with the head elsewhere.
    adaptive: list[str] = _list(
        "off", "ngram:d3", "ngram:d5", "ngram:d8", "eagle:d3", "hybrid:d3", "hybrid:d5"
    )

    def __post_init__(self) -> None:
        for mode in MODES:  # every mode's arms are checked before the first mode starts
            try:
                TunerConfig(arms=list(getattr(self, mode)))
            except ValueError as e:  # "TunerConfig.arms[1]: …" → "ngram[1]: …"
                raise ValueError(f"{mode}{str(e).removeprefix('TunerConfig.arms')}") from None


class TunerSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The rollout actors' tuner: buckets shared by every mode, each mode's arms."""

    buckets: list[int] = _list(1, 2, 3, 5, 9, 17)  # lower edges of the batch-size buckets (also the report's)
    arms: ModeArms = msgspec.field(default_factory=ModeArms)

    def __post_init__(self) -> None:
        try:
            TunerConfig(buckets=list(self.buckets))
        except ValueError as e:  # "TunerConfig.buckets[1]: …" → "buckets[1]: …"
            raise ValueError(str(e).removeprefix("TunerConfig.")) from None

    def config(self, mode: Mode, *, seed: int) -> TunerConfig:
        return TunerConfig(buckets=list(self.buckets), arms=list(getattr(self.arms, mode)), seed=seed)


class RolloutSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What the bench sets on each rollout actor; the model, batch and length follow from the workload."""

    spec_mode: Literal["rejection", "reproducible"] = (
        "reproducible"  # reproducible: plain's tokens in every mode
    )


class DrafterSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What the bench sets on each drafter actor (adaptive mode); the group and its peers follow from it."""

    batch_tokens: Positive = 512  # tokens per training step: short, so a preemption waits at most one
    publish_every_steps: Positive = 10  # drafter versions between updates pushed to the rollouts
    checkpoint_every_steps: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: none (the run directory is temporary)


class RolloutBenchConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """`bench rollout`'s configuration; deploy/configs/bench-rollout.yaml holds the same defaults."""

    model: str = "smollm2-135m"  # model directory or registry name
    device: Literal["cpu", "cuda"] = "cpu"  # cpu: a core per rollout/drafter pair; cuda: a GPU each
    task: str = "basic_arithmetic"  # reasoning-gym task (a model without a tokenizer gets random prompts)
    prompts: Positive = 8  # prompts (GRPO groups) per RL step
    samples: Positive = 4  # responses per prompt (G)
    max_tokens: Positive = 512  # new tokens per response at most; EOS is honoured
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.7  # sampling temperature
    seed: int = 0  # seed of the prompts and of the sampling
    steps: Positive = 4  # RL steps per mode, each on fresh prompts; all but the first are measured
    modes: Annotated[list[Mode], msgspec.Meta(min_length=1)] = _list(*MODES)  # which modes run, in order
    drafter: str = (
        ""  # adaptive: the warmed EAGLE head to start from; "" = a cached warmup, made on first use
    )
    warmup_steps: Positive = 1000  # optimizer steps of that warmup when it has to be made
    spans: bool = False  # actors record spans (runtime/spans.py), as `train` does by default: their cost
    tuner: TunerSettings = msgspec.field(default_factory=TunerSettings)
    rollout_actors: RolloutSettings = msgspec.field(default_factory=RolloutSettings)
    drafter_actors: DrafterSettings = msgspec.field(default_factory=DrafterSettings)

    def __post_init__(self) -> None:
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes: {self.modes} names a mode twice")


SHORTHANDS = ("model", "task", "prompts", "samples", "max_tokens", "temperature", "seed", "steps", "drafter")
"""Top-level fields that the command line also takes as flags (--max-tokens …); --modes a,b sets modes."""


def load_config(
    path: Path | str | None = None, overrides: Sequence[str] = (), **flags: Any
) -> RolloutBenchConfig:
    """The YAML at `path` (None: the defaults), then the flags given (None: not given), then `key.sub=value`
    overrides; converted strictly, so a wrong key or type raises ConfigError naming the dotted field."""
    given = [f"{key}={json.dumps(value)}" for key, value in flags.items() if value is not None]
    return run_config.load(path, RolloutBenchConfig, [*given, *overrides])  # JSON values are YAML too
