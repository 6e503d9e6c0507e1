"""The ledger of a step's work: which actor holds each (group, sample), and what came back — exactly once.

The coordinator deals work (a rollout's samples, a verifier's score requests) and records the holder of
each key; a result is taken once, the first time its key comes back from anyone. A second copy (the
original of a sample that was requeued after its actor was presumed dead, or a message from a previous
step) is dropped and counted, never used twice. When an actor dies, `held_by` is what it still owed:
dealt again with the same seeds, those samples come back the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Key", "Ledger"]

Key = tuple[int, int]
"""(group id, sample index)."""


@dataclass
class Ledger:
    holder: dict[Key, str] = field(default_factory=dict)
    """Keys dealt and not yet back → the actor holding them."""
    done: set[Key] = field(default_factory=set)
    duplicates: int = 0
    """Results dropped: their key was back already, or was never dealt."""
    requeued: int = 0
    """Keys dealt again after their holder died."""

    def deal(self, actor: str, keys: Iterable[Key], *, requeue: bool = False) -> None:
        for key in keys:
            if key in self.done:
                raise ValueError(f"{key} is back already: dealing it again would count it twice")
            self.holder[key] = actor
            self.requeued += requeue

    def take(self, key: Key) -> bool:
        """True the first time `key` comes back (and it was dealt); False for a duplicate or a stray."""
        if key in self.done or key not in self.holder:
            self.duplicates += 1
            return False
        del self.holder[key]
        self.done.add(key)
        return True

    def held_by(self, actor: str) -> list[Key]:
        """What `actor` was dealt and has not returned, in key order."""
        return sorted(key for key, holder in self.holder.items() if holder == actor)

    @property
    def outstanding(self) -> int:
        return len(self.holder)
