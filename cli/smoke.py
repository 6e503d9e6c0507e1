"""A smoke run of the actor runtime: real processes exchanging tensor messages over real sockets.

    slipstream smoke [--sinks 2] [--messages 64] [--run-dir runs/smoke]

One `source` actor streams bf16 hidden-state messages (the drafter channel's bulk payload) to each
`sink` actor over the data plane; each sink checks the bytes and acknowledges with a checksum; the
source verifies every acknowledgement and reports to the coordinator. It exercises the handshake,
peer-to-peer data sockets, zero-copy tensor frames, control-first inboxes, heartbeats, logs and
top-down shutdown — what a deployment must get right before any model is loaded. Users run it to
check a new cluster's wiring.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from slipstream.protocols.control import Status
from slipstream.protocols.drafter import HiddenStates
from slipstream.runtime.actor import COORDINATOR, Actor, handler
from slipstream.runtime.codec import checksum
from slipstream.runtime.supervisor import ActorSpec, Supervisor
from slipstream.runtime.transport import actor_name


class Sink(Actor):
    """Acknowledges every HiddenStates message with the checksum of what arrived."""

    role = "sink"

    @handler
    def on_hidden(self, msg: HiddenStates, sender: str) -> None:
        ack = {"group_id": msg.group_id, "checksum": checksum(["hidden"], [msg.hidden]),
               "tokens": int(msg.token_ids.numel())}  # fmt: skip
        self.send(sender, Status(topic="ack", fields=ack))


class Source(Actor):
    """On `go`, streams `messages` tensor messages to each sink and verifies their acknowledgements."""

    role = "source"

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
        sinks: list[str] = []  # actor names of the sinks ("sink:0", …)
        messages: int = 64  # per sink
        tokens: int = 1024  # sequence length of each message (1.2 MB bf16: takes the shared-memory lane)
        hidden: int = 576  # hidden size (SmolLM2-135M's)

    def on_start(self) -> None:
        self.expected: dict[int, str] = {}  # group id → checksum of the hidden states sent
        self.acked = 0
        self.bad = 0
        self.started = 0.0

    @handler
    def on_status(self, msg: Status, sender: str) -> None:
        if msg.topic == "go":
            self._go()
        elif msg.topic == "ack":
            group = int(msg.fields["group_id"])  # type: ignore[arg-type]
            self.bad += int(self.expected.pop(group, "") != msg.fields["checksum"])
            self.acked += 1
            if not self.expected:
                self._report()

    def _go(self) -> None:
        cfg = self.config
        gen = torch.Generator().manual_seed(self.rank)
        self.started = time.perf_counter()
        group = 0
        for _ in range(cfg.messages):
            for sink in cfg.sinks:
                hidden = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(torch.bfloat16)
                self.expected[group] = checksum(["hidden"], [hidden])
                msg = HiddenStates(
                    group_id=group,
                    sample_index=0,
                    token_ids=torch.arange(cfg.tokens),
                    hidden=hidden,
                    response_start=cfg.tokens // 4,
                    policy_version=0,
                )
                self.send(sink, msg)
                group += 1
        if not self.expected:
            self._report()

    def _report(self) -> None:
        seconds = time.perf_counter() - self.started
        nbytes = self.acked * self.config.tokens * self.config.hidden * 2
        lane = self._local_codec.shm
        fields = {"acked": self.acked, "bad": self.bad, "seconds": round(seconds, 4),
                  "shm_mapped_bytes": lane.used_bytes if lane is not None else 0,
                  "gbps": round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0}  # fmt: skip
        self.log.info("smoke_done", **fields)
        self.send(COORDINATOR, Status(topic="smoke_done", fields=fields))


def specs(sinks: int, messages: int) -> list[ActorSpec]:
    names = [actor_name(Sink.role, i) for i in range(sinks)]
    out = [ActorSpec.of(Source, config=Source.Config(sinks=names, messages=messages))]
    out += [ActorSpec.of(Sink, rank=i) for i in range(sinks)]
    return out


async def run(
    run_dir: Path, *, sinks: int = 2, messages: int = 64, timeout_s: float = 120.0, log: Any = None
) -> dict:
    """Starts the smoke actors, runs one exchange, shuts down; returns the source's report."""
    sup = Supervisor(run_dir, heartbeat_s=0.5, log=log)
    try:
        await sup.start(specs(sinks, messages))
        await sup.send(actor_name(Source.role, 0), Status(topic="go", fields={}))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not sup.deaths.empty():
                died = sup.deaths.get_nowait()
                raise RuntimeError(f"{died.name} died: {died.reason}")
            try:
                _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=min(left, 0.5))
            except TimeoutError:
                continue
            if isinstance(msg, Status) and msg.topic == "smoke_done":
                return {"actors": 1 + sinks, **msg.fields}
        raise TimeoutError(f"smoke run did not finish in {timeout_s}s")
    finally:
        await sup.shutdown(reason="smoke finished")
