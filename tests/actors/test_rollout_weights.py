"""The rollout actor never goes back to, or re-applies, a policy version: an update older than the one it holds
is refused with an error ack, a re-push of the held version is ignored (after a restart it arrives twice,
and was acked once already), and neither changes a weight, at once or once the queue drains. Driven in
process through its handlers and `step()`, as tests/actors/test_rollout_actor.py does.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from slipstream.protocols.learner import WeightAck, WeightUpdate
from slipstream.protocols.rollout import Completion
from slipstream.runtime.codec import checksum
from tests.actors.test_rollout_actor import drain, make_actor, request
from tests.engine.conftest import build_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny"))


def shifted(params: dict[str, torch.Tensor], version: int, delta: float) -> WeightUpdate:
    """Every parameter plus `delta`, as one well-formed bucket of `version` (valid names, shapes, checksum)."""
    names = list(params)
    tensors = [params[n].detach() + delta for n in names]
    digest = checksum(names, tensors)
    return WeightUpdate(
        version=version, bucket=0, num_buckets=1, names=names, tensors=tensors, checksum=digest
    )


def test_a_weight_update_not_newer_than_the_held_version_changes_nothing(tiny: Path, tmp_path: Path) -> None:
    actor, out = make_actor(tiny, tmp_path, max_batch=4, policy_version=3)
    params = dict(actor.model.named_weights())  # packed-only projections unpacked (copies)
    held = {n: p.clone() for n, p in params.items()}

    def unchanged() -> list[str]:
        return [n for n, p in actor.model.named_weights() if not torch.equal(p, held[n])]

    actor.on_generate(request(0, [1, 2, 3], 2, 1.0), "coordinator")
    actor.step()  # in flight: an accepted update would be staged, then applied once the queue drains
    actor.on_weights(shifted(params, 2, 0.5), "learner:0")  # older
    actor.on_weights(shifted(params, 3, 0.25), "learner:0")  # the same version, other weights
    acks = out.of(WeightAck)
    assert [(a.version, a.ok) for a in acks] == [(2, False)], acks
    assert "version 2 is not newer than the loaded version 3" in (acks[0].error or "")
    assert actor.policy_version == 3 and unchanged() == []
    drain(actor)
    assert out.of(WeightAck) == acks and actor.policy_version == 3 and unchanged() == []
    assert {c.policy_version for c in out.of(Completion)} == {3}

    # The same kind of update, one version newer, is applied: the two above were refused for their version.
    actor.on_weights(shifted(params, 4, 0.5), "learner:0")
    assert [(a.version, a.ok) for a in out.of(WeightAck)] == [(2, False), (4, True)]
    assert actor.policy_version == 4 and len(unchanged()) == len(params)


def halves(params: dict[str, torch.Tensor], version: int, delta: float) -> list[WeightUpdate]:
    """Every parameter plus `delta`, as two well-formed buckets of `version`."""
    names = list(params)
    parts = [names[: len(names) // 2], names[len(names) // 2 :]]
    updates = []
    for bucket, part in enumerate(parts):
        tensors = [params[n].detach() + delta for n in part]
        updates.append(
            WeightUpdate(
                version=version,
                bucket=bucket,
                num_buckets=2,
                names=part,
                tensors=tensors,
                checksum=checksum(part, tensors),
            )
        )
    return updates


def test_an_idle_rollout_writes_buckets_in_place_and_a_busy_one_stages_them(
    tiny: Path, tmp_path: Path
) -> None:
    actor, out = make_actor(tiny, tmp_path, max_batch=4)
    params = dict(actor.model.named_weights())  # packed-only projections unpacked (copies)
    held = {n: p.clone() for n, p in params.items()}
    first, second = halves(params, 1, 0.5)
    actor.on_weights(first, "learner:0")  # idle: written at once, and decoding waits for the rest
    params = dict(actor.model.named_weights())
    assert all(torch.equal(params[n], t) for n, t in zip(first.names, first.tensors, strict=True))
    assert actor._staged[1][0].tensors == []  # no staged copy
    actor.on_generate(request(0, [1, 2, 3], 2, 1.0), "coordinator")
    assert actor.step() is False and not out.of(Completion) and actor.policy_version == 0
    # A newer version supersedes the half-written one: its late bucket is refused as not newer.
    newer = halves({n: held[n] for n in params}, 2, 0.25)
    for update in newer:
        actor.on_weights(update, "learner:0")
    actor.on_weights(second, "learner:0")
    assert [(a.version, a.ok) for a in out.of(WeightAck)] == [(2, True), (1, False)]
    assert actor.policy_version == 2
    params = dict(actor.model.named_weights())
    assert all(torch.equal(params[n], held[n] + 0.25) for n in params)
    drain(actor)
    assert {c.policy_version for c in out.of(Completion)} == {2}

    # Busy: the buckets are cloned and staged, and applied once the queue drains.
    actor.on_generate(request(1, [1, 2, 3], 2, 1.0), "coordinator")
    actor.step()
    for update in halves(params, 3, 0.5):
        actor.on_weights(update, "learner:0")
    assert actor.policy_version == 2 and all(len(u.tensors) > 0 for u in actor._staged[3].values())
    params = dict(actor.model.named_weights())
    assert all(torch.equal(params[n], held[n] + 0.25) for n in params)  # untouched while decoding
    drain(actor)
    assert actor.policy_version == 3 and [a.version for a in out.of(WeightAck)] == [2, 1, 3]
    assert {c.policy_version for c in out.of(Completion)} == {2}


def test_a_full_bucket_that_fails_its_checks_is_refused_and_changes_nothing(
    tiny: Path, tmp_path: Path
) -> None:
    """A bucket in full whose checksum, names or shapes are wrong is refused with the reason (no `want_full`:
    it was full already) and no weight moves; the next good push applies. The checks are the one weight
    receiver's (engine/weight_receiver.py), which the drafter's head sync uses too."""
    actor, out = make_actor(tiny, tmp_path, max_batch=4)
    params = dict(actor.model.named_weights())
    held = {n: p.clone() for n, p in params.items()}
    good = shifted(params, 1, 0.5)
    name = good.names[0]
    bad = {
        "checksum mismatch": msgspec.structs.replace(good, checksum="0" * 64),
        "is not one of": msgspec.structs.replace(good, names=["nope", *good.names[1:]]),
        "expected": msgspec.structs.replace(good, tensors=[good.tensors[0][:1], *good.tensors[1:]]),
        "out of range": msgspec.structs.replace(good, bucket=1),
    }
    for why, update in bad.items():
        actor.on_weights(update, "learner:0")
        ack = out.of(WeightAck)[-1]
        assert not ack.ok and not ack.want_full and why in (ack.error or ""), (why, ack)
    assert actor.policy_version == 0
    assert all(torch.equal(p, held[n]) for n, p in actor.model.named_weights()), name
    actor.on_weights(good, "learner:0")
    assert out.of(WeightAck)[-1].ok and actor.policy_version == 1
