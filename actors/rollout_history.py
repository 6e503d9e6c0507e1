"""The rollout's history of earlier steps' responses (issue 52): what it remembers per prompt, from when.

A rollout whose arms draft from history (engine/drafters/suffix.py: "history", "cascade") keeps, per prompt,
the responses it decoded in earlier steps (engine/history.py). The coordinator deals a prompt to the
rollout that decoded it last (rl/step.py), so a rollout holds the history of the prompts it serves. Each
group is attached to its prompt's history as it is admitted, seeing the responses of versions before its
own: a step drafts from earlier steps, its siblings from each other. Each finished response is appended to
the journal run_dir/history/rollout-R.journal as it is kept; a restarted rollout replays it, and at its
first request drops what was sampled at that version or later (a resumed run redoes those steps), so both
draft from what the uninterrupted run drafted from. The journal is rewritten once a step, when idle.

Not an actor: the rollout's own part. Multi-turn episodes keep no history (their prompt is the
environment's opening, made as the episode starts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slipstream.engine.drafters import SuffixDrafter
from slipstream.engine.history import prompt_key

__all__ = ["RolloutHistory", "journal_path"]


def journal_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "history" / f"rollout-{rank}.journal"


class RolloutHistory:
    """The history a rollout's history drafter reads: attached per group, fed with finished responses."""

    def __init__(self, drafter: SuffixDrafter, run_dir: str | Path, rank: int, log: Any) -> None:
        self.drafter, self.history, self.log = drafter, drafter.history, log
        self.path = journal_path(run_dir, rank)
        replayed, dropped = self.history.open_journal(self.path)
        if replayed or dropped:
            log.info("history_replayed", path=str(self.path), replayed=replayed, dropped_bytes=dropped,
                     **self.history.stats())  # fmt: skip
        self._groups: dict[int, tuple[str, list[int], int]] = {}  # group id -> (prompt key, prompt, version)
        self._first_version: int | None = None

    def admit(self, group_id: int, prompt: list[int], version: int) -> None:
        """Group `group_id` (prompt `prompt`, sampled at `version`) drafts from its prompt's earlier responses."""
        if self._first_version is None:
            self._first_version = version
            if dropped := self.history.drop_from(version):
                self.log.info("history_dropped", from_version=version, responses=dropped)
        key = prompt_key(prompt)
        self._groups[group_id] = (key, prompt, version)
        self.drafter.attach(str(group_id), key, before=version)

    def finished(self, group_id: int, tokens: list[int], reason: str) -> None:
        """A response of the group is kept for later steps (an error's empty one is not)."""
        if (group := self._groups.get(group_id)) is None or reason == "error" or not tokens:
            return
        key, prompt, version = group
        self.history.add(key, version, prompt, tokens)

    def idle(self) -> dict[str, int]:
        """The step is over: its groups are forgotten, the journal rewritten; what the history holds."""
        self._groups.clear()
        self.history.compact()
        return self.history.stats()

    def close(self) -> None:
        self.history.close()
