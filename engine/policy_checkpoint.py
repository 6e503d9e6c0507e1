"""The learner's checkpoint: policy and AdamW state through torch.distributed.checkpoint, one directory.

`save_policy(path, model, optimizer, steps=…, version=…)` has every rank write its own shards (a sharded
model's DTensors; a one-rank model's whole tensors) into `path`.tmp, then rank 0 renames it to `path`:
a reader sees the previous checkpoint or the new one, never half of one. `load_policy` reads one onto
any number of ranks (DCP reshards: saved on 2, resumed on 1, and back); `read_weights` gathers the full
policy with no process group (HF export, `hf/`). A directory's `trainer.json` holds the step count and
the policy version. A `learner.pt` file from before (torch.save) still loads on one rank.

Non-obvious choices:
- State dicts through `torch.distributed.checkpoint.state_dict.get_state_dict`: parameter names (FQNs),
  not optimizer indices, key AdamW's state, so a checkpoint does not depend on how the ranks cut it.
- `read_weights` sizes its tensors from the checkpoint's own metadata: nothing needs the model built.
Run: `python -m pytest tests/engine/test_sharding.py -k checkpoint`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = [
    "TRAINER_FILE",
    "checkpoint_version",
    "is_checkpoint",
    "load_policy",
    "read_weights",
    "save_policy",
]

TRAINER_FILE = "trainer.json"
"""In a checkpoint directory: {"steps": optimizer steps taken, "version": policy version}."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        yield


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint at `path`: a directory with DCP's metadata and the trainer file, or a
    legacy torch.save file."""
    return path.is_file() or ((path / ".metadata").is_file() and (path / TRAINER_FILE).is_file())


def save_policy(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, steps: int, version: int
) -> None:
    """Every rank calls it (a collective when sharded). The checkpoint is at `path` when it returns."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    rank, world = _world()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    if world > 1:
        dist.barrier()  # nobody writes into the directory rank 0 is clearing
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        with _one_process_is_meant():
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
        if rank == 0:
            (tmp / TRAINER_FILE).write_text(json.dumps({"steps": steps, "version": version}))
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # half a checkpoint on a full disk holds what is left
        raise
    if rank == 0:
        old = target.with_name(target.name + ".old")
        if target.is_dir():
            os.replace(target, old)
        elif target.exists():
            target.unlink()
        os.replace(tmp, target)  # atomic: the old checkpoint or the new one, never half
        shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier()  # every rank returns with the checkpoint in place


def load_policy(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Loads a checkpoint into `model` and `optimizer` (every rank calls it; any rank count); returns
    {"steps", "version"}."""
    source = Path(path)
    if source.is_file():
        return _load_legacy(source, model, optimizer)
    if not is_checkpoint(source):
        raise ValueError(f"{source}: not a learner checkpoint (no .metadata or {TRAINER_FILE})")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    with _one_process_is_meant():
        dcp.load(state, checkpoint_id=source)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    info = json.loads((source / TRAINER_FILE).read_text())
    return {"steps": int(info["steps"]), "version": int(info["version"])}


def _load_legacy(source: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """A learner.pt written by torch.save (one rank: its optimizer state is keyed by parameter index)."""
    if _world()[1] > 1:
        raise ValueError(f"{source}: a learner.pt checkpoint (torch.save) resumes on one rank only")
    device = next(model.parameters()).device
    state = torch.load(source, weights_only=True, map_location=device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["trainer"]["optimizer"])
    return {"steps": int(state["trainer"]["steps"]), "version": int(state["version"])}


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The full policy in a checkpoint (name -> fp32 tensor on the CPU), with no process group and no
    model: for export. The optimizer's state is never read."""
    source = Path(path)
    if source.is_file():
        state: Any = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise ValueError(f"{source}: not a learner checkpoint (no 'model' state)")
        return dict(state["model"])
    if not is_checkpoint(source):
        raise ValueError(f"{source}: not a learner checkpoint (no .metadata or {TRAINER_FILE})")
    metadata = dcp.FileSystemReader(source).read_metadata()
    weights = {
        key.removeprefix("model."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not weights:
        raise ValueError(f"{source}: a checkpoint with no model weights")
    with _one_process_is_meant():
        dcp.load({"model": weights}, checkpoint_id=source, no_dist=True)
    return weights


def checkpoint_version(path: str | Path) -> int:
    """The policy version a checkpoint holds (0 where an old file does not say)."""
    source = Path(path)
    if source.is_file():
        return int(torch.load(source, map_location="cpu", weights_only=True, mmap=True).get("version", 0))
    return int(json.loads((source / TRAINER_FILE).read_text())["version"])
