"""The drafter actor follows the policy's head: the learner's `WeightUpdate`s of the target's embedding,
final norm and LM head reach a drafter process and are applied; the next training step uses them (its loss
is a reference trainer's on the new head); bad buckets are refused and change nothing; and the actor's
`device` is validated and holds the target's parts, the drafter and its optimizer."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import msgspec
import pytest
import torch
import uvloop

from slipstream.actors.drafter import DrafterActor
from slipstream.engine.drafter_train import DrafterTrainer
from slipstream.engine.weights import load_head_parts, load_model
from slipstream.protocols.control import Lease, Preempt, Released, Status
from slipstream.protocols.drafter import DrafterUpdate, HeadAck
from slipstream.protocols.learner import WeightUpdate
from slipstream.runtime.codec import checksum
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.supervisor import Supervisor
from tests.actors.test_drafter_actor import (
    HEARTBEAT_S,
    Sent,
    drafter_config,
    drafter_spec,
    feed,
    hidden_states,
    send_as,
    wait_for,
)
from tests.engine.conftest import build_checkpoint

# The learner's split: its own bucket numbering, the LM head alone in the second bucket (untied model).
BUCKETS = (("embed_tokens.weight", "final_norm.weight"), ("lm_head.weight",))


def new_head_parts(model: Path, seed: int) -> dict[str, torch.Tensor]:
    """Tensors for every head part, shaped and typed as the checkpoint's, with other values."""
    gen = torch.Generator().manual_seed(seed)
    parts = dict(load_head_parts(model).named_parameters())
    return {name: torch.randn(p.shape, generator=gen, dtype=p.dtype) for name, p in parts.items()}


def head_update(parts: dict[str, torch.Tensor], version: int) -> list[WeightUpdate]:
    updates = []
    for bucket, names in enumerate(BUCKETS):
        tensors = [parts[name] for name in names]
        updates.append(
            WeightUpdate(
                version=version, bucket=bucket, num_buckets=len(BUCKETS), names=list(names),
                tensors=tensors, checksum=checksum(names, tensors),
            )
        )  # fmt: skip
    return updates


def digest(parts: dict[str, torch.Tensor]) -> str:
    names = sorted(parts)
    return checksum(names, [parts[n] for n in names])


def statuses(out: Sent, topic: str) -> list[dict]:
    """The drafter's HeadAcks as fields: "head_synced" (applied) or "head_refused"."""
    return [fields(m) for _, m in out.messages if isinstance(m, HeadAck) and m.ok == (topic == "head_synced")]


def fields(ack: HeadAck) -> dict:
    if not ack.ok:
        return {"rank": ack.rank, "version": ack.version, "why": ack.why}
    return {"rank": ack.rank, "version": ack.version, **({"checksum": ack.checksum} if ack.checksum else {})}


def in_process(model: Path, tmp_path: Path, **config: object) -> tuple[DrafterActor, Sent]:
    out = Sent()
    cfg = drafter_config(model, checkpoint_every_steps=0, **config)
    actor = DrafterActor(cfg, rank=0, outbox=out, inbox=Inbox(8), run_dir=str(tmp_path / "run"))
    actor.on_start()
    for msg in hidden_states(8, 64, 160):
        actor.on_hidden(msg, "rollout:0")
    actor.on_lease(Lease(lease_id=1, device="cpu:0", threads=0), "coordinator")
    return actor, out


@pytest.mark.timeout(120)
def test_a_drafter_process_applies_a_head_update_and_refuses_a_bad_one(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")
    parts = new_head_parts(model, seed=1)

    async def main() -> tuple[Status, Status, DrafterUpdate, DrafterUpdate]:
        sup = Supervisor(tmp_path / "run", heartbeat_s=HEARTBEAT_S)
        try:
            await sup.start(
                [
                    drafter_spec(
                        model, checkpoint_every_steps=0, publish_every_steps=1, verify_applied_head=True
                    )
                ]
            )
            endpoint = sup.endpoints()["drafter:0"]
            feed(endpoint, 20, 64, 160)
            await sup.send("drafter:0", Lease(lease_id=1, device="cpu:0", threads=1))
            before = await wait_for(sup, DrafterUpdate)  # it is training
            bad = head_update(parts, version=1)
            bad[0] = msgspec.structs.replace(bad[0], checksum="0" * 64)
            send_as(endpoint, "learner:0", bad)
            refused = await wait_for(sup, HeadAck, lambda m: not m.ok)
            send_as(endpoint, "learner:0", head_update(parts, version=1))
            synced = await wait_for(sup, HeadAck, lambda m: m.ok)
            after = await wait_for(sup, DrafterUpdate)  # and it still trains
            await sup.send("drafter:0", Preempt(lease_id=1, reason="test", sent_ns=time.time_ns()))
            await wait_for(sup, Released)
            return refused, synced, before, after
        finally:
            await sup.shutdown(grace_s=5.0)

    refused, synced, before, after = uvloop.run(main())
    assert refused.version == 1 and "checksum mismatch" in str(refused.why)
    # The checksum of what the process holds now: the pushed tensors, bit for bit.
    assert fields(synced) == {"rank": 0, "version": 1, "checksum": digest(parts)}
    assert after.version > before.version


@pytest.mark.timeout(60)
def test_the_step_after_a_head_update_trains_against_the_new_head(
    tmp_path: Path, device: torch.device
) -> None:
    model = build_checkpoint(tmp_path / "model")
    actor, out = in_process(model, tmp_path, device=str(device), verify_applied_head=True)
    assert actor.step()  # packs the head as loaded
    parts = new_head_parts(model, seed=2)
    for update in head_update(parts, version=3):
        actor.on_weights(update, "learner:0")
    assert actor.head_version == 3
    assert statuses(out, "head_synced") == [{"rank": 0, "version": 3, "checksum": digest(parts)}]
    held = dict(actor.target.named_parameters())
    for name, tensor in parts.items():
        assert held[name].device == device and torch.equal(held[name].cpu(), tensor), name

    # References: the drafter as it is now, trained on the same batch against the new head or the old one.
    new, old = load_model(model, device=device), load_model(model, device=device)
    new.load_state_dict(parts, strict=False)
    refs = [DrafterTrainer(copy.deepcopy(actor.head), t, lr=actor.config.lr) for t in (new, old)]
    batches = []
    step = actor.trainer.step
    actor.trainer.step = lambda batch, stop=None: (batches.append(batch), step(batch, stop))[1]
    assert actor.step()
    losses = [ref.step(batches[0])["loss"] for ref in refs]
    assert actor._last_loss == pytest.approx(losses[0], rel=1e-5)
    assert actor._last_loss != pytest.approx(losses[1], rel=1e-3)
    assert {t.device for t in [*actor.head.parameters(), batches[0].hidden]} == {device}
    actor.on_stop()


def test_bad_head_updates_are_refused_and_change_nothing(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")
    actor, out = in_process(model, tmp_path)
    held = {name: p.detach().clone() for name, p in actor.target.named_parameters()}
    parts = new_head_parts(model, seed=3)
    good = head_update(parts, version=2)

    def with_tensors(update: WeightUpdate, names: list[str], tensors: list[torch.Tensor]) -> WeightUpdate:
        return msgspec.structs.replace(
            update, names=names, tensors=tensors, checksum=checksum(names, tensors)
        )

    embed = parts["embed_tokens.weight"]
    cases = {
        "checksum mismatch": [msgspec.structs.replace(good[0], checksum="0" * 64), good[1]],
        "expected": [with_tensors(good[0], ["embed_tokens.weight"], [embed.double()]), good[1]],
        "is not one of": [with_tensors(good[0], ["layers.0.mlp.down.weight"], [embed]), good[1]],
        "names for": [msgspec.structs.replace(good[0], names=["final_norm.weight"]), good[1]],
        "out of range": [msgspec.structs.replace(good[1], bucket=2)],
        "lack ['lm_head.weight']": [good[0], msgspec.structs.replace(good[1], names=[], tensors=[], checksum=checksum([], []))],
    }  # fmt: skip
    for why, updates in cases.items():
        for update in updates:
            actor.on_weights(update, "learner:0")
        refused = statuses(out, "head_refused")
        assert refused and why in str(refused[-1]["why"]), (why, refused)
        assert actor.head_version == 0 and not statuses(out, "head_synced"), why
        for name, p in actor.target.named_parameters():
            assert torch.equal(p, held[name]), (why, name)
        assert actor.step(), why  # it keeps serving, on the weights it held
        out.messages.clear()

    for update in good:
        actor.on_weights(update, "learner:0")
    assert actor.head_version == 2
    # Unverified by default (the buckets were checked on arrival): no re-hash of what was applied.
    assert statuses(out, "head_synced") == [{"rank": 0, "version": 2}]
    for name, p in actor.target.named_parameters():
        assert torch.equal(p, parts[name]), name
    actor.on_weights(head_update(parts, version=1)[0], "learner:0")  # stale: an older version
    assert "not newer" in str(statuses(out, "head_refused")[-1]["why"]) and actor.head_version == 2
    actor.on_stop()


def test_the_head_completes_from_the_leading_buckets_of_a_whole_push(tmp_path: Path) -> None:
    # The learner's push to rollouts and drafters numbers its buckets over every parameter: a drafter gets
    # the head parts' buckets alone (the first k of n) and completes when it holds every head part.
    model = build_checkpoint(tmp_path / "model")
    actor, out = in_process(model, tmp_path)
    parts = new_head_parts(model, seed=5)
    updates = [
        msgspec.structs.replace(u, num_buckets=len(BUCKETS) + 7) for u in head_update(parts, version=3)
    ]
    actor.on_weights(updates[0], "learner:0")
    assert actor.head_version == 0 and not statuses(out, "head_synced")  # waits for the other part
    actor.on_weights(updates[1], "learner:0")
    assert actor.head_version == 3 and statuses(out, "head_synced") == [{"rank": 0, "version": 3}]
    for name, p in actor.target.named_parameters():
        assert torch.equal(p, parts[name]), name
    actor.on_stop()


def test_device_is_validated_naming_the_field(tmp_path: Path) -> None:
    for bad in ("tpu", "cuda:x", "meta"):
        with pytest.raises(msgspec.ValidationError, match="device"):
            msgspec.convert({"model": "m", "device": bad}, DrafterActor.Config)
    assert (
        DrafterActor.Config(model="m", device="cuda:1").device == "cuda:1"
    )  # only a name: may run elsewhere
    if not torch.cuda.is_available():
        model = build_checkpoint(tmp_path / "model")
        actor = DrafterActor(
            drafter_config(model, device="cuda"), rank=0, outbox=Sent(), inbox=Inbox(8), run_dir=str(tmp_path)
        )
        with pytest.raises(ValueError, match="device: 'cuda' is not available"):
            actor.on_start()
