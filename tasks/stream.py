"""The data stream: a finite source of rows read in epochs, each in its own shuffled order.

    stream = DataStream(rows, seed=cfg.seed)        # rows: any Sequence[Row] (a list, ReasoningGymRows)
    batch = stream.take(cfg.prompts_per_step)       # crosses epoch boundaries as needed
    state = stream.state()                          # {"epoch", "index", "size", "seed"}: save it with the checkpoint
    stream = DataStream.from_state(rows, cfg.seed, state)   # resume: neither skips nor replays a row

The cursor `(epoch, index)` is the whole state: epoch e reads the source in `epoch_order(size, seed, e)`,
a pure function of its arguments (a string-seeded `random.Random`, whose seeding is a SHA-512 of the
string: the same on every platform and process), so nothing else about the order needs saving.
`size` and `seed` ride along in the state only so that resuming over a changed file or seed is refused
rather than silently reading other rows. Each epoch's order is computed once, when the cursor enters it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from slipstream.tasks.datasets import Row

__all__ = ["DataStream", "epoch_order"]


def epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    """The source indices in the order epoch `epoch` reads them: a permutation of range(size)."""
    order = list(range(size))
    random.Random(f"slipstream.data:{seed}:{epoch}").shuffle(order)
    return order


class DataStream:
    """Rows of `source` in epochs; `shuffle=False` reads every epoch in source order (evaluation)."""

    def __init__(
        self, source: Sequence[Row], seed: int, *, shuffle: bool = True, epoch: int = 0, index: int = 0
    ) -> None:
        if len(source) == 0:
            raise ValueError("a data stream needs at least one row")
        self._source = source
        self._seed = seed
        self._shuffle = shuffle
        self._order: list[int] = []
        self._order_epoch = -1
        self.seek(epoch, index)

    @property
    def size(self) -> int:
        """Rows in one epoch."""
        return len(self._source)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def index(self) -> int:
        """Position within the epoch of the next row `take` returns."""
        return self._index

    def seek(self, epoch: int, index: int) -> None:
        """Moves the cursor; the next `take` starts at row `index` of epoch `epoch`'s order."""
        if epoch < 0 or not 0 <= index <= self.size:
            raise ValueError(f"data cursor (epoch {epoch}, index {index}) is outside [0, {self.size}]")
        # index == size is the end of an epoch, the same place as (epoch + 1, 0).
        self._epoch, self._index = (epoch + 1, 0) if index == self.size else (epoch, index)

    def take(self, n: int) -> list[Row]:
        """The next `n` rows, advancing the cursor (into later epochs when this one runs out)."""
        if n < 0:
            raise ValueError(f"take({n}): the count must be >= 0")
        rows: list[Row] = []
        while len(rows) < n:
            order = self._epoch_order()
            end = min(self._index + n - len(rows), self.size)
            rows.extend(self._source[i] for i in order[self._index : end])
            self.seek(self._epoch, end)
        return rows

    def state(self) -> dict[str, int]:
        """The cursor, plus the size and seed it is valid for; JSON-ready."""
        return {"epoch": self._epoch, "index": self._index, "size": self.size, "seed": self._seed}

    @classmethod
    def from_state(
        cls, source: Sequence[Row], seed: int, state: Mapping[str, Any], *, shuffle: bool = True
    ) -> DataStream:
        """The stream `state()` described, over `source`; refuses a source or seed that has changed."""
        for key, now in (("size", len(source)), ("seed", seed)):
            if key in state and int(state[key]) != now:
                raise ValueError(
                    f"data cursor was saved for {key} {state[key]}, the data now has {key} {now}: "
                    "resuming would read other rows"
                )
        return cls(source, seed, shuffle=shuffle, epoch=int(state["epoch"]), index=int(state["index"]))

    def _epoch_order(self) -> list[int] | range:
        if not self._shuffle:
            return range(self.size)
        if self._order_epoch != self._epoch:
            self._order = epoch_order(self.size, self._seed, self._epoch)
            self._order_epoch = self._epoch
        return self._order
