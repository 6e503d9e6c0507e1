"""What the rollout's speculation learns, kept past an iteration: the tuner's state and the EAGLE head.

A rank's tuner state lives in the run directory (`TunerFile`): a restarted rollout resumes from what its
predecessor measured. The EAGLE head starts as an exported one (`RolloutActor.Config.drafter`) or untrained,
to be trained online (`start_eagle`). Of the `DrafterUpdate`s that arrive, `HeadSwap` keeps the newest only
and swaps it in between iterations: a drafter that publishes faster than the rollout decodes costs a clone
per update, never a swap per update. Non-obvious: a swap tells the tuner. A new head revives a method
benched as stale (after a policy update alone the same head would only lag further), and only after
`retune_versions` versions are the eagle and hybrid arms measured again: every forget costs min_trials x
hold iterations per bucket and arm.

Not an actor: the rollout's own part; it receives the updates and says when to swap and save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import torch

from slipstream.engine import eagle_export
from slipstream.engine.drafters import EagleDrafter
from slipstream.engine.eagle import EagleHead
from slipstream.engine.model import Transformer
from slipstream.engine.tuner import STALE_METHODS, Tuner
from slipstream.protocols.drafter import DrafterUpdate
from slipstream.runtime.codec import checksum

__all__ = ["HeadSwap", "TunerFile", "start_eagle"]


class TunerFile:
    """A rollout rank's tuner state on disk: run_dir/rollout/rank-N/tuner.json."""

    def __init__(self, run_dir: str, rank: int) -> None:
        self.path = Path(run_dir or ".") / "rollout" / f"rank-{rank}" / "tuner.json"

    def restore(self, tuner: Tuner) -> bool:
        """Into `tuner`, what a predecessor saved; False if none did."""
        if not self.path.is_file():
            return False
        tuner.load_state_dict(json.loads(self.path.read_text()))
        return True

    def save(self, tuner: Tuner) -> str | None:
        """`tuner`'s state, replacing the file whole; the error if it could not be written."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(tuner.state_dict()))
            os.replace(tmp, self.path)
        except OSError as exc:
            return str(exc)
        return None


def start_eagle(path: str, target: Transformer, log: Any, **kwargs: Any) -> EagleDrafter:
    """The head exported at `path` ("": an untrained one) for `target`; kwargs go to `EagleDrafter`
    (num_slots, max_len, draft_vocab)."""
    if path:
        drafter = eagle_export.load(path, target, **kwargs)
        log.info("drafter_loaded", path=path, version=drafter.version)
        return drafter
    weight = target.lm_head_weight
    # The same untrained head in every rollout and restart: the process's own generator is seeded from
    # the OS (runtime/process.py, fresh_random_state), and a head's init should not depend on it.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = EagleHead.for_target(target.config).to(device=weight.device, dtype=weight.dtype)
    return EagleDrafter(head, target, **kwargs)


class HeadSwap:
    """The newest `DrafterUpdate` not yet in `eagle` (`pending`), and its swap into it."""

    def __init__(self, eagle: EagleDrafter, tuner: Tuner, *, retune_versions: int, log: Any) -> None:
        self.eagle = eagle
        self.tuner = tuner
        self.retune_versions = retune_versions
        self.log = log
        self.pending: DrafterUpdate | None = None
        self._retuned_version = eagle.version  # the head version the tuner last measured its arms afresh at

    def offer(self, msg: DrafterUpdate) -> None:
        """Kept if newer than the head and any pending update; cloned, since a received tensor aliases a
        frame or shared-memory slot that is recycled after the handler."""
        newest = self.pending.version if self.pending is not None else self.eagle.version
        if msg.version <= newest:
            self.log.info("drafter_update_stale", version=msg.version, have=newest)
            return
        self.pending = msgspec.structs.replace(
            msg, names=list(msg.names), tensors=[t.clone() for t in msg.tensors]
        )

    def swap(self) -> None:
        """The pending update into the head, if its checksum and shapes hold; the tuner told."""
        msg, self.pending = self.pending, None
        assert msg is not None
        if len(msg.names) != len(msg.tensors) or checksum(msg.names, msg.tensors) != msg.checksum:
            self.log.error("drafter_update_refused", version=msg.version, why="checksum mismatch")
            return
        try:
            # Copies; live requests keep their cached pairs (a rebuild per update would cost more than it buys).
            self.eagle.load_state(dict(zip(msg.names, msg.tensors, strict=True)), msg.version, rebuild=False)
        except ValueError as exc:
            self.log.error("drafter_update_refused", version=msg.version, why=str(exc))
            return
        # Only a new head gives a benched method another chance: after a policy update alone it would lag.
        revived = [m for m in STALE_METHODS if self.tuner.refresh(m) is not None]
        retune = msg.version - self._retuned_version >= self.retune_versions
        if retune:  # only after a real change: every forget costs min_trials x hold iterations a bucket
            for method in STALE_METHODS:
                self.tuner.forget(method)
            self._retuned_version = msg.version
        self.log.info("drafter_swapped", version=msg.version, policy_version=msg.policy_version,
                      retuned=retune, revived=revived)  # fmt: skip
