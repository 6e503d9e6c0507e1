"""`slipstream bench soak --nodes 2`: a two-node run as a long run meets it, beside the same run without kills.

    slipstream bench soak --nodes 2 --steps 100 --kill-every 3 --seed 1 --json   # as root

Each node is a real `slipstream train` process in a network namespace of its own (benchmarks/namespaces.py),
CURVE between them. A seeded RNG SIGKILLs random actors of every role on both nodes (children of the
current head or agent only, each at most `max_restarts` times); node 1's agent is killed once
(`agent_kill_step`: its actors move to node 0), and once a checkpoint exists the head is killed
(`coordinator_kill_step`) and both nodes' commands start again with `--resume RUN` (a resumed head makes a
fresh key and waits for every agent). Then the same config runs on one node without kills (reproducible
mode: the same samples), and samples are compared per (step, group, sample) as in benchmarks/soak.py, up
to the first step where only keyed near ties differ. Restarts and requeued work are counted from the
coordinator's log, which both heads append to (a resume drops later records from metrics.jsonl).
Details and results: docs/benchmarks.md, "Two nodes".
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
from slipstream.benchmarks.namespaces import two_namespaces
from slipstream.runtime.process import MemorySampler, parent_pid, pid_alive

__all__ = ["OVERRIDES", "NodeKill", "NodesPlan", "NodesSoakResult", "render", "run"]

# Over benchmarks/soak.py's OVERRIDES, before the command line's: every role on both nodes (one drafter per
# CPU node), and checkpoints a learner's replay and the coordinator's resume start from.
OVERRIDES = (
    "rollout.devices=2",
    "verifier.actors=2",
    "learner.ranks=2",
    "nodes=[{rollouts: 1, verifiers: 1, learners: 1}, {rollouts: 1, verifiers: 1, learners: 1}]",
    "checkpoint_every=2",
)

WINDOWS = {
    **soak.WINDOWS,
    "agent": "once, when agent_kill_step steps are recorded, before the last step (its node is declared lost "
    "10 s later, and its actors restart on node 0)",
    "coordinator": "once, when coordinator_kill_step steps are recorded and a checkpoint exists (after the "
    "agent's kill); then both nodes resume (--resume RUN); random kills pause until the resumed head logs "
    "all_ready",
}
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


class NodesSoakResult(msgspec.Struct, frozen=True, kw_only=True):
    nodes: int
    steps: int
    seed: int
    kill_every_s: float
    max_restarts: int
    victims: list[str]  # roles killed: the actors' at random, then "agent" and "coordinator"
    kill_windows: dict[str, str]
    kills: dict[str, int]  # by role, "agent" and "coordinator" included
    kills_by_node: dict[str, dict[str, int]]  # node -> role -> kills
    kill_log: list[NodeKill]
    restarts: dict[str, int]  # by role: the supervisors' "restarted" events (relocations included)
    relocated: list[str]  # actors restarted on node 0 after node 1's agent died
    restarted_by_resume: dict[str, int]  # actor -> deaths of ours no restart followed before the head's kill
    unrestarted: dict[str, int]  # actor -> deaths of ours neither a restart nor the resume followed
    requeued: int  # samples and score requests dealt again ("requeued" events)
    duplicates: int  # results dropped as seen already (the final metrics.jsonl)
    resumed: int  # times the head was started again with --resume
    resumed_from_step: int  # the checkpoint the resume started from (-1: none)
    lost: int  # (step, group, sample) the run with kills never recorded
    differing: int  # (step, group, sample) whose tokens differ from the run without kills, or missing
    near_ties: int  # of those, keyed near ties (benchmarks/soak.py near_tie)
    # Steps whose tokens were compared: all, or up to the first where only near ties differ (the runs then
    # train on different samples, and later steps are checked for completeness alone: `lost`)
    compared_steps: int
    soak: soak.RunOutcome
    clean: soak.RunOutcome
    why_not_ok: list[str]  # [] when ok
    ok: bool


@dataclass
class _Node:
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
class _Soak:
    plan: NodesPlan
    run_dir: Path
    nodes: list[_Node]
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
        """(pid, node) of `name`'s newest process if it is up and a child of a current node's command."""
        pid = self.pids.get(name)
        if pid is None or pid in self.killed:
            return None
        parent = parent_pid(pid)
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
            try:
                agent.proc.wait(timeout=HEAD_LOST_S + 30)
            except subprocess.TimeoutExpired:
                agent.proc.kill()
                agent.proc.wait()
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
        plan, rng = self.plan, random.Random(self.plan.seed)
        for node in self.nodes:
            node.start(resume=False)
        deadline = self.started + plan.timeout_s
        agent_killed = coordinator_killed = False
        next_kill: float | None = None
        victim: str | None = None
        random_kills = 0
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
                next_kill, victim = None, None
                continue
            if window and (not plan.kills or random_kills < plan.kills):
                now = time.monotonic()
                if next_kill is None:
                    next_kill = now + rng.uniform(0.5, 1.5) * plan.kill_every_s
                    choices = [n for n in self.names if self.budget[n] < plan.max_restarts]
                    victim = rng.choice(choices) if choices else None
                elif victim is None:
                    next_kill = None
                elif now >= next_kill and self.kill_actor(victim):
                    random_kills += 1
                    next_kill, victim = None, None
                elif now >= next_kill + max(10.0, 2 * plan.kill_every_s):  # still down (a verifier may stay
                    next_kill, victim = None, None  # down, rl/coordinator.py `reward`): pick another
            time.sleep(0.05)
        code = self.nodes[0].proc.returncode  # type: ignore[union-attr]
        agent = self.nodes[1]
        if agent.proc is not None:  # the head's StopAgent ends it; a hung one is killed
            try:
                agent.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.proc.kill()
                agent.proc.wait()
        self.update()
        if code != 0:
            return f"node 0 exited {code}: {self.nodes[0].tail()}"
        return ""

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


def _events(run_dir: Path, name: str) -> list[dict[str, object]]:
    return soak.LogTail(run_dir / "logs" / f"{name}.jsonl").new()


def _train(plan: NodesPlan, config: str, run_dir: Path, *node: str) -> Callable[[bool], list[str]]:
    def argv(resume: bool) -> list[str]:
        where = ["--resume", str(run_dir)] if resume else [config, "--run-dir", str(run_dir)]
        return [plan.python, "-m", "slipstream.cli.main", "train", *where, *node]

    return argv


def run(plan: NodesPlan, root: Path) -> NodesSoakResult:
    """The two-node run with kills under root/soak, then the one-node run without under root/clean."""
    for name in ("soak", "clean"):
        if (root / name).exists():
            raise ValueError(f"{root / name} exists: a soak needs fresh run directories (--run-dir)")
    run_dir = root / "soak"
    with two_namespaces() as (ns0, ip0, ns1, _):
        head = f"{ip0}:{plan.port}"
        nodes = [
            _Node(rank, ns, _train(plan, plan.config, run_dir, "--nnodes", "2", "--node-rank", str(rank),
                                   "--head", head, "--join-timeout", "120"), root / f"soak-node{rank}.out")
            for rank, ns in ((0, ns0), (1, ns1))
        ]  # fmt: skip
        driver = _Soak(plan, run_dir, nodes)
        try:
            error = driver.run()
        finally:
            driver.stop()
        wall_s = time.monotonic() - driver.started
    soaked, soak_samples = soak.outcome(plan, run_dir, wall_s, error)

    started = time.monotonic()
    with (root / "clean.out").open("wb") as out:
        argv = _train(plan, plan.reference, root / "clean")(False)
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=plan.timeout_s)
            error = "" if code == 0 else f"exited {code}: {(root / 'clean.out').read_text()[-2000:]}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            error = f"timed out after {plan.timeout_s:g} s"
    clean, clean_samples = soak.outcome(plan, root / "clean", time.monotonic() - started, error)

    logged = _events(run_dir, "coordinator")
    restarted = Counter(str(e["actor"]) for e in logged if e.get("event") == "restarted")
    relocated = sorted({str(e["actor"]) for e in logged if e.get("event") == "relocated"})
    requeued = sum(
        int(e.get("samples", 0)) + int(e.get("scores", 0)) for e in logged if e.get("event") == "requeued"
    )  # type: ignore[call-overload]
    differ, near, compared = soak.compare(
        soak.expected_keys(plan), soak_samples, clean_samples, until_near_tie=True
    )
    kills = Counter(k.actor.partition(":")[0] for k in driver.kills)
    by_node: dict[str, Counter[str]] = {}
    for k in driver.kills:
        by_node.setdefault(str(k.node), Counter())[k.actor.partition(":")[0]] += 1

    why: list[str] = []
    for name, outcome in (("soak", soaked), ("clean", clean)):
        if outcome.error:
            why.append(f"{name}: {outcome.error[:300]}")
        if outcome.lost or outcome.recorded != outcome.expected:
            why.append(f"{name}: {outcome.lost} lost, {outcome.recorded} of {outcome.expected} recorded")
    if differ != near:
        why.append(f"{differ - near} samples differ from the run without kills, not by a near tie")
    if plan.agent_kill_step >= 0 and kills["agent"] != 1:
        why.append("node 1's agent was not killed")
    if plan.coordinator_kill_step >= 0 and (kills["coordinator"] != 1 or driver.resumed != 1):
        why.append("the coordinator was not killed and resumed")
    if not set(relocated) <= set(driver.node1):
        why.append(f"relocated {relocated}, but node 1 ran {driver.node1} when its agent died")
    # A dead verifier is restarted when the coordinator next waits on a reward with none queued
    # (rl/coordinator.py `reward`): one may stay down to the end while the other scores everything.
    unrestarted = {a: n for a, n in sorted(driver.pending.items()) if n > 0}
    if eager := {a: n for a, n in unrestarted.items() if not a.startswith("verifier:")}:
        why.append(f"deaths no restart and no resume followed: {eager}")
    return NodesSoakResult(
        nodes=2,
        steps=plan.steps,
        seed=plan.seed,
        kill_every_s=plan.kill_every_s,
        max_restarts=plan.max_restarts,
        victims=[*soak.VICTIMS, "agent", "coordinator"],
        kill_windows=dict(WINDOWS),
        kills=dict(kills),
        kills_by_node={n: dict(c) for n, c in sorted(by_node.items())},
        kill_log=driver.kills,
        restarts=dict(Counter(a.partition(":")[0] for a in restarted.elements())),
        relocated=relocated,
        restarted_by_resume={a: n for a, n in sorted(driver.by_resume.items()) if n > 0},
        unrestarted=unrestarted,
        requeued=requeued,
        duplicates=sum(r["duplicates"] for r in soak.metrics_records(run_dir)),
        resumed=driver.resumed,
        resumed_from_step=driver.resumed_from_step,
        lost=soaked.lost,
        differing=differ,
        near_ties=near,
        compared_steps=compared + 1,
        soak=soaked,
        clean=clean,
        why_not_ok=why,
        ok=not why,
    )


def render(result: NodesSoakResult) -> str:
    lines = [f"{'':>6} {'wall s':>7} {'steps':>5} {'expected':>8} {'recorded':>8} {'lost':>4}  error"]
    for name in ("soak", "clean"):
        o: soak.RunOutcome = getattr(result, name)
        lines.append(
            f"{name:>6} {o.wall_s:>7.1f} {o.steps_completed:>5} {o.expected:>8} {o.recorded:>8} {o.lost:>4}"
            f"  {o.error[:200] or '-'}"
        )
    lines.append(
        f"two nodes: kills {result.kills} (by node {result.kills_by_node}; every ~{result.kill_every_s} s, "
        f"seed {result.seed}), restarts {result.restarts}, relocated {result.relocated}, started again by the "
        f"resume {result.restarted_by_resume}, left down {result.unrestarted}, resumed "
        f"{result.resumed}x from step {result.resumed_from_step}, requeued {result.requeued}, duplicates "
        f"dropped {result.duplicates}; {result.lost} lost, {result.differing} samples differ "
        f"({result.near_ties} near ties) from the one-node run without kills; "
        + ("OK" if result.ok else "FAILED: " + "; ".join(result.why_not_ok))
    )
    return "\n".join(lines)
