"""The verifier pool's contract: every request gets one Reward; a bad reward costs only its sample.

The rewards under test live here and are loaded by the workers by path ("tests.actors.test_verifier:
behave"): `behave` does what the completion says, so one pool serves every case. The process tests
share two actors under one Supervisor whose loop runs on a thread (starting an actor costs seconds on
a small host); the last of them stops the pool and checks that nothing is left running. A "spawn"
reward starts a helper (`sleep 300`) before it hangs and writes the helper's pid to the row's
`pid_file`: the helper is no child of ours, so the tests watch that pid, not the process tree.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from slipstream.protocols.control import Shutdown, Status
from slipstream.protocols.reward import Reward, ScoreRequest
from slipstream.runtime.codec import Codec, ProtocolError
from slipstream.runtime.process import pid_alive
from slipstream.runtime.supervisor import ActorSpec, Supervisor, SupervisorError
from slipstream.tasks.reward_worker import call_reward, judge

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1.0  # the deadline of the shared pool's calls
MAX_PENDING = 4  # requests the shared pool holds before it stops taking more

# -- rewards the workers load by path -------------------------------------------------------------


def behave(prompt: str, completion: str, **row: Any) -> Any:
    """Does what `completion` says."""
    match completion:
        case "good":
            return float(row["answer"])  # the row's fields arrive as keywords
        case "slow":
            time.sleep(0.05)
            return 0.5
        case "raise":
            return 1 / 0
        case "hang":
            time.sleep(600)
        case "spawn":
            start_helper(row["pid_file"])
            time.sleep(600)
        case "nan":
            return math.nan
        case "inf":
            return -math.inf
        case "str":
            return "abc"
        case "none":
            return None
        case "bool":
            return True
        case "exit":
            os._exit(3)
    raise AssertionError(f"unknown behaviour {completion!r}")


class CountingReward:
    """A class reward with an async __call__: built once per worker, awaited there."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, prompt: str, completion: str, **row: Any) -> float:
        if completion == "spawn":
            start_helper(row["pid_file"])
        await asyncio.sleep(600 if completion in ("hang", "spawn") else 0.001)
        self.calls += 1
        return float(self.calls)


def start_helper(pid_file: str) -> None:
    """Starts a process of the reward's own that would outlive its worker, and names it in `pid_file`."""
    helper = subprocess.Popen(["sleep", "300"])
    Path(pid_file + ".tmp").write_text(str(helper.pid))
    os.replace(pid_file + ".tmp", pid_file)  # whole or absent: the test polls for it


def draws(prompt: str, completion: str, *, draws_dir: str, **row: Any) -> float:
    """Writes this worker's first draws from each global generator to `draws_dir`, by pid; "hang" hangs."""
    if completion == "hang":
        time.sleep(600)
    path = Path(draws_dir, f"{os.getpid()}.json")
    if not path.exists():
        import random

        import torch

        drawn = {
            "random": random.random(),
            "numpy": float(np.random.random()),
            "torch": float(torch.rand(())),
        }
        path.with_suffix(".tmp").write_text(json.dumps(drawn))
        path.with_suffix(".tmp").replace(path)
    time.sleep(0.3)  # long enough that a request sent beside it goes to the other worker
    return 1.0


async def async_reward(prompt: str, completion: str, **row: Any) -> float:
    await asyncio.sleep(0)
    return 0.25


# -- the per-call contract, in this process -------------------------------------------------------


@pytest.mark.parametrize("value", [1.0, 0, -3, np.float32(0.5), np.int64(2), 1e308])
def test_judge_takes_finite_real_numbers(value: object) -> None:
    assert judge(value) == (float(value), None, None)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (math.nan, "garbage: returned nan (float)"),
        (math.inf, "garbage: returned inf (float)"),
        (np.float64("nan"), "garbage: returned "),
        ("abc", "garbage: returned 'abc' (str)"),
        (True, "garbage: returned True (bool)"),
        (np.bool_(False), "garbage: returned "),
        ([1.0], "garbage: returned [1.0] (list)"),
        (10**400, "garbage: returned 1000"),
        ("x" * 1000, "…"),
        (None, "none: the reward could not score it"),
    ],
)
def test_judge_turns_anything_else_into_an_invalid_sample(value: object, error: str) -> None:
    reward, reason, message = judge(value)
    assert reward is None and reason == ("none" if value is None else "garbage")
    assert message is not None and error in message and len(message) < 400


def test_call_reward_catches_raises_and_exits_and_awaits_async_rewards() -> None:
    loop = asyncio.new_event_loop()
    try:
        assert call_reward(behave, "p", "raise", {}, loop) == (
            None, "raised", "raised: ZeroDivisionError: division by zero",
        )  # fmt: skip
        assert call_reward(lambda p, c: sys.exit(2), "p", "c", {}, loop)[1:] == (
            "raised",
            "raised: SystemExit: 2",
        )
        assert call_reward(behave, "p", "good", {}, loop)[2] == "raised: KeyError: 'answer'"
        assert call_reward(async_reward, "p", "c", {}, loop) == (0.25, None, None)
        counting = CountingReward()
        assert [call_reward(counting, "p", "c", {}, loop)[0] for _ in range(3)] == [1.0, 2.0, 3.0]
    finally:
        loop.close()


def test_a_reward_message_carries_a_finite_reward_or_an_error() -> None:
    codec = Codec()
    ok = Reward(group_id=1, sample_index=0, reward=0.5, elapsed_s=0.1, policy_version=0)
    assert codec.decode(codec.encode(ok)) == ok
    for reward, error in [(None, None), (0.5, "x")]:
        with pytest.raises(ValueError, match="exactly one"):
            Reward(group_id=1, sample_index=0, reward=reward, error=error, elapsed_s=0.1, policy_version=0)
    kind = codec.encode(ok)[0]
    for reward, error in [(None, None), (math.nan, None), (math.inf, None)]:  # hand-made bodies
        with pytest.raises(ProtocolError, match="malformed body"):
            codec.decode([kind, msgspec.msgpack.encode([1, 0, reward, error, 0.1, 0])])


# -- the pool, as real processes --------------------------------------------------------------------


def spec(reward: str, rank: int, **config: Any) -> ActorSpec:
    # The workers import this module by path, whatever directory pytest was started from.
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return ActorSpec(
        actor="slipstream.actors.verifier:VerifierActor",
        rank=rank,
        config={"reward": reward, "report_every_s": 0.2, **config},
        env={"PYTHONPATH": pythonpath},
    )


def descendants(pid: int) -> set[int]:
    """Live (not zombie) processes under `pid`."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            children.setdefault(int(ppid), []).append(int(entry))
            states[int(entry)] = state
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return {p for p in found if states.get(p) != "Z"}


@pytest.fixture
def pid_file(tmp_path: Path) -> Iterator[Path]:
    """Where a "spawn" reward names its helper; a helper still running at the end is killed."""
    path = tmp_path / "helper.pid"
    yield path
    if path.exists() and pid_alive(pid := int(path.read_text())):
        os.kill(pid, signal.SIGKILL)


def helper_pid(pid_file: Path, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the reward never started its helper"
        time.sleep(0.02)
    return int(pid_file.read_text())


def all_gone(pids: set[int], timeout: float = 10.0) -> bool:
    """Whether every pid is gone within `timeout`; a zombie is gone (its parent may be an init that
    reaps late, and it never runs again)."""
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(pid_alive(p) for p in pids)


class Pools:
    """Verifier actors under one Supervisor whose loop runs on a thread, so tests can share them."""

    def __init__(self, run_dir: Path, specs: list[ActorSpec]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="supervisor-loop", daemon=True)
        self.thread.start()
        self.seen: list[tuple[str, Any]] = []  # everything the actors sent, in arrival order
        self.groups = iter(range(1, 1 << 30))
        self.sup: Supervisor = self.run(self._make(run_dir))
        try:
            self.run(self.sup.start(specs), timeout=150)
        except BaseException:
            self.close()
            raise

    async def _make(self, run_dir: Path) -> Supervisor:
        return Supervisor(run_dir, heartbeat_s=0.5)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def send(self, actor: str, msg: Any) -> None:
        self.run(self.sup.send(actor, msg))

    def wait_until(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        async def pull() -> None:
            deadline = time.monotonic() + timeout
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("waited too long; seen: " + repr(self.seen[-5:]))
                try:
                    self.seen.append(await asyncio.wait_for(self.sup.inbox.get(), timeout=min(left, 0.5)))
                except TimeoutError:
                    pass

        self.run(pull(), timeout=timeout + 5)

    def rewards(self, actor: str, group_id: int) -> list[Reward]:
        return [m for s, m in self.seen if s == actor and isinstance(m, Reward) and m.group_id == group_id]

    def score(
        self, actor: str, completions: list[str], *, row_json: str | list[str] = '{"answer": 1.0}'
    ) -> list[Reward]:
        """Sends one request per completion (one group) and returns the Rewards by sample index; `row_json`
        is every sample's row, or a list of one row per sample."""
        group = next(self.groups)
        rows = [row_json] * len(completions) if isinstance(row_json, str) else row_json
        for i, (completion, row) in enumerate(zip(completions, rows, strict=True)):
            request = ScoreRequest(group_id=group, sample_index=i, prompt="p", completion=completion,
                                   row_json=row, policy_version=7)  # fmt: skip
            self.send(actor, request)
        self.wait_until(lambda: len(self.rewards(actor, group)) >= len(completions))
        got = sorted(self.rewards(actor, group), key=lambda r: r.sample_index)
        assert [r.sample_index for r in got] == list(range(len(completions)))  # one each, none twice
        assert all(r.policy_version == 7 for r in got)
        return got

    def status(self, actor: str) -> dict[str, Any]:
        """The counts `actor` reports once they agree with the Rewards it has sent."""
        expected = tally([m for s, m in self.seen if s == actor and isinstance(m, Reward)])

        def agrees() -> bool:
            last = self.last_status(actor)
            return last is not None and all(last[k] == v for k, v in expected.items())

        self.wait_until(agrees, timeout=10)
        last = self.last_status(actor)
        assert last is not None
        return last

    def last_status(self, actor: str) -> dict[str, Any] | None:
        reports = [m.fields for s, m in self.seen if s == actor and isinstance(m, Status)]
        return reports[-1] if reports else None

    def close(self) -> None:
        if self.thread.is_alive():
            self.run(self.sup.shutdown(grace_s=5.0), timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def tally(rewards: list[Reward]) -> dict[str, int]:
    """The counts a verifier should report for the Rewards it sent, by the reason each error starts with."""
    counts = Counter({"scored": 0, "invalid": 0})
    for r in rewards:
        if r.error is None:
            counts["scored"] += 1
        else:
            first = r.error.split()[0].rstrip(":")
            counts["invalid"] += 1
            counts[f"invalid_{'bad_row' if first == 'bad' else first}"] += 1
    return dict(counts)


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pools = Pools(
        tmp_path_factory.mktemp("verifier") / "run",
        [
            spec(
                "tests.actors.test_verifier:behave",
                0,
                workers=2,
                timeout_s=TIMEOUT_S,
                max_pending=MAX_PENDING,
            ),
            spec("tests.actors.test_verifier:CountingReward", 1, workers=1),
            spec("tests.actors.torchless_reward:imports_torch", 2, workers=1),
        ],
    )
    yield pools
    pools.close()


@pytest.mark.timeout(240)
def test_a_good_reward_gets_the_row_and_is_scored(pools: Pools) -> None:
    (reward,) = pools.score("verifier:0", ["good"], row_json='{"answer": 0.75, "metadata": {"a": [1]}}')
    assert reward.reward == 0.75 and reward.error is None and 0 <= reward.elapsed_s < 1
    assert pools.status("verifier:0")["workers"] == 2


@pytest.mark.timeout(120)
def test_each_bad_reward_costs_only_its_sample(pools: Pools) -> None:
    cases = ["good", "raise", "nan", "inf", "str", "none", "bool", "good"]
    got = pools.score("verifier:0", cases)
    assert [r.reward for r in got] == [1.0, None, None, None, None, None, None, 1.0]
    assert [r.error for r in got] == [
        None,
        "raised: ZeroDivisionError: division by zero",
        "garbage: returned nan (float)",
        "garbage: returned -inf (float)",
        "garbage: returned 'abc' (str)",
        "none: the reward could not score it",
        "garbage: returned True (bool)",
        None,
    ]
    status = pools.status("verifier:0")
    assert status["invalid_raised"] >= 1 and status["invalid_garbage"] >= 4 and status["invalid_none"] >= 1
    assert status["restarts"] == 0 and status["workers"] == 2  # none of these costs a worker


@pytest.mark.timeout(120)
def test_bad_rows_are_answered_not_dropped(pools: Pools) -> None:
    for row_json, error in [
        ("[1, 2]", "bad row: Expected `object`, got `array`"),
        ("{not json", "bad row: JSON is malformed"),
        ('{"prompt": "x", "answer": 1}', "bad row: ['prompt'] are passed by name, not as row fields"),
        ('{"answer": 1000000000000000000000000}', "bad row: can't serialize ints"),  # not for MessagePack
    ]:
        (reward,) = pools.score("verifier:0", ["good"], row_json=row_json)
        assert reward.reward is None and reward.error is not None and reward.error.startswith(error)
    pools.status("verifier:0")


@pytest.mark.timeout(120)
def test_a_hung_reward_is_killed_at_its_deadline_and_replaced(pools: Pools) -> None:
    actor_pid = pools.sup.pid("verifier:0")
    before = descendants(actor_pid)
    restarts = pools.status("verifier:0")["restarts"]
    got = pools.score("verifier:0", ["hang", "slow", "slow", "slow", "good"])
    assert got[0].reward is None and got[0].error == f"timeout after {TIMEOUT_S} s"
    assert TIMEOUT_S <= got[0].elapsed_s < TIMEOUT_S + 2
    assert [r.reward for r in got[1:]] == [0.5, 0.5, 0.5, 1.0]
    order = [m.sample_index for s, m in pools.seen if s == "verifier:0" and isinstance(m, Reward)
             and m.group_id == got[0].group_id]  # fmt: skip
    assert order[-1] == 0  # the other worker kept scoring while one hung
    # Two at once: both killed, both replaced, and the requests behind them still scored.
    got = pools.score("verifier:0", ["hang", "hang", "good", "good"])
    assert [r.error is not None and r.error.startswith("timeout") for r in got] == [True, True, False, False]
    status = pools.status("verifier:0")
    assert status["restarts"] == restarts + 3 and status["workers"] == 2
    # Both first workers were killed, each with its guard, and their replacements started theirs (a worker
    # forks its guard once its reward is loaded: this file's rewards import torch, which takes a moment).
    pools.wait_until(lambda: len(descendants(actor_pid)) >= len(before), timeout=10)
    after = descendants(actor_pid)
    assert len(after) == len(before) and len(before - after) == 4


@pytest.mark.timeout(120)
def test_a_hung_reward_is_killed_with_the_processes_it_started(pools: Pools, pid_file: Path) -> None:
    (got,) = pools.score("verifier:0", ["spawn"], row_json=json.dumps({"pid_file": str(pid_file)}))
    assert got.reward is None and got.error == f"timeout after {TIMEOUT_S} s"
    helper = helper_pid(pid_file)
    assert all_gone({helper}), "the reward's helper outlived its worker's deadline"
    assert pools.status("verifier:0")["workers"] == 2


@pytest.mark.timeout(120)
def test_a_reward_that_kills_its_worker_costs_its_sample(pools: Pools) -> None:
    restarts = pools.status("verifier:0")["restarts"]
    got = pools.score("verifier:0", ["exit", "good", "good"])
    assert got[0].reward is None and got[0].error == "crashed: the worker exited with code 3 while scoring it"
    assert [r.reward for r in got[1:]] == [1.0, 1.0]
    status = pools.status("verifier:0")
    assert status["restarts"] == restarts + 1 and status["workers"] == 2 and status["invalid_crashed"] == 1


@pytest.mark.timeout(120)
def test_a_burst_larger_than_the_pool_gets_one_reward_each(pools: Pools) -> None:
    cases = ["good", "slow", "raise", "none", "slow", "good"] * 10
    got = pools.score("verifier:0", cases)
    assert sum(r.reward is None for r in got) == 20
    status = pools.status("verifier:0")
    assert status["pending"] == 0
    assert len(pools.rewards("verifier:0", got[0].group_id)) == len(cases)  # still exactly one each
    reports = [m.fields for s, m in pools.seen if s == "verifier:0" and isinstance(m, Status)]
    assert max(r["pending"] for r in reports) <= MAX_PENDING  # the rest waited in the inbox
    assert status["batch_mean"] == 1.0  # a per-completion reward: one sample a call, as ever


@pytest.mark.timeout(120)
def test_a_class_reward_is_built_once_per_worker_and_awaited(pools: Pools) -> None:
    got = pools.score("verifier:1", ["c"] * 5)
    assert [r.reward for r in got] == [1.0, 2.0, 3.0, 4.0, 5.0]  # one instance, called in order
    assert pools.status("verifier:1")["reward"] == "tests.actors.test_verifier:CountingReward"


@pytest.mark.timeout(120)
def test_stop_answers_every_pending_request_and_leaves_no_process_behind(
    pools: Pools, pid_file: Path
) -> None:
    """Runs last: it stops the shared pool, one of whose hung calls has started a helper."""
    actor_pid = pools.sup.pid("verifier:0")
    group = next(pools.groups)
    row_json = json.dumps({"answer": 1.0, "pid_file": str(pid_file)})
    # Control is one ordered lane: the requests are taken (two start, two queue), then Shutdown.
    for i, completion in enumerate(["spawn", "hang", "good", "good"]):
        request = ScoreRequest(group_id=group, sample_index=i, prompt="p", completion=completion,
                               row_json=row_json, policy_version=0)  # fmt: skip
        pools.send("verifier:0", request)
    helper = helper_pid(pid_file)
    processes = descendants(actor_pid) | {actor_pid}
    assert helper in processes and len(processes) >= 7  # the actor, forkserver, 2 workers, 2 guards, helper
    pools.send("verifier:0", Shutdown(reason="test"))
    pools.wait_until(lambda: len(pools.rewards("verifier:0", group)) == 4)
    got = pools.rewards("verifier:0", group)
    assert all(r.reward is None and r.error.startswith("stopped: the verifier shut down") for r in got)
    assert pools.status("verifier:0")["invalid_stopped"] == 4  # the report sent at stop
    assert all_gone(processes), f"processes outlived the actor: {[p for p in processes if pid_alive(p)]}"


@pytest.mark.timeout(120)
def test_a_killed_verifier_leaves_no_worker_behind(pools: Pools, pid_file: Path) -> None:
    """Runs last: it SIGKILLs the class-reward actor while its worker hangs with a helper started."""
    actor_pid = pools.sup.pid("verifier:1")
    row_json = json.dumps({"pid_file": str(pid_file)})
    request = ScoreRequest(group_id=next(pools.groups), sample_index=0, prompt="p", completion="spawn",
                           row_json=row_json, policy_version=0)  # fmt: skip
    pools.send("verifier:1", request)
    helper = helper_pid(pid_file)
    processes = descendants(actor_pid)
    assert helper in processes and len(processes) >= 4  # the forkserver, the worker, its guard, the helper
    os.kill(actor_pid, signal.SIGKILL)
    assert all_gone(processes), (
        f"processes outlived a SIGKILLed verifier: {[p for p in processes if pid_alive(p)]}"
    )


# -- start-up failures -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_reward_that_cannot_be_loaded_fails_start_up_naming_it(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Supervisor(tmp_path / "run", heartbeat_s=0.5)
        try:
            await sup.start([spec("tests.actors.test_verifier:nope", 0)])
        finally:
            await sup.shutdown(grace_s=1.0)

    reason = (
        "reward 'tests.actors.test_verifier:nope': module tests.actors.test_verifier has no attribute nope"
    )
    with pytest.raises(SupervisorError, match=re.escape(reason)):
        asyncio.run(main())


@pytest.mark.parametrize(
    ("config", "field"),
    [({"reward": "not a path"}, "reward"), ({"reward": "a:b", "workers": 0}, "workers"), ({}, "reward")],
)
def test_a_bad_config_fails_before_anything_is_spawned(tmp_path: Path, config: dict, field: str) -> None:
    async def main() -> None:
        sup = Supervisor(tmp_path / "run")
        try:
            await sup.start([ActorSpec(actor="slipstream.actors.verifier:VerifierActor", config=config)])
        finally:
            await sup.shutdown(grace_s=1.0)

    with pytest.raises(SupervisorError, match=f"verifier:0 config: {field}: "):
        asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_reward_worker_holds_the_reward_and_not_the_actor_runtime(pools: Pools) -> None:
    """Workers come from a forkserver that preloads only the worker's module and the built-in rewards: a
    worker of a reward that needs no torch has none loaded (it held torch and the actor runtime, ~170 MB a
    worker, when the server preloaded the actor's module or the actor ran as `-m slipstream.runtime.host`,
    which multiprocessing re-imports in every child)."""
    (reward,) = pools.score("verifier:2", ["good"])
    assert reward.error is None and reward.reward == 0.0


@pytest.mark.timeout(180)
def test_reward_workers_and_their_replacements_draw_different_numbers(tmp_path: Path) -> None:
    """Workers fork from one forkserver: where it holds numpy's or torch's generator (here a sitecustomize
    draws from both as every process starts), each worker is seeded afresh from the OS, or every worker and
    every replacement of a killed one would draw what its siblings drew."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import numpy.random\nimport torch\n\nnumpy.random.random()\ntorch.rand(1)\n"
    )
    verifier = spec("tests.actors.test_verifier:draws", 0, workers=2, timeout_s=TIMEOUT_S)
    verifier = msgspec.structs.replace(
        verifier, env={"PYTHONPATH": os.pathsep.join((str(site), verifier.env["PYTHONPATH"]))}
    )
    out = tmp_path / "draws"
    out.mkdir()
    row = json.dumps({"draws_dir": str(out)})
    pools = Pools(tmp_path / "run", [verifier])
    try:
        assert [r.reward for r in pools.score("verifier:0", ["draw", "draw"], row_json=row)] == [1.0, 1.0]
        got = pools.score("verifier:0", ["hang", "hang"], row_json=row)  # both workers killed, replaced
        assert all(r.error == f"timeout after {TIMEOUT_S} s" for r in got)
        assert [r.reward for r in pools.score("verifier:0", ["draw", "draw"], row_json=row)] == [1.0, 1.0]
        assert pools.status("verifier:0")["restarts"] == 2
    finally:
        pools.close()
    drawn = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert len(drawn) == 4, drawn  # two workers, then their two replacements
    for generator in ("random", "numpy", "torch"):
        values = [d[generator] for d in drawn]
        assert len(set(values)) == len(values), (generator, drawn)
