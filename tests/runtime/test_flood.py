"""A flood of results past the coordinator's inbox bound: backpressure, never a drop, never a false death."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec
import pytest
import torch
import uvloop

from slipstream.protocols.control import Status
from slipstream.protocols.rollout import Completion
from slipstream.runtime.actor import COORDINATOR, Actor, handler
from slipstream.runtime.supervisor import ActorSpec, Supervisor

ROOT = Path(__file__).resolve().parents[2]


class Flooder(Actor):
    """Sends `count` completions to the coordinator as fast as it can when told to go."""

    role = "flooder"

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
        count: int = 2000

    @handler
    def on_go(self, msg: Status, sender: str) -> None:
        for i in range(self.config.count):
            self.send(
                COORDINATOR,
                Completion(
                    group_id=i // 4,
                    sample_index=i % 4,
                    token_ids=torch.tensor([i]),
                    logprobs=torch.tensor([-1.0]),
                    finish_reason="stop",
                    policy_version=self.rank,
                ),
            )


@pytest.mark.timeout(120)
def test_every_completion_arrives_once_through_a_full_inbox(tmp_path: Path) -> None:
    count = 2000

    async def main() -> list[tuple[int, int, int]]:
        sup = Supervisor(tmp_path, heartbeat_s=0.2, missed_beats=3, inbox_size=32)
        env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        specs = [ActorSpec.of(Flooder, rank=r, config=Flooder.Config(count=count), env=env) for r in range(2)]
        try:
            await sup.start(specs)
            for r in range(2):
                await sup.send(f"flooder:{r}", Status(topic="go", fields={}))
            await asyncio.sleep(1.5)  # the inbox is full long past the 0.6 s silence limit: no death
            got = []
            while len(got) < 2 * count:
                _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=10)
                got.append((msg.policy_version, msg.group_id, msg.sample_index))
                if len(got) % 500 == 0:
                    await asyncio.sleep(0.3)  # a slow coordinator, again and again
            assert sup.deaths.empty()
            assert sup.alive() == ["flooder:0", "flooder:1"]
            return got
        finally:
            await sup.shutdown(reason="test done")

    got = uvloop.run(main())
    assert len(got) == len(set(got)) == 2 * count  # every one, none twice
