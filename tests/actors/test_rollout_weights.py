"""The rollout actor never goes back to, or re-applies, a policy version: an update older than the one it holds
is refused with an error ack, a re-push of the held version is ignored (after a restart it arrives twice,
and was acked once already), and neither changes a weight, at once or once the queue drains. Driven in
process through its handlers and `step()`, as tests/actors/test_rollout_actor.py does.
"""

from __future__ import annotations

from pathlib import Path

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


def shifted(params: dict[str, torch.nn.Parameter], version: int, delta: float) -> WeightUpdate:
    """Every parameter plus `delta`, as one well-formed bucket of `version` (valid names, shapes, checksum)."""
    names = list(params)
    tensors = [params[n].detach() + delta for n in names]
    digest = checksum(names, tensors)
    return WeightUpdate(
        version=version, bucket=0, num_buckets=1, names=names, tensors=tensors, checksum=digest
    )


def test_a_weight_update_not_newer_than_the_held_version_changes_nothing(tiny: Path, tmp_path: Path) -> None:
    actor, out = make_actor(tiny, tmp_path, max_batch=4, policy_version=3)
    params = dict(actor.model.named_parameters())
    held = {n: p.detach().clone() for n, p in params.items()}

    def unchanged() -> list[str]:
        return [n for n, p in params.items() if not torch.equal(p.detach(), held[n])]

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
