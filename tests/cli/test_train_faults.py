"""`slipstream train` survives dead and hung actors: real processes, real SIGKILLs and SIGSTOPs.

A watcher kills rollout:1 while it decodes step 1, the drafter (this CPU host's one, drafter:0) during its
first lease and again while step 2 decodes, and verifier:0 then too; another run stops rollout:0 (SIGSTOP,
a hang) mid-step. The run must restart them, hand a
rollout the current weights and the drafter the policy's head and its checkpoint, deal again exactly the
samples and score requests they owed, and end with the same samples and rewards as a run without faults
(reproducible mode: a sample's tokens depend on its seed alone), each (group, sample) once. A learner
killed between steps or inside one restarts from its checkpoint and replays to the same losses.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import uvloop

from slipstream.actors.rollout_history import journal_path
from slipstream.cli import train
from slipstream.engine.history import read_journal
from slipstream.engine.policy_checkpoint import read_weights
from slipstream.protocols.control import SaveCheckpoint
from slipstream.protocols.learner import TrainStep
from slipstream.rl import run_config
from slipstream.runtime.process import pid_alive
from slipstream.runtime.supervisor import Supervisor
from tests.cli.conftest import assert_same_samples, config, recorded_samples
from tests.runtime.test_supervisor_restart import Events

pytestmark = pytest.mark.timeout(600)


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


async def _kill_while_working(
    run_dir: Path, victim: str, watch: str, step: int, sig: signal.Signals = signal.SIGKILL
) -> int:
    """Sends `sig` to `victim` ("rollout-1") once rollout `watch` decodes step `step` (its step-th weight
    update applied, then a decode iteration); returns the pid signalled."""
    logs = run_dir / "logs"
    while True:
        events = _events(logs / f"{watch}.jsonl")
        applied = [i for i, e in enumerate(events) if e["event"] == "weights_applied"]
        if len(applied) >= step and any(e["event"] == "tuner_decision" for e in events[applied[step - 1] :]):
            break
        await asyncio.sleep(0.01)
    pid = next(e["pid"] for e in reversed(_events(logs / f"{victim}.jsonl")) if e["event"] == "ready")
    os.kill(pid, sig)
    return pid


async def _kill_when_leased(run_dir: Path, victim: str, nth: int) -> int:
    """SIGKILLs drafter `victim` the moment its log shows its `nth` lease (it is training on a lent device)."""
    path = run_dir / "logs" / f"{victim}.jsonl"
    while sum(e["event"] == "leased" for e in _events(path)) < nth:
        await asyncio.sleep(0.005)
    pid = next(e["pid"] for e in reversed(_events(path)) if e["event"] == "ready")
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.fixture(scope="module")
def clean_run(tiny_chat: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 3-step run without faults that the faulty runs must reproduce."""
    clean = tmp_path_factory.mktemp("clean")
    uvloop.run(train.train(_config(tiny_chat), clean))
    return clean


def _config(tiny_chat: Path) -> run_config.TrainConfig:
    # Four slots a rollout: the one dealt 2 groups (8 samples) decodes them one after the other, so the other
    # rollout's device idles for about half of every step, and a lease (in step 0 first) is certain. With 8
    # slots both finished 48 tokens in lockstep, and in a loaded CI run step 0's window was 1 ms: no lease.
    # The history arms too: a restarted rollout replays its journal of earlier steps' responses.
    arms = ["off", "ngram:d3", "cascade:d4"]
    return config(tiny_chat, faults={"restart_backoff_s": 0.1},
                  rollout={"verify_weights": True, "max_batch": 4, "tuner": {"arms": arms}})  # fmt: skip


def test_a_killed_rollout_and_verifier_are_restarted_and_nothing_is_lost(
    tiny_chat: Path, clean_run: Path, tmp_path: Path
) -> None:
    cfg = _config(tiny_chat)
    clean, faulty = clean_run, tmp_path / "faulty"

    async def run_with_kills() -> tuple[dict[str, Any], list[int]]:
        job = asyncio.create_task(train.train(cfg, faulty))
        killers = {
            "rollout-1 in step 1": _kill_while_working(faulty, "rollout-1", "rollout-1", step=1),
            "verifier-0 in step 2": _kill_while_working(faulty, "verifier-0", "rollout-0", step=2),
            # Its first lease: step 0's idle window (rollout:1 decodes 1 group, rollout:0 2 in turn).
            "drafter-0 leased": _kill_when_leased(faulty, "drafter-0", nth=1),
            # The restarted drafter, again: the kill takes the newest process's pid.
            "drafter-0 in step 2": _kill_while_working(faulty, "drafter-0", "rollout-0", step=2),
        }
        tasks = {name: asyncio.create_task(c) for name, c in killers.items()}
        summary = await job
        missed = [name for name, k in tasks.items() if not k.done()]
        for k in tasks.values():
            k.cancel()
        assert not missed, f"kills that never happened (the run ended first): {missed}"
        return summary, [k.result() for k in tasks.values()]

    summary, pids = uvloop.run(run_with_kills())
    steps = summary["steps"]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    assert "rollout:1" in steps[1]["restarts"] and steps[1]["requeued"] > 0
    # The drafter was SIGKILLed holding a lease (step 0): restarted, and the step went on without it.
    assert "drafter:0" in steps[0]["restarts"]
    assert {"verifier:0", "drafter:0"} <= set(steps[2]["restarts"])
    # Restarted in step 2, it was handed the policy's head (v2), and follows it (v3).
    drafter = _events(faulty / "logs" / "drafter-0.jsonl")
    last = [i for i, e in enumerate(drafter) if e["event"] == "ready"][2]
    assert [e["version"] for e in drafter[last:] if e["event"] == "head_synced"] == [2, 3]
    # ... and resumed from the checkpoint it saved with the run's (step 2), not from scratch.
    saved = [e["version"] for e in drafter[:last] if e["event"] == "checkpointed"]
    resumed = [e for e in drafter[: last + 1] if e["event"] == "resumed"]
    assert saved and saved[-1] > 0 and [e["version"] for e in resumed][-1:] == [saved[-1]]
    # The restarted rollout was handed the current policy (v1), re-hashed, before it decoded again.
    events = _events(faulty / "logs" / "rollout-1.jsonl")
    readies = [i for i, e in enumerate(events) if e["event"] == "ready"]
    assert len(readies) == 2 and events[readies[1]]["pid"] != pids[0]
    after = events[readies[1] :]
    applied = [e["version"] for e in after if e["event"] == "weights_applied" and e["verified"]]
    assert applied[:1] == [1]
    first_decode = next(i for i, e in enumerate(after) if e["event"] == "tuner_decision")
    assert any(e["event"] == "weights_applied" for e in after[:first_decode])
    # Nothing lost, nothing twice, and the same tokens and rewards as without faults (up to a near tie).
    tie = assert_same_samples(faulty, clean, 3)
    clean_steps = json.loads((clean / "summary.json").read_text())["steps"]
    assert [s["reward_mean"] for s in steps][:tie] == [s["reward_mean"] for s in clean_steps][:tie]
    assert all(s["invalid"] == 0 for s in steps)
    # The restarted rollout replayed the history its predecessor journaled (step 0's responses at least),
    # and between them the rollouts hold each response of the run at most once, as sampled.
    replayed = [e for e in events if e["event"] == "history_replayed"]  # the first process had none
    assert replayed and replayed[0]["replayed"] >= 4  # rollout:1 decoded a group of 4 in step 0
    journals = [read_journal(journal_path(faulty, rank))[0] for rank in range(2)]
    held = Counter((r.version, tuple(r.tokens[r.start :])) for records in journals for r in records)
    sampled = Counter(
        (step, tuple(tokens)) for (step, _, _), (tokens, _, _) in recorded_samples(faulty, 3).items()
    )
    # A response sent in the microseconds between its completion and its journal write would be missing
    # (drafts change, never samples): allowed once; never a stranger, never a second copy.
    assert not held - sampled and sum(held.values()) >= sum(sampled.values()) - 1


def test_a_hung_rollout_is_detected_killed_and_its_work_requeued(
    tiny_chat: Path, clean_run: Path, tmp_path: Path
) -> None:
    cfg = _config(tiny_chat)
    faulty = tmp_path / "faulty"

    async def run_with_stop() -> tuple[dict[str, Any], int]:
        job = asyncio.create_task(train.train(cfg, faulty, log=log))
        stopper = asyncio.create_task(
            _kill_while_working(faulty, "rollout-0", "rollout-0", step=1, sig=signal.SIGSTOP)
        )
        summary = await job
        return summary, stopper.result()

    log = Events()
    summary, pid = uvloop.run(run_with_stop())
    steps = summary["steps"]
    assert steps[1]["restarts"] == ["rollout:0"] and steps[1]["requeued"] > 0
    events = _events(faulty / "logs" / "rollout-0.jsonl")
    assert next(e["pid"] for e in events if e["event"] == "ready") == pid
    assert not pid_alive(pid), "the stopped process was killed, not left behind"
    # Seen within the heartbeat deadline (3 beats of 1 s), named, and handled as a death.
    dead = [r for r in log.named("actor_dead") if r["actor"] == "rollout:0"]
    assert len(dead) == 1 and dead[0]["reason"].startswith("no heartbeat") and dead[0]["detected_after_s"] < 6
    assert_same_samples(faulty, clean_run, 3)


async def _kill_after_steps(run_dir: Path, victim: str, steps: int) -> int:
    """SIGKILLs `victim` once `steps` steps are recorded in metrics.jsonl (the next step is rolling out)."""
    metrics = run_dir / "metrics.jsonl"
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < steps:
        await asyncio.sleep(0.01)
    pid = next(
        e["pid"] for e in reversed(_events(run_dir / "logs" / f"{victim}.jsonl")) if e["event"] == "ready"
    )
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.fixture(scope="module")
def clean_four(tiny_chat: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    clean = tmp_path_factory.mktemp("clean-four")
    uvloop.run(train.train(config(tiny_chat, steps=4, checkpoint_every=2), clean))
    return clean


@pytest.fixture(scope="module")
def clean_four_sharded(tiny_chat: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """clean_four with two sharded learner ranks (the deal of groups to ranks follows the rank count)."""
    clean = tmp_path_factory.mktemp("clean-four-sharded")
    learner = {"threads": 1, "optim": {"lr": 1e-3}, "ranks": 2}
    uvloop.run(train.train(config(tiny_chat, steps=4, checkpoint_every=2, learner=learner), clean))
    return clean


def _kill_after_sending(kind: type, step: int, victim: str, pids: list[int]) -> Any:
    """Supervisor.send that SIGKILLs `victim` right after sending it the `kind` message of step `step`
    (a TrainStep: it dies holding its groups, before it can have trained; a SaveCheckpoint: it dies in its
    checkpoint, after the step's weights were applied everywhere)."""
    send = Supervisor.send

    async def send_then_kill(self: Supervisor, name: str, msg: Any, **kwargs: Any) -> None:
        await send(self, name, msg, **kwargs)  # kwargs: the heartbeat loop's wait=False
        if name == victim and isinstance(msg, kind) and msg.step == step and not pids:
            pids.append(self.pid(name))
            os.kill(pids[0], signal.SIGKILL)

    return send_then_kill


@pytest.mark.parametrize(
    "when", ["between steps", "inside a step", "in its checkpoint", "sharded, inside a step"]
)
def test_a_killed_learner_restarts_from_its_checkpoint_and_replays_to_the_same_run(
    tiny_chat: Path,
    clean_four: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    when: str,
    request: pytest.FixtureRequest,
) -> None:
    """ "sharded": two learner ranks (FSDP2), rank 1 killed holding step 3's groups; both restart from the
    step-2 checkpoint their shards make, and the run is the one-rank clean run's."""
    sharded = when.startswith("sharded")
    learner = {"threads": 1, "optim": {"lr": 1e-3}, "ranks": 2 if sharded else 1}
    cfg = config(tiny_chat, steps=4, checkpoint_every=2, faults={"restart_backoff_s": 0.1}, learner=learner)
    clean = request.getfixturevalue("clean_four_sharded") if sharded else clean_four
    faulty = tmp_path / "faulty"
    pids: list[int] = []
    victim = "learner:1" if sharded else "learner:0"
    if when.endswith("inside a step"):
        monkeypatch.setattr(Supervisor, "send", _kill_after_sending(TrainStep, 3, victim, pids))
    elif when == "in its checkpoint":  # the step-2 checkpoint: none on disk yet, so from the start
        monkeypatch.setattr(Supervisor, "send", _kill_after_sending(SaveCheckpoint, 2, "learner:0", pids))

    async def run_with_kill() -> dict[str, Any]:
        job = asyncio.create_task(train.train(cfg, faulty))
        killer = None
        if when == "between steps":
            killer = asyncio.create_task(_kill_after_steps(faulty, "learner-0", steps=3))
        summary = await job
        if killer is not None:
            pids.append(killer.result())
        return summary

    steps = uvloop.run(run_with_kill())["steps"]
    assert len(pids) == 1
    assert [s["policy_version"] for s in steps] == [1, 2, 3, 4]
    events = _events(faulty / "logs" / ("learner-1.jsonl" if sharded else "learner-0.jsonl"))
    loaded = [e["version"] for e in events if e["event"] == "checkpoint_loaded"]
    trained = [e["step"] for e in events if e["event"] == "trained"]
    if when == "in its checkpoint":
        # Step 1 was trained and synced, then its checkpoint died with the learner: it restarts from the
        # initial policy, replays step 0, trains step 1 again (the rollouts hold v2 already and ignore the
        # re-push: not waited on), and checkpoints it.
        assert "learner:0" in steps[1]["restarts"]
        assert loaded == [] and trained == [0, 1, 0, 1, 2, 3]
    else:
        assert victim in steps[3]["restarts"]
        assert loaded == [2] and trained == [0, 1, 2, 2, 3]  # step-2 checkpoint, step 2 replayed, step 3
    # The replay reproduced the lost step: the same losses, gradient norms and final weights as without
    # faults. Weights within fp32 tolerance, not bitwise: the rollouts' behaviour log-probs agree to rounding
    # only (fp32 rows decoded in other batch shapes, and the batches depend on timing), and AdamW's
    # m / sqrt(v) turns a last-bit difference of a tiny gradient into a sizeable share of a step for that
    # element (tests/cli/test_train.py's resume test measures it). So: almost every element within 1e-5.
    # A skipped or wrong replay moves nearly every element by ~lr = 1e-3 and fails by far. Where a sample
    # flipped at a near tie (conftest's `assert_same_samples`), the runs trained on other samples from
    # that step on, and only the steps before it compare.
    tie = assert_same_samples(faulty, clean, 4)
    clean_steps = json.loads((clean / "summary.json").read_text())["steps"]
    for got, want in list(zip(steps, clean_steps, strict=True))[:tie]:
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), got["step"]
    if tie < 4:
        return
    final = [read_weights(run / "checkpoints" / "step-4" / "learner") for run in (clean, faulty)]
    assert final[0].keys() == final[1].keys()
    off = sum(int(((final[1][n] - t).abs() > 1e-5).sum()) for n, t in final[0].items())
    total = sum(t.numel() for t in final[0].values())
    assert off <= total * 1e-3, f"{off} of {total} weights differ from the uninterrupted run's by > 1e-5"


def test_a_rollout_out_of_device_memory_is_restarted_with_half_its_batch(
    tiny_chat: Path, clean_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's OutOfMemoryError injected into rollout:0's generator mid-step (tests/fixtures/oom): an event
    with a recovery, not the end of the run — restarted with half its batch cap, handed the weights, dealt
    again what it owed; the run's samples are the clean run's."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "oom"
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(fixture), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("SLIPSTREAM_TEST_OOM", str(tmp_path / "oom-marker"))
    run = tmp_path / "oom"
    summary = uvloop.run(train.train(_config(tiny_chat), run))
    assert (tmp_path / "oom-marker").exists()  # the injection happened
    steps = summary["steps"]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    (where,) = [s for s in steps if "rollout:0" in s["restarts"]]
    assert where["requeued"] > 0
    events = _events(run / "logs" / "rollout-0.jsonl")
    assert any(e["event"] == "serve_failed" or "OutOfMemoryError" in json.dumps(e) for e in events)
    caps = [e["config"]["max_batch"] for e in events if e["event"] == "config"]
    assert caps == [4, 2]  # restarted with half its batch cap
    assert_same_samples(run, clean_run, steps=3)


def test_a_rollout_killed_with_part_of_a_group_back_is_requeued_exactly_the_rest_under_their_own_indices(
    tiny_chat: Path, clean_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requeue of a partial group, end to end: rollout:1 SIGKILLs itself right after one of a group's
    completions went out while a higher-indexed sample of that group still decoded (tests/fixtures/
    partial_requeue). The missing samples, which neither start at 0 nor count up from it, are dealt again
    and decoded with their own seeds: the run's samples are the clean run's, each once. A rollout that
    renumbered a requeue's indices from 0 would decode other samples under those keys."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "partial_requeue"
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(fixture), os.environ.get("PYTHONPATH")]))
    )
    marker = tmp_path / "partial-marker"
    monkeypatch.setenv("SLIPSTREAM_TEST_PARTIAL", str(marker))
    run = tmp_path / "partial"
    # Bounded: with the requeue's indices renumbered, the group's missing sample never comes and the step
    # waits for it (the clean run takes ~20 s here).
    summary = uvloop.run(asyncio.wait_for(train.train(_config(tiny_chat), run), timeout=240))
    assert marker.exists()  # the injection happened
    killed = json.loads(marker.read_text())
    missing = killed["decoding"]
    assert killed["sent"] not in missing and missing != list(range(len(missing)))
    steps = summary["steps"]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    (where,) = [s for s in steps if "rollout:1" in s["restarts"]]
    assert where["requeued"] >= len(missing)
    assert_same_samples(run, clean_run, steps=3)
