"""Turns: two parties alternate through one baton file; a finished party never blocks the other."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from slipstream.runtime.turns import Turns


def test_two_parties_alternate_strictly(tmp_path: Path) -> None:
    baton = tmp_path / "baton"
    baton.write_text("a")
    log: list[str] = []

    async def party(name: str, other: str, turns_taken: int) -> None:
        turns = Turns(baton, name, other, poll_s=0.001)
        for _ in range(turns_taken):
            await turns.acquire()
            log.append(name)
            await asyncio.sleep(0.005)  # the other party must not slip in meanwhile
            log.append(name)
            turns.release()
        turns.done()

    async def main() -> None:
        await asyncio.gather(party("b", "a", 4), party("a", "b", 4))

    asyncio.run(main())
    assert log == ["a", "a", "b", "b"] * 4


def test_a_done_party_never_blocks_the_other(tmp_path: Path) -> None:
    baton = tmp_path / "baton"
    baton.write_text("a")  # a's turn, but a finished (or died) without releasing it
    Turns(baton, "a", "b").done()
    b = Turns(baton, "b", "a", poll_s=0.001)

    async def main() -> None:
        for _ in range(3):
            await asyncio.wait_for(b.acquire(), timeout=2)
            b.release()  # hands the turn to a, which is done: b is not blocked next time either

    started = time.monotonic()
    asyncio.run(main())
    assert b.holder() == "a" and time.monotonic() - started < 1


def test_a_party_waits_while_the_other_holds_the_turn(tmp_path: Path) -> None:
    baton = tmp_path / "baton"
    baton.write_text("a")
    b = Turns(baton, "b", "a", poll_s=0.001)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(b.acquire(), timeout=0.1)
        a = Turns(baton, "a", "b")
        await a.acquire()  # its turn already: at once
        a.release()
        await asyncio.wait_for(b.acquire(), timeout=2)

    asyncio.run(main())


def test_the_spec_is_parsed_and_bad_ones_are_named(tmp_path: Path) -> None:
    turns = Turns.parse(f"{tmp_path}/odd:name/baton:slipstream:baseline")
    assert turns.path == Path(f"{tmp_path}/odd:name/baton") and (turns.name, turns.next) == (
        "slipstream",
        "baseline",
    )
    for bad in ("baton", "baton:a", ":a:b"):
        with pytest.raises(ValueError, match="--turns: expected FILE:NAME:NEXT"):
            Turns.parse(bad)
    for name, other in (("a", "a"), ("", "b"), ("a/b", "c")):
        with pytest.raises(ValueError, match="two different party names"):
            Turns(tmp_path / "baton", name, other)


def test_acquire_and_release_are_idempotent(tmp_path: Path) -> None:
    baton = tmp_path / "baton"
    baton.write_text("a")
    a, b = Turns(baton, "a", "b", poll_s=0.001), Turns(baton, "b", "a", poll_s=0.001)

    async def main() -> None:
        await asyncio.wait_for(a.acquire(), timeout=2)
        await asyncio.wait_for(a.acquire(), timeout=2)  # held: at once
        a.release()
        await asyncio.wait_for(b.acquire(), timeout=2)
        b.release()

    asyncio.run(main())
    assert a.holder() == "a" and not a.held
    a.release()  # not held: hands nothing over
    assert a.holder() == "a"
