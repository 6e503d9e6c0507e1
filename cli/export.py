"""`slipstream export`: a run's trained policy as a Hugging Face model directory.

    slipstream export runs/train-…  --out exported/policy            # the newest checkpoint
    slipstream export runs/train-…  --step 20 --out exported/step-20 [--dtype bfloat16] [--force]

Reads `checkpoints/step-N/learner` (the learner's fp32 masters, gathered from its shards) and the run's config.json for the model
it started from, whose config and tokenizer files the export takes (`engine/hf_export.py`: layout, name
map, sharding). The result is the HF layout vLLM and SGLang read: it loads with
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and as `model: DIR` in a new `slipstream train`.
Prints the directory on stdout.

Non-obvious choices:
- The checkpoint is memory-mapped: it also holds the optimizer's moments (twice the policy), never read.
- Tensors are written in the source model's dtype unless `--dtype` says otherwise: `float32` keeps the
  masters bit for bit; a bf16 model exports bf16, the masters rounded once.
- `export_checkpoint` is the whole export from one checkpoint file, for `train` to call after its last
  checkpoint (`checkpoint.hf`) without reading the run's config.json.
- torch and the engine are imported when an export runs, not with the parser: every other subcommand
  builds this parser too.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "add_parser",
    "checkpoints",
    "export_checkpoint",
    "export_run",
    "find_checkpoint",
    "parse_size",
    "run",
    "run_model",
]

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""The shard size past which weights are split, as `--max-shard-size` takes it (hf_export's default)."""


def checkpoints(run_dir: Path) -> dict[int, Path]:
    """Every complete learner checkpoint of a run: step → checkpoints/step-N/learner (the learner writes
    it atomically, so one that exists is whole; an older run's learner.pt file counts too)."""
    from slipstream.engine.policy_checkpoint import is_checkpoint  # torch: not with the parser
    from slipstream.rl.run_dir import CHECKPOINT_FILE, checkpoint_dirs

    found = {}
    for step, path in checkpoint_dirs(run_dir).items():
        for name in (CHECKPOINT_FILE, "learner.pt"):
            if is_checkpoint(path / name):
                found[step] = path / name
                break
    return found


def find_checkpoint(run_dir: Path, step: int | None = None) -> tuple[int, Path]:
    """(step, checkpoint file): the newest when `step` is None; ValueError naming the run directory and
    the steps it has otherwise."""
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    found = checkpoints(run_dir)
    if not found:
        raise ValueError(
            f"{run_dir}: no checkpoint in this run directory (checkpoints/step-N/learner); "
            "a run checkpoints every `checkpoint_every` steps"
        )
    if step is None:
        return next(reversed(found.items()))
    if step not in found:
        have = ", ".join(str(s) for s in found)
        raise ValueError(f"{run_dir}: no checkpoint for step {step} (this run has steps {have})")
    return step, found[step]


def run_model(run_dir: Path) -> str:
    """The `model` the run trained (its config.json, as `train` resolved it)."""
    path = run_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{run_dir}: not a training run directory (no config.json)")
    try:
        model = json.loads(path.read_text()).get("model")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a run config ({e})") from None
    if not isinstance(model, str) or not model:
        raise ValueError(f"{path}: has no 'model' field")
    return model


def export_checkpoint(
    checkpoint: Path,
    *,
    model: str | Path,
    out: Path,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the policy in `checkpoint` (a learner checkpoint) as an HF model directory at `out`, taking config and
    tokenizer from `model` (a model directory or registry name: the run's `model`). dtype: "float32",
    "bfloat16" or "float16"; None = the model's own. max_shard_bytes: None = hf_export's default (5 GB).
    Returns `out`."""
    from slipstream.engine import hf_export, hub
    from slipstream.engine.config import ModelConfig, dtype_from_name
    from slipstream.engine.policy_checkpoint import checkpoint_version, read_weights

    try:
        model_dir = hub.resolve(model)
    except ValueError as e:
        raise ValueError(f"the run's model: {e}") from None
    config = ModelConfig.from_pretrained(model_dir)
    # The weights only: the optimizer state beside them is never read.
    try:
        weights, version = read_weights(checkpoint), checkpoint_version(checkpoint)
    except (RuntimeError, EOFError, OSError, KeyError) as e:  # a damaged or foreign checkpoint
        raise ValueError(f"{checkpoint}: not a readable learner checkpoint ({e})") from None
    try:
        return hf_export.export(
            config,
            weights,
            out,
            source=model_dir,
            dtype=dtype_from_name(dtype, field="dtype") if dtype else None,
            max_shard_bytes=max_shard_bytes or hf_export.DEFAULT_MAX_SHARD_BYTES,
            overwrite=overwrite,
            info={
                "checkpoint": str(checkpoint),
                "step": step,
                "policy_version": version,
                "base_model": str(model_dir),
                "weights": f"learner fp32 masters written as {dtype or config.torch_dtype}",
            },
        )
    except ValueError as e:
        raise ValueError(f"{checkpoint}: {e}") from None


def export_run(
    run_dir: Path,
    out: Path,
    step: int | None = None,
    *,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Export a run's checkpoint at `step` (None: the newest) to `out`; returns `out`."""
    run_dir = Path(run_dir)
    found_step, checkpoint = find_checkpoint(run_dir, step)
    return export_checkpoint(
        checkpoint,
        model=run_model(run_dir),
        out=Path(out),
        step=found_step,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes from "5GB", "500MB", "2GiB" or a plain integer (HF's units: GB = 10^9)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a size like 5GB, 500MB or 2GiB: {text!r}")
    return max(1, int(float(match.group(1)) * _UNITS[unit]))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`slipstream export` on the command's subparsers."""
    p = subparsers.add_parser("export", help="write a run's trained policy as a Hugging Face model directory")
    p.add_argument("run", type=Path, help="the run directory (runs/train-…)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    p.add_argument("--out", type=Path, required=True, help="the directory to write")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="tensor dtype (default: the model's own)")
    p.add_argument(
        "--max-shard-size", type=parse_size, default=parse_size(DEFAULT_MAX_SHARD_SIZE),
        help=f"shard the weights past this size, HF's units (default {DEFAULT_MAX_SHARD_SIZE})",
    )  # fmt: skip
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p


def run(args: argparse.Namespace) -> int:
    """`slipstream export`: prints the written directory; errors go to stderr with status 1."""
    try:
        out = export_run(
            args.run, args.out, args.step, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
            overwrite=args.force,
        )  # fmt: skip
    except FileExistsError as e:
        print(f"slipstream export: {e.args[0] if e.args else e}; pass --force to replace it", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"slipstream export: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0
