"""The driver of `slipstream bench soak --nodes 2`: both nodes' commands, their logs, and the faults.

`SoakDriver` starts each node's `slipstream train` (`Node`: node 0 the head, node 1 its agent, each in a
network namespace of its own) and, until the head exits, follows the run's logs: each actor's newest pid,
the restarts, whether the current head has all its actors up. Meanwhile it makes the `NodesPlan`'s faults:
random actor SIGKILLs (children of the current head or agent only, each at most `max_restarts` times, none
in the last step), node 1's agent once, and the head once a checkpoint exists, then both nodes again with
`--resume`. The non-obvious choice: an actor's process is found from its log (its newest "ready" pid) and
killed only while a current node's command started it (its parent, or its fork server's), so no kill hits
a process the killed head left behind; a learner's death spends a restart of every rank, as its supervisor
restarts them all. The bench
around it (the run without kills, the comparison, the result): benchmarks/soak_nodes.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from slipstream.benchmarks import soak
from slipstream.runtime.fork_server import launcher_pid
from slipstream.runtime.process import MemorySampler, pid_alive

__all__ = ["HEAD_LOST_S", "Node", "NodeKill", "NodesPlan", "SoakDriver"]

HEAD_LOST_S = 10.0  # an agent stops its actors and exits when the head has been silent this long


class NodesPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The run both nodes start (a config file) and how it is disturbed."""

    config: str  # the resolved config both nodes read (JSON), its `nodes` placing actors on both
    reference: str  # the same config with `nodes` emptied: the one-node run without kills
    steps: int
    prompts_per_step: int
    group_size: int
    max_restarts: int  # faults.max_restarts: no actor is killed more often per coordinator
    kill_every_s: float = 3.0
    kills: int = 0  # random actor kills at most (0 = as many as the run and the budget allow)
    seed: int = 0
    agent_kill_step: int = 1  # node 1's agent is killed once this many steps are recorded (-1: never)
    coordinator_kill_step: int = 2  # the head is killed once this many are recorded (-1: never)
    port: int = 29500  # the head's port, inside its namespace
    timeout_s: float = 3600.0  # the run with kills, at most (the run without: as long again)
    python: str = sys.executable


class NodeKill(soak.Kill, frozen=True, kw_only=True):
    """A kill (its actor "role:rank", "agent:1" or "coordinator") and the node it ran on."""

    node: int


@dataclass
class Node:
    """One node's `slipstream train` (node 0: the head, node 1: its agent), started again on a resume."""

    rank: int
    netns: str
    argv: Callable[[bool], list[str]]  # resume? -> the command after `ip netns exec NS`
    out: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, resume: bool) -> None:
        with self.out.open("ab") as out:
            out.write(f"--- {'resumed' if resume else 'started'} {time.strftime('%H:%M:%S')}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *self.argv(resume)], stdout=out, stderr=subprocess.STDOUT
            )  # `ip netns exec` execs the command: the pid is its own

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, chars: int = 2000) -> str:
        return self.out.read_text(errors="replace")[-chars:] if self.out.is_file() else ""


@dataclass
class _RandomKills:
    """The random actor kills' schedule: when the next one is due, its victim, and how many were made."""

    rng: random.Random
    next_at: float | None = None  # None: no kill scheduled
    victim: str | None = None
    made: int = 0

    def reset(self) -> None:
        self.next_at, self.victim = None, None


def _wait_or_kill(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Waits for `proc` to exit by itself for `timeout_s`, then kills it."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class SoakDriver:
    """The run with kills as it goes: what its logs said, what was killed, and what each kill owes."""

    plan: NodesPlan
    run_dir: Path
    nodes: list[Node]
    started: float = field(default_factory=time.monotonic)
    coordinator: soak.LogTail = field(init=False)
    tails: dict[str, soak.LogTail] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # the run's actors ("all_ready")
    ready_session: int = -1  # the value of `resumed` when "all_ready" was last logged
    pids: dict[str, int] = field(default_factory=dict)  # actor -> its newest process's pid ("ready")
    agent_log: soak.LogTail = field(init=False)
    started_on_node1: set[str] = field(default_factory=set)  # actors node 1's agent started ("actor_started")
    killed: set[int] = field(default_factory=set)
    budget: Counter[str] = field(default_factory=Counter)  # deaths counted against each actor's restarts
    pending: Counter[str] = field(default_factory=Counter)  # deaths we caused that no restart followed yet
    by_resume: Counter[str] = field(default_factory=Counter)  # of those, the ones the resume started again
    kills: list[NodeKill] = field(default_factory=list)
    node1: list[str] = field(default_factory=list)  # node 1's actors when its agent was killed
    resumed: int = 0
    resumed_from_step: int = -1

    def __post_init__(self) -> None:
        self.coordinator = soak.LogTail(self.run_dir / "logs" / "coordinator.jsonl")
        self.agent_log = soak.LogTail(self.run_dir / "logs" / "agent-1.jsonl")

    # -- what the run's logs say ---------------------------------------------------------------------------

    def update(self) -> None:
        """Reads the logs' new lines: each actor's newest pid, the restarts, and whether the current head
        has all its actors up (its supervisor's "all_ready", which names them)."""
        for event in self.coordinator.new():
            if event.get("event") == "all_ready":
                self.names = sorted(str(a) for a in event["actors"])  # type: ignore[union-attr]
                self.ready_session = self.resumed
            elif event.get("event") == "restarted" and self.pending[actor := str(event["actor"])] > 0:
                self.pending[actor] -= 1
        for event in self.agent_log.new():
            if event.get("event") == "actor_started":
                self.started_on_node1.add(str(event["actor"]))
        for path in (self.run_dir / "logs").glob("*-*.jsonl"):
            role, _, rank = path.stem.rpartition("-")
            if role not in soak.VICTIMS or not rank.isdigit():
                continue
            name = f"{role}:{rank}"
            tail = self.tails.setdefault(name, soak.LogTail(path))
            for event in tail.new():
                if event.get("event") == "ready" and "pid" in event:
                    self.pids[name] = int(event["pid"])

    def steps(self) -> int:
        return len(soak.metrics_records(self.run_dir))

    def live(self, name: str) -> tuple[int, int] | None:
        """(pid, node) of `name`'s newest process if it is up and started by a current node's command."""
        pid = self.pids.get(name)
        if pid is None or pid in self.killed:
            return None
        parent = launcher_pid(pid)
        node = next((n.rank for n in self.nodes if n.running() and n.pid == parent), None)
        return None if node is None else (pid, node)

    def kill(self, actor: str, pid: int, node: int) -> bool:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            self.killed.add(pid)
            return False
        self.killed.add(pid)
        at = round(time.monotonic() - self.started, 2)
        self.kills.append(NodeKill(at_s=at, actor=actor, node=node, pid=pid, step=self.steps()))
        return True

    def died(self, names: list[str]) -> None:
        """`names` died of our kills: each owes a restart. A learner's death restarts every rank, and each
        spends a restart of its budget."""
        for name in names:
            self.pending[name] += 1
            self.budget[name] += 1
        if any(n.startswith("learner:") for n in names):
            for name in self.names:
                if name.startswith("learner:") and name not in names:
                    self.budget[name] += 1

    # -- the faults ----------------------------------------------------------------------------------------

    def kill_actor(self, name: str) -> bool:
        up = self.live(name)
        if up is None or not self.kill(name, *up):
            return False
        self.died([name])
        return True

    def kill_agent(self) -> None:
        """SIGKILLs node 1's agent: its actors die with it, and restart on node 0 once the node is lost."""
        agent = self.nodes[1]
        self.node1 = sorted(self.started_on_node1)
        up = [n for n in self.node1 if self.live(n)]  # a dead one owes its restart already
        if self.kill("agent:1", agent.pid, 1):
            agent.proc.wait()  # type: ignore[union-attr]
            self.died(up)

    def kill_head_and_resume(self) -> bool:
        """SIGKILLs the head, waits for its actors and node 1's agent to stop by themselves (each killed
        after a grace if not), and starts both nodes again with --resume. False if the head had finished."""
        head, agent = self.nodes
        orphans = [p for p in MemorySampler(root_pid=head.pid).tree() if p != head.pid]
        state = _state(self.run_dir)
        if not head.running() or not self.kill("coordinator", head.pid, 0):
            return False
        if head.proc.wait() != -signal.SIGKILL:  # type: ignore[union-attr]  # it finished meanwhile
            self.kills.pop()
            return False
        self.resumed_from_step = int(state.get("step", -1))  # type: ignore[call-overload]
        self.update()  # restarts logged before the kill
        self.by_resume += self.pending  # what no restart followed, the resume starts afresh
        self.pending.clear()
        self.budget.clear()  # the resumed head's supervisor counts restarts afresh
        # Node 1's agent stops its actors and exits once the head has been silent HEAD_LOST_S.
        if agent.proc is not None:
            _wait_or_kill(agent.proc, HEAD_LOST_S + 30)
        if not self.wait(lambda: not any(pid_alive(p) for p in orphans), 60.0):
            for pid in orphans:  # ours: the killed head started them
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
        self.resumed += 1  # random kills pause until the resumed head logs "all_ready"
        head.start(resume=True)
        agent.start(resume=True)
        return True

    def wait(self, until: Callable[[], bool], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not until():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
            self.update()
        return True

    # -- the run -------------------------------------------------------------------------------------------

    def run(self) -> str:
        """Starts both nodes, disturbs them until the head exits; '' or why the run ended early."""
        plan, kills = self.plan, _RandomKills(random.Random(self.plan.seed))
        for node in self.nodes:
            node.start(resume=False)
        deadline = self.started + plan.timeout_s
        agent_killed = coordinator_killed = False
        while self.nodes[0].running():
            if time.monotonic() > deadline:
                return f"timed out after {plan.timeout_s:g} s"
            self.update()
            if self.ready_session != self.resumed:  # the run (or its resume) is not up yet: no faults
                time.sleep(0.05)
                continue
            steps = self.steps()
            window = steps < plan.steps - 1  # the last step's kills could go unrecovered: none there
            if (
                not agent_killed
                and 0 <= plan.agent_kill_step <= steps
                and window
                and any((up := self.live(n)) and up[1] == 1 for n in self.names)
            ):
                self.kill_agent()
                agent_killed = True
                continue
            if (
                not coordinator_killed
                and 0 <= plan.coordinator_kill_step <= steps
                and (agent_killed or plan.agent_kill_step < 0 or not window)
                and _state(self.run_dir)
            ):
                coordinator_killed = self.kill_head_and_resume()
                kills.reset()
                continue
            if window and (not plan.kills or kills.made < plan.kills):
                self.random_kill(kills)
            time.sleep(0.05)
        code = self.nodes[0].proc.returncode  # type: ignore[union-attr]
        agent = self.nodes[1]
        if agent.proc is not None:  # the head's StopAgent ends it; a hung one is killed
            _wait_or_kill(agent.proc, 60)
        self.update()
        if code != 0:
            return f"node 0 exited {code}: {self.nodes[0].tail()}"
        return ""

    def random_kill(self, kills: _RandomKills) -> None:
        """One turn of the random kills: pick the next victim (one with restarts left) and when, kill it
        once due, or give up on it if it stays down."""
        plan, now = self.plan, time.monotonic()
        if kills.next_at is None:
            kills.next_at = now + kills.rng.uniform(0.5, 1.5) * plan.kill_every_s
            choices = [n for n in self.names if self.budget[n] < plan.max_restarts]
            kills.victim = kills.rng.choice(choices) if choices else None
        elif kills.victim is None:
            kills.next_at = None
        elif now >= kills.next_at and self.kill_actor(kills.victim):
            kills.made += 1
            kills.reset()
        elif now >= kills.next_at + max(10.0, 2 * plan.kill_every_s):  # still down (a verifier may stay
            kills.reset()  # down, rl/coordinator.py `reward`): pick another

    def stop(self) -> None:
        """Kills whatever of the run is still up (after an error or a timeout): both commands and their
        descendants, by pid."""
        pids = [p for n in self.nodes if n.running() for p in MemorySampler(root_pid=n.pid).tree()]
        for pid in reversed(pids):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for n in self.nodes:
            if n.proc is not None:
                n.proc.wait()


def _state(run_dir: Path) -> dict[str, object]:
    """checkpoints/state.json ({} while none is saved)."""
    path = run_dir / "checkpoints" / "state.json"
    try:
        return msgspec.json.decode(path.read_bytes()) if path.is_file() else {}
    except msgspec.DecodeError:  # being replaced
        return {}
