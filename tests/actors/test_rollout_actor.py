"""The rollout actor: lossless with the tuner on, streaming, Idle, weight and drafter updates.

Most tests drive the actor in-process through its handlers and `step()` (a test harness, as STYLE asks);
one runs real rollout and drafter processes end to end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import uvloop

from slipstream.actors.drafter import DrafterActor
from slipstream.actors.rollout import RolloutActor
from slipstream.engine.drafters import Draft, Drafter, DraftState
from slipstream.engine.weights import load_model
from slipstream.protocols.base import Message
from slipstream.protocols.control import Idle, Lease
from slipstream.protocols.drafter import DrafterUpdate, HiddenStates
from slipstream.protocols.learner import WeightAck, WeightUpdate
from slipstream.protocols.rollout import Completion, GenerateRequest, IterationStats, SamplingSpec
from slipstream.runtime.codec import Codec, checksum
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.supervisor import ActorSpec, Supervisor
from tests.engine.conftest import build_checkpoint
from tests.engine.test_sampling import ALPHA, chi2_critical, chi2_statistic
from tests.engine.test_spec_lossless import PROMPT, SETTINGS, SMALL, SkewedDrafter, exact_law

SPEC_ARMS = ["off", "ngram:d3", "eagle:d3", "eagle:d2k2v4"]


class Captured:
    """Outbox of an in-process actor: decodes what it sends, as a peer would receive it."""

    def __init__(self) -> None:
        self.codec = Codec()
        self.sent: list[tuple[str, Message]] = []

    def send(self, dest: str, frames: list[Any]) -> None:
        self.sent.append((dest, self.codec.decode(frames)))

    def of(self, kind: type) -> list[Any]:
        return [m for _, m in self.sent if isinstance(m, kind)]


class Events:
    """A log that keeps each event's name and fields, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _log(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    debug = info = warning = error = exception = _log

    def of(self, name: str) -> list[dict[str, Any]]:
        return [fields for event, fields in self.events if event == name]


def make_actor(
    model: Path, run_dir: Path, log: Events | None = None, **config: Any
) -> tuple[RolloutActor, Captured]:
    out = Captured()
    cfg = msgspec.convert({"model": str(model), **config}, RolloutActor.Config)
    actor = RolloutActor(cfg, rank=0, outbox=out, inbox=Inbox(8), run_dir=str(run_dir), log=log)
    actor.on_start()
    return actor, out


def drain(actor: RolloutActor, limit: int = 100_000) -> None:
    for _ in range(limit):
        if not actor.step():
            return
    raise AssertionError("the actor never went idle")


def request(
    group: int, prompt: list[int], n: int, temperature: float, max_tokens: int = 24
) -> GenerateRequest:
    return GenerateRequest(
        group_id=group,
        prompt_ids=torch.tensor(prompt),
        num_samples=n,
        seed=100 + group,
        sampling=SamplingSpec(temperature=temperature, max_tokens=max_tokens),
        policy_version=0,
    )


def responses(out: Captured) -> dict[tuple[int, int], list[int]]:
    return {(c.group_id, c.sample_index): c.token_ids.tolist() for c in out.of(Completion)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny"))


# Prompts with repeats give the n-gram drafter something to find; mixed lengths stagger finishing. With 4
# slots for groups of 3, siblings start staggered, so a late sibling can draft from an early one's response.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9, 10], [1, 2, 3], list(range(20, 50))]


@pytest.mark.parametrize(("temperature", "mode"), [(0.0, "rejection"), (0.2, "reproducible")])
def test_output_is_token_identical_with_and_without_the_tuner(
    tiny: Path, tmp_path: Path, temperature: float, mode: str
) -> None:
    runs = {}
    stats = {}
    for name, arms in (("plain", ["off"]), ("tuned", SPEC_ARMS)):
        # A high epsilon keeps the tuner switching arms mid-response: the hardest case for exactness.
        tuner = {"buckets": [1, 2, 5], "arms": arms, "epsilon": 0.5, "hold": 1, "seed": 1}
        # hidden_to: an untrained EAGLE head is held (it will be trained online), so eagle arms are live.
        actor, out = make_actor(
            tiny, tmp_path / name, max_batch=4, spec_mode=mode, tuner=tuner, hidden_to=["drafter:0"]
        )
        for group, prompt in enumerate(PROMPTS):
            actor.on_generate(
                request(group, prompt, 3, temperature, max_tokens=40 + 16 * group), "coordinator"
            )
        drain(actor)
        runs[name] = responses(out)
        stats[name] = out.of(IterationStats)
        assert len(runs[name]) == 3 * len(PROMPTS)
        assert len(out.of(Idle)) == 1
    assert runs["tuned"] == runs["plain"]
    tuned = stats["tuned"]
    assert {s.arm for s in tuned} >= {"off", "ngram:d3", "eagle:d3", "eagle:d2k2v4"}
    assert sum(s.drafted for s in tuned) > 0 and sum(s.accepted for s in tuned) > 0
    assert {s.arm for s in stats["plain"]} == {"off"}


def test_the_start_up_warm_up_runs_every_arm_and_leaves_no_trace(tiny: Path, tmp_path: Path) -> None:
    runs, vocab = {}, {}
    tuner = {"buckets": [1, 2, 5], "arms": SPEC_ARMS, "epsilon": 0.5, "hold": 1, "seed": 1}
    for warm in (False, True):
        log = Events()
        actor, out = make_actor(
            tiny, tmp_path / str(warm), log, max_batch=4, tuner=tuner, hidden_to=["drafter:0"], warm_up=warm
        )
        assert not actor.generator.has_unfinished() and actor.generator.cache.num_free_slots == 4
        assert actor.tuner.decisions == 0 and actor.generator.spec.method == "off"
        vocab[warm] = list(actor.eagle.vocab.counts)
        if warm:
            (event,) = log.of("warmed_up")
            assert event["arms"] == SPEC_ARMS
            assert actor.generator.stats["drafted"] > 0  # the speculative arms really ran
        else:
            assert not log.of("warmed_up")
        for group, prompt in enumerate(PROMPTS):
            actor.on_generate(request(group, prompt, 3, 0.2, max_tokens=24), "coordinator")
        drain(actor)
        hidden = sorted((h.group_id, h.sample_index, h.hidden.shape[0]) for h in out.of(HiddenStates))
        runs[warm] = (responses(out), hidden)
    assert vocab[True] == vocab[False]  # no synthetic token was counted
    assert runs[True] == runs[False]  # same tokens, and nothing of the warm-up left as hidden states


def test_rejection_mode_with_the_tuner_has_the_law_of_plain_sampling(tmp_path: Path) -> None:
    model_dir = build_checkpoint(tmp_path / "small", seed=2, **SMALL)
    params = SETTINGS["top-k"]
    exact = exact_law(load_model(model_dir, dtype=torch.float64), params)
    tuner = {"buckets": [1], "arms": ["off", "eagle:d2"], "epsilon": 0.5, "hold": 1, "seed": 3}
    actor, out = make_actor(model_dir, tmp_path / "run", max_batch=64, tuner=tuner, hidden_to=["drafter:0"])
    # The drafter favours what the target dislikes: many rejections, a large residual correction.
    draft_probs = torch.softmax(-2 * exact.view(8, 8).sum(0).clamp_min(1e-6).log(), 0).float()
    actor.generator.hold("eagle", SkewedDrafter(draft_probs, "chain"))
    n = 3000
    actor.on_generate(
        GenerateRequest(
            group_id=0, prompt_ids=torch.tensor(PROMPT), num_samples=n, seed=7, policy_version=0,
            sampling=SamplingSpec(temperature=params.temperature, top_k=params.top_k, max_tokens=4),
        ),
        "coordinator",
    )  # fmt: skip
    drain(actor)
    completions = out.of(Completion)
    assert len(completions) == n
    tokens = torch.stack([c.token_ids[1:3] for c in completions])  # [n, 2]: t2, t3 (t1 comes from prefill)
    stat, dof = chi2_statistic(tokens[:, 0] * 8 + tokens[:, 1], exact)
    critical = chi2_critical(dof, ALPHA)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
    iterations = out.of(IterationStats)
    assert Counter(s.arm for s in iterations).keys() == {"off", "eagle:d2"}
    drafted, accepted = sum(s.drafted for s in iterations), sum(s.accepted for s in iterations)
    assert 0 < accepted < drafted


def test_completions_carry_logprobs_and_version_and_bad_requests_get_an_error(
    tiny: Path, tmp_path: Path
) -> None:
    actor, out = make_actor(tiny, tmp_path, max_batch=4, hidden_to=["drafter:0"], hidden_dtype="float32")
    actor.on_generate(request(0, [1, 2, 3, 4], 2, 1.0), "coordinator")
    actor.on_generate(request(1, [1, 2, 999], 2, 1.0), "coordinator")  # id 999 >= vocab 160
    drain(actor)
    done = out.of(Completion)
    errors = [c for c in done if c.finish_reason == "error"]
    assert sorted(c.sample_index for c in errors) == [0, 1] and all(c.group_id == 1 for c in errors)
    good = [c for c in done if c.group_id == 0]
    assert len(good) == 2
    model = load_model(tiny)
    for c in good:
        assert c.logprobs.shape == c.token_ids.shape and c.policy_version == 0 and c.finish_reason == "length"
        # The reported log-probs are those of the sampling distribution (T = 1: the model's softmax).
        ids = torch.tensor([1, 2, 3, 4, *c.token_ids.tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(model.forward_train(ids[None])[0, 3:-1], -1)
        expected = logp.gather(1, c.token_ids[:, None])[:, 0]
        torch.testing.assert_close(c.logprobs, expected, atol=1e-4, rtol=1e-4)
    hidden = out.of(HiddenStates)
    assert len(hidden) == 2
    for h in hidden:
        assert h.response_start == 1 and h.hidden.shape == (h.token_ids.numel(), 64)
    assert [dest for dest, m in out.sent if isinstance(m, HiddenStates)] == ["drafter:0", "drafter:0"]
    assert len(out.of(Idle)) == 1


def test_a_requeue_decodes_exactly_the_missing_samples_with_their_own_seeds(
    tiny: Path, tmp_path: Path
) -> None:
    """A group requeued after its rollout died asks for the samples that never came back (here 1 and 3 of
    4): the actor decodes those indices, each with its own seed, so they equal the same samples of a
    whole group; renumbering them from 0 would hand back samples 0 and 1's tokens under other keys."""
    whole, out = make_actor(tiny, tmp_path / "a", tuner={"arms": ["off"]})
    whole.on_generate(request(3, PROMPTS[1], 4, temperature=0.9), "coordinator")
    drain(whole)
    full = responses(out)
    assert len({tuple(v) for v in full.values()}) == 4  # four different samples: a renumbering would show
    requeue, out = make_actor(tiny, tmp_path / "b", tuner={"arms": ["off"]})
    partial = msgspec.structs.replace(request(3, PROMPTS[1], 4, temperature=0.9), sample_indices=[1, 3])
    requeue.on_generate(partial, "coordinator")
    drain(requeue)
    assert responses(out) == {key: full[key] for key in ((3, 1), (3, 3))}


def test_weight_update_is_staged_until_drained_then_applied_and_acked(tiny: Path, tmp_path: Path) -> None:
    actor, out = make_actor(tiny, tmp_path, max_batch=4)
    params = dict(actor.model.named_weights())  # a packed-only projection's value is a copy: re-read it
    names = ["layers.0.mlp.down.weight", "final_norm.weight"]
    assert set(names) <= set(params)
    new = [params[n].detach() + 0.5 for n in names]
    actor.on_generate(request(0, [1, 2, 3], 2, 1.0), "coordinator")
    actor.step()  # in flight
    for bucket, (name, tensor) in enumerate(zip(names, new, strict=True)):
        actor.on_weights(
            WeightUpdate(version=1, bucket=bucket, num_buckets=2, names=[name], tensors=[tensor],
                         checksum=checksum([name], [tensor])),
            "learner:0",
        )  # fmt: skip
    assert actor.policy_version == 0  # a response is never produced by two policies
    drain(actor)
    assert all(c.policy_version == 0 for c in out.of(Completion))
    acks = out.of(WeightAck)
    assert [(a.version, a.ok) for a in acks] == [(1, True)]
    assert actor.policy_version == 1
    params = dict(actor.model.named_weights())
    for name, tensor in zip(names, new, strict=True):
        assert torch.equal(params[name], tensor)
    actor.on_generate(request(1, [1, 2, 3], 1, 1.0), "coordinator")
    drain(actor)
    assert out.of(Completion)[-1].policy_version == 1

    bad = new[0] + 1
    actor.on_weights(
        WeightUpdate(version=2, bucket=0, num_buckets=1, names=[names[0]], tensors=[bad], checksum="0" * 64),
        "learner:0",
    )
    assert out.of(WeightAck)[-1].ok is False and "checksum" in out.of(WeightAck)[-1].error
    assert actor.policy_version == 1 and torch.equal(dict(actor.model.named_weights())[names[0]], new[0])


def test_tuner_state_survives_a_restart(tiny: Path, tmp_path: Path) -> None:
    tuner = {"buckets": [1, 3], "arms": ["off", "ngram:d3"], "seed": 5}
    actor, _ = make_actor(tiny, tmp_path, max_batch=4, tuner=tuner)
    actor.on_generate(request(0, PROMPTS[0], 3, 0.0, max_tokens=40), "coordinator")
    drain(actor)
    saved = json.loads((tmp_path / "rollout" / "rank-0" / "tuner.json").read_text())
    restarted, _ = make_actor(tiny, tmp_path, max_batch=4, tuner=tuner)
    assert restarted.tuner.state_dict() == saved == actor.tuner.state_dict()


class WrongDrafter(Drafter):
    """Always proposes `token`, which the target never emits on these prompts: nothing is ever accepted."""

    uses_hidden = False

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, states: Sequence[DraftState], depth: int, topk: int, verify: int) -> list[Draft]:
        return [Draft.chain([self.token] * depth) for _ in states]


def test_a_drafter_whose_drafts_are_never_accepted_is_benched_until_a_new_head_arrives(
    tiny: Path, tmp_path: Path
) -> None:
    log = Events()
    # Decisions held for a whole window: eagle, untried after "off", runs a window whatever the clock says
    # (a first look spans `hold` sequence-passes: 32 is >= 8 iterations at batch <= 4).
    tuner = {"buckets": [1], "arms": ["off", "eagle:d3"], "epsilon": 0.0, "hold": 32, "stale_window": 8}
    actor, out = make_actor(tiny, tmp_path, log, max_batch=4, tuner=tuner, hidden_to=["drafter:0"])
    actor.generator.hold("eagle", WrongDrafter(1))
    for group, prompt in enumerate(PROMPTS):
        actor.on_generate(request(group, prompt, 2, 0.0, max_tokens=40), "coordinator")
    drain(actor)
    iterations = out.of(IterationStats)
    eagle = [s for s in iterations if s.arm == "eagle:d3"]
    assert sum(s.drafted for s in eagle) > 0 and sum(s.accepted for s in eagle) == 0
    (stale,) = log.of("drafter_stale")
    assert stale == {
        "method": "eagle", "acceptance": 0.0, "iterations": 8, "threshold": 0.05, "drafter_version": 0,
        "policy_version": 0,
    }  # fmt: skip
    names = [event for event, _ in log.events]
    after = [f["arm"] for e, f in log.events[names.index("drafter_stale") :] if e == "tuner_decision"]
    assert len(after) > 20 and set(after) == {"off"}  # eagle is never chosen again
    assert actor.tuner.stale().keys() == {"eagle"}

    # A new head arrives: eagle gets another chance (its rewards measured the old head: re-tried first).
    names, tensors = zip(
        *((n, t.detach() + 0.01) for n, t in actor.eagle.head.named_parameters()), strict=True
    )
    actor.on_drafter_update(
        DrafterUpdate(version=1, policy_version=0, names=list(names), tensors=list(tensors),
                      checksum=checksum(list(names), list(tensors))),
        "drafter:0",
    )  # fmt: skip
    actor.on_generate(request(9, PROMPTS[0], 2, 0.0, max_tokens=40), "coordinator")
    seen = len(log.events)
    drain(actor)
    (swapped,) = log.of("drafter_swapped")
    assert swapped["revived"] == ["eagle"] and swapped["version"] == 1
    later = [(e, f.get("arm"), f.get("why")) for e, f in log.events[seen:] if e != "drafter_swapped"]
    assert later[0] == ("tuner_decision", "eagle:d3", "untried")
    # The wrong drafter is still held (the update went to the real head): benched again after a window.
    stale = log.of("drafter_stale")
    assert len(stale) == 2 and stale[1]["drafter_version"] == 1
    after = later[later.index(("drafter_stale", None, None)) :]
    assert len(after) > 5 and {arm for e, arm, _ in after if e == "tuner_decision"} == {"off"}


@pytest.mark.timeout(180)
def test_real_processes_stream_completions_go_idle_and_swap_in_the_trained_drafter(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")
    rollout_cfg = {
        "model": str(model), "max_batch": 8, "hidden_to": ["drafter:0"],
        "tuner": {"buckets": [1, 4], "arms": ["off", "eagle:d3"], "epsilon": 0.3},
    }  # fmt: skip
    drafter_cfg = {
        "model": str(model), "publish_to": ["rollout:0", "coordinator"], "batch_tokens": 256,
        "min_buffer_tokens": 32, "publish_every_steps": 3, "checkpoint_every_steps": 0,
    }  # fmt: skip
    specs = [
        ActorSpec.of(RolloutActor, config=msgspec.convert(rollout_cfg, RolloutActor.Config)),
        ActorSpec.of(DrafterActor, config=msgspec.convert(drafter_cfg, DrafterActor.Config)),
    ]

    async def main() -> tuple[list[Completion], list[IterationStats], int]:
        sup = Supervisor(tmp_path / "run", heartbeat_s=0.5)
        await sup.start(specs)
        try:
            for group in range(4):
                await sup.send(
                    "rollout:0", request(group, PROMPTS[group % len(PROMPTS)], 2, 1.0, max_tokens=48)
                )
            done: list[Completion] = []
            iterations: list[IterationStats] = []
            version = 0
            deadline = time.monotonic() + 120
            while not (len(done) == 8 and version > 0):
                _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=deadline - time.monotonic())
                if isinstance(msg, Completion):
                    done.append(msg)
                elif isinstance(msg, IterationStats):
                    iterations.append(msg)
                elif isinstance(msg, Idle):
                    await sup.send("drafter:0", Lease(lease_id=1, device="cpu:0", threads=1))
                elif isinstance(msg, DrafterUpdate):
                    version = msg.version
            # Decode again with the swapped-in drafter: the rollout must still serve.
            await sup.send("rollout:0", request(9, PROMPTS[0], 2, 1.0, max_tokens=32))
            while sum(c.group_id == 9 for c in done) < 2:
                _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=deadline - time.monotonic())
                if isinstance(msg, Completion):
                    done.append(msg)
                elif isinstance(msg, IterationStats):
                    iterations.append(msg)
            await asyncio.sleep(0.5)  # the last iteration's stats trail its completion
            while not sup.inbox.empty():
                _, msg = sup.inbox.get_nowait()
                if isinstance(msg, IterationStats):
                    iterations.append(msg)
            return done, iterations, version
        finally:
            await sup.shutdown(grace_s=5.0)

    done, iterations, version = uvloop.run(main())
    assert sorted((c.group_id, c.sample_index) for c in done[:8]) == [
        (g, i) for g in range(4) for i in range(2)
    ]
    assert all(c.finish_reason in ("stop", "length") and c.token_ids.numel() > 0 for c in done)
    assert iterations and all(s.rank == 0 and s.iter_s > 0 for s in iterations)
    log = (tmp_path / "run" / "logs" / "rollout-0.jsonl").read_text().splitlines()
    events = [json.loads(line)["event"] for line in log]
    assert "drafter_swapped" in events and "idle" in events
    assert events.count("tuner_decision") == len(iterations) >= 1
    assert version > 0


@pytest.mark.parametrize(
    "prompt_ids",
    [torch.tensor([[1, 2], [3, 4]]), torch.tensor(5), torch.tensor([1.0, 2.7])],
    ids=["2d", "0d", "float"],
)
def test_a_request_it_cannot_serve_is_answered_with_errors(
    tiny: Path, tmp_path: Path, prompt_ids: torch.Tensor
) -> None:
    actor, out = make_actor(tiny, tmp_path, max_batch=4)
    bad = msgspec.structs.replace(request(7, [1, 2, 3], 3, 1.0), prompt_ids=prompt_ids)
    actor.on_generate(bad, "coordinator")
    drain(actor)
    done = out.of(Completion)
    assert sorted(c.sample_index for c in done) == [0, 1, 2]
    assert {c.finish_reason for c in done} == {"error"} and all(len(c.token_ids) == 0 for c in done)
    actor.on_generate(request(8, [1, 2, 3], 2, 1.0, max_tokens=4), "coordinator")  # and it keeps serving
    drain(actor)
    assert sum(c.group_id == 8 for c in out.of(Completion)) == 2


def test_a_newer_try_of_a_request_in_flight_supersedes_it(tiny: Path, tmp_path: Path) -> None:
    """A step given up (its learner died) is dealt again as its next try while the rollout may still decode
    the older one: the older request is dropped, with no completion, not answered with an id-in-use error
    (which would make the sample invalid), and the newer try decodes what a fresh rollout decodes."""
    older = request(0, [5, 17, 33, 2], 3, 0.9, max_tokens=24)
    newer = msgspec.structs.replace(older, attempt=1)
    actor, out = make_actor(tiny, tmp_path / "a", max_batch=4)
    actor.on_generate(older, "coordinator")
    assert actor.step()  # the older try is decoding
    actor.on_generate(newer, "coordinator")
    drain(actor)
    fresh, alone = make_actor(tiny, tmp_path / "b", max_batch=4)
    fresh.on_generate(newer, "coordinator")
    drain(fresh)
    done = out.of(Completion)
    assert sorted((c.sample_index, c.attempt, c.finish_reason != "error") for c in done) == [
        (0, 1, True), (1, 1, True), (2, 1, True)
    ]  # fmt: skip
    want = {c.sample_index: c.token_ids.tolist() for c in alone.of(Completion)}
    assert {c.sample_index: c.token_ids.tolist() for c in done} == want
