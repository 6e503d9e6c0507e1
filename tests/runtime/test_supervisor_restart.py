"""Restarting a dead actor through the supervisor: real processes, real sockets, a budget per actor."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop

from slipstream.cli import smoke
from slipstream.protocols.control import Status
from slipstream.runtime.actor import Actor, handler
from slipstream.runtime.supervisor import ActorSpec, Supervisor, SupervisorError
from tests.runtime.test_supervisor import gone, next_status

HEARTBEAT_S = 0.25
ROOT = Path(__file__).resolve().parents[2]


class Flaky(Actor):
    """Answers `ping` with its pid; its on_start fails, or hangs, while a marker file exists."""

    role = "flaky"

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
        fail_if: str = ""  # path: on_start raises while this file exists
        hang_if: str = ""  # path: on_start sleeps while this file exists

    def on_start(self) -> None:
        if self.config.fail_if and os.path.exists(self.config.fail_if):
            raise RuntimeError(f"marker {self.config.fail_if} exists")
        while self.config.hang_if and os.path.exists(self.config.hang_if):
            time.sleep(0.1)

    @handler
    def on_status(self, msg: Status, sender: str) -> None:
        if msg.topic == "ping":
            self.send(sender, Status(topic="pong", fields={"pid": os.getpid()}))
        elif msg.topic == "hang":  # the compute loop stops for good; the IO thread still beats
            while True:
                time.sleep(0.1)
        elif msg.topic == "slow":  # a long handler that marks its progress: not a hang
            for _ in range(int(msg.fields["seconds"] * 10)):
                time.sleep(0.1)
                self.tick()
            self.send(sender, Status(topic="done", fields={}))


def flaky_spec(hang_s: float = 0.0, **config: str) -> ActorSpec:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    return ActorSpec.of(Flaky, config=Flaky.Config(**config), env=env, hang_s=hang_s)


async def kill_and_see_death(sup: Supervisor, name: str) -> int:
    pid = sup.pid(name)
    os.kill(pid, signal.SIGKILL)
    died = await asyncio.wait_for(sup.deaths.get(), timeout=10)
    assert died.name == name and "SIGKILL" in died.reason and died.exit_code == -signal.SIGKILL
    return pid


class Events:
    """The supervisor's log, kept as records: which processes it spawned, what it restarted."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def _record(self, event: str, **fields: Any) -> None:
        self.records.append({"event": event, **fields})

    debug = info = warning = error = _record

    def named(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]


@contextlib.asynccontextmanager
async def supervised(run_dir: Path, **settings: Any) -> AsyncIterator[tuple[Supervisor, Events]]:
    """A supervisor shut down on the way out; then no process it ever spawned may be left."""
    events = Events()
    sup = Supervisor(run_dir, heartbeat_s=HEARTBEAT_S, log=events, **settings)
    try:
        yield sup, events
    finally:
        await sup.shutdown(reason="test over", grace_s=2.0)
    for spawned in events.named("spawned"):
        assert gone(spawned["pid"]), f"{spawned['actor']} (pid {spawned['pid']}) left behind"


@pytest.mark.timeout(120)
def test_a_killed_sink_restarts_with_a_new_pid_and_its_peer_reaches_it_again(tmp_path: Path) -> None:
    async def main() -> None:
        async with supervised(tmp_path, restart_backoff_s=0.05) as (sup, events):
            await sup.start(smoke.specs(sinks=1, messages=4))
            await sup.send("source:0", Status(topic="go", fields={}))
            first = await next_status(sup, "smoke_done")
            assert first.fields["acked"] == 4 and first.fields["bad"] == 0  # the source's DEALER is connected

            old = await kill_and_see_death(sup, "sink:0")
            assert sup.alive() == ["source:0"]
            await asyncio.wait_for(sup.restart("sink:0"), timeout=60)
            new = sup.pid("sink:0")
            assert new != old and not gone(new)
            assert sorted(sup.alive()) == ["sink:0", "source:0"] and sup.restarts("sink:0") == 1
            died = sup.last_death("sink:0")
            assert died is not None and died.exit_code == -signal.SIGKILL
            restarted = [(e["actor"], e["attempt"], e["pid"]) for e in events.named("restarted")]
            assert restarted == [("sink:0", 1, new)]

            # The source's old DEALER reconnected to the same ipc endpoint; the new sink's acks reach it.
            await sup.send("source:0", Status(topic="go", fields={}))
            again = await next_status(sup, "smoke_done")
            assert again.fields["acked"] == 8 and again.fields["bad"] == 0
            await asyncio.sleep(4 * HEARTBEAT_S)  # the old watcher and heartbeats leave the new one alone
            assert sup.deaths.empty() and "sink:0" in sup.alive()

            await kill_and_see_death(sup, "sink:0")  # watched like any actor: its own death is seen too

    uvloop.run(main())


@pytest.mark.timeout(90)
def test_past_the_budget_restart_raises_with_the_signal_and_the_log_tail(tmp_path: Path) -> None:
    async def main() -> None:
        async with supervised(tmp_path, max_restarts=1, restart_backoff_s=0.3) as (sup, _):
            await sup.start([ActorSpec(actor="slipstream.cli.smoke:Sink")])
            await kill_and_see_death(sup, "sink:0")
            began = time.monotonic()
            await asyncio.wait_for(sup.restart("sink:0"), timeout=60)
            assert time.monotonic() - began >= 0.3  # the first restart's backoff
            await kill_and_see_death(sup, "sink:0")
            with pytest.raises(SupervisorError) as err:
                await sup.restart("sink:0")
            text = str(err.value)
            assert "sink:0" in text and "budget" in text and "SIGKILL" in text
            assert '"event":"ready"' in text  # a line of its log (it was killed, so it wrote no error)
            assert sup.restarts("sink:0") == 1 and sup.alive() == []

    uvloop.run(main())


@pytest.mark.timeout(120)
def test_a_restart_whose_on_start_fails_raises_the_reason_and_counts(tmp_path: Path) -> None:
    marker = tmp_path / "fail"

    async def main() -> None:
        async with supervised(tmp_path, max_restarts=2, restart_backoff_s=0.05) as (sup, _):
            await sup.start([flaky_spec(fail_if=str(marker))])
            marker.touch()
            await kill_and_see_death(sup, "flaky:0")
            with pytest.raises(SupervisorError) as err:
                await asyncio.wait_for(sup.restart("flaky:0"), timeout=60)
            text = str(err.value)
            assert "flaky:0" in text and "restart 1" in text and f"marker {marker} exists" in text
            assert gone(sup.pid("flaky:0")) and sup.alive() == [] and sup.restarts("flaky:0") == 1
            assert sup.deaths.empty()  # reported by the raise, not a second time on `deaths`
            died = sup.last_death("flaky:0")
            assert died is not None and "restart 1 failed" in died.reason

            marker.unlink()
            await asyncio.wait_for(sup.restart("flaky:0"), timeout=60)  # the second and last try
            await sup.send("flaky:0", Status(topic="ping", fields={}))
            pong = await next_status(sup, "pong")
            assert pong.fields["pid"] == sup.pid("flaky:0")

            await kill_and_see_death(sup, "flaky:0")
            with pytest.raises(SupervisorError, match=r"flaky:0: restart budget spent \(2 restarts"):
                await sup.restart("flaky:0")

    uvloop.run(main())


@pytest.mark.timeout(90)
def test_a_restart_that_hangs_in_start_up_times_out_and_is_killed(tmp_path: Path) -> None:
    marker = tmp_path / "hang"

    async def main() -> None:
        async with supervised(tmp_path, restart_backoff_s=0.05) as (sup, _):
            await sup.start([flaky_spec(hang_if=str(marker))])
            sup.handshake_timeout_s = 3.0  # the first start had the generous default (a loaded host)
            marker.touch()
            await kill_and_see_death(sup, "flaky:0")
            with pytest.raises(SupervisorError, match=r"flaky:0: restart 1 of 3 failed: handshake timed out"):
                await asyncio.wait_for(sup.restart("flaky:0"), timeout=60)
            assert gone(sup.pid("flaky:0")), "the hung process was not killed"
            assert sup.restarts("flaky:0") == 1 and sup.alive() == []
            # The owner gives up on a restart (a cancelled wait): that process is killed too, and counts.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sup.restart("flaky:0"), timeout=1.5)
            assert gone(sup.pid("flaky:0")), "the cancelled restart's process was not killed"
            assert sup.restarts("flaky:0") == 2 and sup.alive() == []

    uvloop.run(main())


@pytest.mark.timeout(60)
def test_restarting_a_live_or_unknown_actor_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with supervised(tmp_path) as (sup, _):
            await sup.start([ActorSpec(actor="slipstream.cli.smoke:Sink")])
            pid = sup.pid("sink:0")
            with pytest.raises(ValueError, match=r"sink:0 is alive"):
                await sup.restart("sink:0")
            with pytest.raises(ValueError, match=r"sink:7: no such actor"):
                await sup.restart("sink:7")
            assert sup.pid("sink:0") == pid and sup.restarts("sink:0") == 0 and sup.alive() == ["sink:0"]

    uvloop.run(main())


def test_restart_settings_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        Supervisor(tmp_path, max_restarts=-1)
    with pytest.raises(ValueError, match="restart_backoff_s"):
        Supervisor(tmp_path, restart_backoff_s=-0.1)


@pytest.mark.timeout(90)
def test_a_hung_compute_loop_is_killed_at_its_deadline_and_a_ticking_one_is_not(tmp_path: Path) -> None:
    async def main() -> None:
        async with supervised(tmp_path, restart_backoff_s=0.05) as (sup, _):
            await sup.start([flaky_spec(hang_s=1.0)])
            await asyncio.sleep(2.0)  # idle past the deadline: an idle loop turns, so it is no hang
            await sup.send("flaky:0", Status(topic="slow", fields={"seconds": 2.5}))
            assert (await next_status(sup, "done")).topic == "done"  # ticking through 2.5 s: no hang
            assert sup.deaths.empty()
            pid = sup.pid("flaky:0")
            started = time.monotonic()
            await sup.send("flaky:0", Status(topic="hang", fields={}))
            died = await asyncio.wait_for(sup.deaths.get(), timeout=10)
            assert died.name == "flaky:0" and died.reason.startswith("hung: no progress for")
            assert "heartbeats arrived" in died.reason and 1.0 <= time.monotonic() - started < 5.0
            for _ in range(50):
                if gone(pid):
                    break
                await asyncio.sleep(0.1)
            assert gone(pid), "a hung actor is killed, not only reported"
            await sup.restart("flaky:0")  # and handled as dead: restartable like any other

    uvloop.run(main())


@pytest.mark.timeout(90)
def test_a_stopped_process_is_seen_by_its_silent_heartbeats_and_killed(tmp_path: Path) -> None:
    async def main() -> None:
        async with supervised(tmp_path) as (sup, _):
            await sup.start([flaky_spec()])
            pid = sup.pid("flaky:0")
            os.kill(pid, signal.SIGSTOP)
            died = await asyncio.wait_for(sup.deaths.get(), timeout=10)
            assert died.name == "flaky:0" and died.reason.startswith("no heartbeat for")
            for _ in range(50):
                if gone(pid):
                    break
                await asyncio.sleep(0.1)
            assert gone(pid)

    uvloop.run(main())
