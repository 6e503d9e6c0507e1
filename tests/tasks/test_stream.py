"""DataStream: epochs in a seeded order, and a cursor that resumes without skipping or replaying a row."""

from __future__ import annotations

import json

import pytest

from slipstream.tasks.datasets import Row
from slipstream.tasks.stream import DataStream, epoch_order

ROWS = [Row(question=f"q{i}", answer=str(i)) for i in range(7)]


def questions(rows: list[Row]) -> list[str]:
    return [r.question for r in rows]


def test_epoch_order_is_a_seeded_permutation() -> None:
    order = epoch_order(50, seed=3, epoch=0)
    assert sorted(order) == list(range(50))
    assert order == epoch_order(50, seed=3, epoch=0)  # a pure function: the resume relies on it
    assert order != epoch_order(50, seed=3, epoch=1)  # each epoch its own order
    assert order != epoch_order(50, seed=4, epoch=0)
    assert order != list(range(50))


def test_take_reads_each_epoch_once_in_its_order() -> None:
    stream = DataStream(ROWS, seed=1)
    got = questions(stream.take(2 * len(ROWS) + 3))  # across two epoch boundaries
    want = [f"q{i}" for e in range(3) for i in epoch_order(len(ROWS), 1, e)][: len(got)]
    assert got == want
    assert sorted(got[: len(ROWS)]) == sorted(questions(ROWS))
    assert (stream.epoch, stream.index) == (2, 3)
    assert stream.take(0) == []


@pytest.mark.parametrize("first", [0, 1, 6, 7, 8, 20])
def test_resume_neither_skips_nor_replays(first: int) -> None:
    """take k, save (through JSON, as state.json does), restore, take more == one uninterrupted read."""
    whole = questions(DataStream(ROWS, seed=9).take(first + 11))
    stream = DataStream(ROWS, seed=9)
    head = questions(stream.take(first))
    saved = json.loads(json.dumps(stream.state()))
    resumed = DataStream.from_state(ROWS, 9, saved)
    assert head + questions(resumed.take(11)) == whole


def test_resume_in_steps_matches_one_read() -> None:
    """The train loop's shape: a step's rows, a checkpoint, a fresh process per step."""
    state: dict[str, int] | None = None
    got: list[str] = []
    for _ in range(6):
        stream = DataStream(ROWS, seed=2) if state is None else DataStream.from_state(ROWS, 2, state)
        got += questions(stream.take(3))
        state = stream.state()
    assert got == questions(DataStream(ROWS, seed=2).take(18))
    assert state == {"epoch": 2, "index": 4, "size": 7, "seed": 2}


def test_from_state_refuses_other_data() -> None:
    state = DataStream(ROWS, seed=0).state()
    with pytest.raises(ValueError, match="size 7, the data now has size 6"):
        DataStream.from_state(ROWS[:6], 0, state)
    with pytest.raises(ValueError, match="seed"):
        DataStream.from_state(ROWS, 1, state)
    # A bare cursor (no size or seed to check) is accepted.
    assert DataStream.from_state(ROWS, 1, {"epoch": 0, "index": 2}).index == 2


def test_seek() -> None:
    stream = DataStream(ROWS, seed=5)
    stream.seek(1, len(ROWS))  # the end of epoch 1 is the start of epoch 2
    assert (stream.epoch, stream.index) == (2, 0)
    stream.seek(3, 4)
    assert questions(stream.take(1)) == [f"q{epoch_order(7, 5, 3)[4]}"]
    for epoch, index in [(-1, 0), (0, -1), (0, 8)]:
        with pytest.raises(ValueError, match="outside"):
            stream.seek(epoch, index)
    with pytest.raises(ValueError, match=">= 0"):
        stream.take(-1)


def test_unshuffled_and_empty() -> None:
    assert questions(DataStream(ROWS, seed=5, shuffle=False).take(9)) == [
        *questions(ROWS),
        *questions(ROWS[:2]),
    ]
    with pytest.raises(ValueError, match="at least one row"):
        DataStream([], seed=0)
