"""Metric sinks: each step's record also as TensorBoard event files or an offline wandb run (both off).

The loop (rl/loop.py) appends a step's record to metrics.jsonl, then hands the same record to each sink
that `metrics.sinks` names. A sink keeps the numeric scalars, nested dicts flattened with "/" (arms/off,
accept_by_batch/1), and skips the rest (lists, strings). Each sink's package is an extra, looked for when
the run starts (`require_sinks`): a missing one is named, with its `pip install`, before anything spawns.

TensorBoard: RUN/tensorboard/, flushed after every step. Each start of a run adds a file there that
opens with a purge at its first step, so TensorBoard shows each step once, as metrics.jsonl holds them.
wandb: mode="offline", dir=RUN (uploaded by `wandb sync`), named after the run directory; it cannot resume
an offline run (wandb/wandb#2423), so a resumed run is a second wandb run of the same name.

    metrics: {sinks: [tensorboard, wandb], wandb_project: grpo}     # in a config, or as overrides:
    slipstream train 'metrics.sinks=[tensorboard]'    # needs pip install 'slipstream[tensorboard]'
    tensorboard --logdir runs/
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from slipstream.runtime.config import ConfigError

SinkName = Literal["tensorboard", "wandb"]


class MetricsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    sinks: list[SinkName] = []  # where each step's record also goes, besides metrics.jsonl
    wandb_project: str = ""  # the wandb project ("" = wandb's default); the run is named after RUN


class Sink(Protocol):
    def write(self, step: int, record: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's numbers by name, nested dicts flattened with "/"; anything else is left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, int | float):  # a bool counts as 0/1
            out[name] = float(value)
    return out


def require_sinks(config: MetricsConfig) -> None:
    """Refuses, naming the extra to install, a sink whose package is missing (cheap: nothing is imported)."""
    for name in config.sinks:
        if importlib.util.find_spec(name) is None:  # the module is named as its sink
            raise ConfigError(f"metrics.sinks: {name} needs `pip install 'slipstream[{name}]'`")


class TensorBoardSink:
    """Scalars into event files under `log_dir`; what was logged there at `resume_step` or later is hidden."""

    def __init__(self, log_dir: Path, *, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir), purge_step=resume_step)
        self._writer.flush()  # the purge is on disk before the first step

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """An offline wandb run in `run_dir`/wandb/, one history row per step."""

    def __init__(self, run_dir: Path, *, project: str = "", config: Mapping[str, Any] | None = None) -> None:
        import wandb

        self._run = wandb.init(
            mode="offline",
            dir=str(run_dir),
            project=project or None,
            name=run_dir.name,
            config=dict(config or {}),
        )

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        self._run.log(scalars(record), step=step)

    def close(self) -> None:
        self._run.finish()


class Sinks:
    """The run's sinks as one: each step to every sink; `close` closes all, then raises the first error."""

    def __init__(self, sinks: list[Sink]) -> None:
        self._sinks = sinks

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        for sink in self._sinks:
            sink.write(step, record)

    def close(self) -> None:
        errors = []
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as e:  # the others still close
                errors.append(e)
        self._sinks = []
        if errors:
            raise errors[0]


def open_sinks(
    config: MetricsConfig, run_dir: Path, *, resume_step: int = 0, run_config: Mapping[str, Any] | None = None
) -> Sinks:
    """The sinks `config` names, writing into `run_dir`; `resume_step`: the step a resumed run starts at."""
    require_sinks(config)
    opened: list[Sink] = []
    try:
        for name in dict.fromkeys(config.sinks):  # a sink named twice opens once
            if name == "tensorboard":
                opened.append(TensorBoardSink(run_dir / "tensorboard", resume_step=resume_step))
            else:
                opened.append(WandbSink(run_dir, project=config.wandb_project, config=run_config))
    except BaseException:
        with contextlib.suppress(Exception):  # the error that stopped the opening is the one to see
            Sinks(opened).close()
        raise
    return Sinks(opened)


__all__ = [
    "MetricsConfig",
    "Sink",
    "SinkName",
    "Sinks",
    "TensorBoardSink",
    "WandbSink",
    "open_sinks",
    "require_sinks",
    "scalars",
]
