"""The run directory's files: metrics records, samples files, checkpoints and the resume state.

`slipstream train` writes and reads them through these functions (layout: docs/training.md). What a resume
or a restarted learner needs is here: state.json names the newest checkpoint relative to the directory and
the data cursor; metrics.jsonl holds each step's record once. The samples record (samples/step-N.jsonl,
every response with its behaviour log-probs) is the learner's to write: protocols/samples_record.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "CHECKPOINT_FILE",
    "StepRecord",
    "checkpoint_dirs",
    "prune_checkpoints",
    "read_records",
    "read_state",
    "render",
    "summary",
    "write_records",
    "write_state",
]


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One line of metrics.jsonl."""

    step: int
    reward_mean: float  # over valid samples
    correct_share: float  # valid samples with reward >= 1
    nonzero_adv_share: float  # groups whose rewards differ (they carry the gradient)
    invalid: int  # samples whose reward failed (masked out)
    tokens: int
    mean_response_tokens: float
    step_s: float
    rollout_s: float
    reward_s: float  # from the last completion to the last reward
    learn_s: float
    sync_s: float  # weight push until every rollout acknowledged
    accept_length: float  # over every decode iteration: 1.0 where the tuner ran plain decoding
    arms: dict[str, int]
    spec_accept_length: float = 0.0  # over the iterations that speculated (0.0: none did)
    spec_token_share: float = 0.0  # share of decoded tokens that speculating iterations committed
    # batch-size bucket -> tokens per sequence per target pass over the iterations that speculated there
    accept_by_batch: dict[str, float] = {}
    # batch-size bucket -> tuner arm -> decode iterations
    arms_by_batch: dict[str, dict[str, int]] = {}
    # batch-size bucket -> [decode device-seconds, committed tokens] over every rollout: where the rollout's
    # time went by batch size
    decode_by_batch: dict[str, list[float]] = {}
    # per draft depth: the share of sequence-passes whose draft reached it that accepted its token
    accept_by_position: list[float] = []
    # tuner arm -> batch-size bucket -> {iterations, accept_length, draft_ms_per_token, token_share,
    # tokens_per_s}: what each arm bought and cost where it ran (rl/step.py `arm_table`)
    arm_table: dict[str, dict[str, dict[str, float]]] = {}
    drafter_loss: float | None = None  # the drafter's newest training loss in the step (None: none trained)
    sync_bytes: int = 0  # one copy of the pushed policy (push dtype); same-host rollouts share it
    # Across nodes: bytes the step's pushes sent to other hosts (deltas where a base was held), and what full
    # buckets would have been; 0 and 0 on one host
    wire_bytes: int = 0
    wire_full_bytes: int = 0
    idle_device_s: float
    reclaimed_s: float
    loss: float
    grad_norm: float
    mismatch_logp_abs_max: float
    policy_version: int
    reward_errors: dict[str, int] = {}  # why rewards failed: error → samples
    restarts: list[str] = []  # actors restarted during the step
    checkpoint_s: float = 0.0  # saving the run's checkpoint after the sync (0: none this step)
    requeued: int = 0  # samples and score requests dealt again after their actor died
    duplicates: int = 0  # results dropped because their (group, sample) had come back already
    # Reward calls during the step (rollout and reward tail), summed over workers and verifiers: their
    # seconds, and per term {calls, samples, seconds, batch_mean, batch_max, invalid} (rl/step.py)
    reward_call_s: float = 0.0
    reward_terms: dict[str, dict[str, float]] = {}
    # Multi-turn episodes (issue 42): policy turns per sample, the mean and the most (0 and 0: single-turn)
    turns_mean: float = 0.0
    turns_max: int = 0
    # policy turns -> samples with that many ({"1": n, "2": n, ...}: the long tail in turns; {}: single-turn)
    turns_by_count: dict[str, int] = {}
    # seconds samples waited for their environment's answers (each turn sent to its answer): summed over the
    # step's samples (sample-seconds: samples wait at once), and the most one sample waited
    env_wait_s: float = 0.0
    env_wait_max_s: float = 0.0


CHECKPOINT_FILE = "learner"
"""The learner's checkpoint in each checkpoints/step-N directory: a torch.distributed.checkpoint directory
(engine/policy_checkpoint.py; runs before 2026-12 wrote a `learner.pt` file, still read)."""


def checkpoint_dirs(run_dir: Path) -> dict[int, Path]:
    """The run's checkpoints/step-N directories by step, oldest first."""
    steps = sorted(
        (int(p.name.removeprefix("step-")), p)
        for p in (run_dir / "checkpoints").glob("step-*")
        if p.is_dir() and p.name.removeprefix("step-").isdigit()
    )
    return dict(steps)


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Deletes all but the newest `keep` checkpoints/step-N directories (state.json names the newest)."""
    for path in list(checkpoint_dirs(run_dir).values())[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def read_records(path: Path, *, before: int) -> list[StepRecord]:
    """The metrics of steps before `before`, once each (a crashed run may have written a step twice)."""
    if not path.is_file():
        return []
    by_step: dict[int, StepRecord] = {}
    for line in path.read_text().splitlines():
        try:
            record = msgspec.json.decode(line, type=StepRecord)
        except msgspec.DecodeError:  # a line cut short by the crash
            continue
        if record.step < before:
            by_step[record.step] = record
    return [by_step[k] for k in sorted(by_step)]


def write_records(path: Path, records: list[StepRecord]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(msgspec.json.encode(r).decode() + "\n" for r in records))
    os.replace(tmp, path)


def read_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "checkpoints" / "state.json"
    if not path.is_file():
        raise ValueError(f"--resume {run_dir}: no checkpoint in this run directory ({path} is missing)")
    return json.loads(path.read_text())


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    path = run_dir / "checkpoints" / "state.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)  # atomic, written after the learner's checkpoint it names


def summary(
    config: dict[str, Any], records: list[StepRecord], run_dir: Path, *, baseline: bool
) -> dict[str, Any]:
    """summary.json: the run's config, every step's record, and the rewards at both ends."""
    steps = [msgspec.structs.asdict(r) for r in records]
    first, last = (steps[0], steps[-1]) if steps else ({}, {})
    return {
        "run_dir": str(run_dir),
        "baseline": baseline,
        "config": config,
        "steps": steps,
        "first_reward": first.get("reward_mean"),
        "last_reward": last.get("reward_mean"),
        "invalid": sum(r.invalid for r in records),
        "step_s_mean": round(sum(r.step_s for r in records) / max(len(records), 1), 3),
    }


def _spec_accept(record: dict[str, Any]) -> str:
    """The accept length over the step's speculating iterations, "-" where none speculated."""
    value = record.get("spec_accept_length", 0.0)
    return f"{value:.2f}" if value else "-"


def render(summary: dict[str, Any]) -> str:
    """The run's summary as a table, one row per step: `accept` over the iterations that speculated and
    `spec` the share of tokens they committed."""
    head = (
        f"{'step':>4} {'reward':>7} {'correct':>7} {'mixed':>6} {'inval':>5} {'tok':>6} {'step s':>7} "
        f"{'roll':>6} {'rew':>5} {'learn':>6} {'sync':>5} {'accept':>6} {'spec':>5} {'idle s':>6} {'reclaim':>7}"
    )
    lines = [head]
    for r in summary["steps"]:
        lines.append(
            f"{r['step']:>4} {r['reward_mean']:>7.3f} {r['correct_share']:>7.3f} {r['nonzero_adv_share']:>6.2f} "
            f"{r['invalid']:>5} {r['tokens']:>6} {r['step_s']:>7.1f} {r['rollout_s']:>6.1f} {r['reward_s']:>5.2f} "
            f"{r['learn_s']:>6.1f} {r['sync_s']:>5.2f} {_spec_accept(r):>6} {r.get('spec_token_share', 0.0):>5.0%} "
            f"{r['idle_device_s']:>6.1f} {r['reclaimed_s']:>7.1f}"
        )
    lines.append(
        f"reward {summary['first_reward']} -> {summary['last_reward']} over {len(summary['steps'])} steps; "
        f"{summary['invalid']} invalid samples; summary.json and metrics.jsonl in {summary['run_dir']}"
    )
    return "\n".join(lines)
