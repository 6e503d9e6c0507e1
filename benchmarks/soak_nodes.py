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
coordinator's log, which both heads append to (a resume drops later records from metrics.jsonl). The
driver making the faults: benchmarks/soak_driver.py; details and results: docs/benchmarks.md, "Two nodes".
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec

from slipstream.benchmarks import soak
from slipstream.benchmarks.namespaces import two_namespaces
from slipstream.benchmarks.soak_driver import Node, NodeKill, NodesPlan, SoakDriver

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


def _events(run_dir: Path, name: str) -> list[dict[str, object]]:
    return soak.LogTail(run_dir / "logs" / f"{name}.jsonl").new()


def _train(plan: NodesPlan, config: str, run_dir: Path, *node: str) -> Callable[[bool], list[str]]:
    def argv(resume: bool) -> list[str]:
        where = ["--resume", str(run_dir)] if resume else [config, "--run-dir", str(run_dir)]
        return [plan.python, "-m", "slipstream.cli.main", "train", *where, *node]

    return argv


def _run_with_kills(plan: NodesPlan, root: Path) -> tuple[SoakDriver, float, str]:
    """The two-node run under root/soak, disturbed: its driver (what it killed and saw), wall seconds, and
    why it ended early ("" if it did not)."""
    run_dir = root / "soak"
    with two_namespaces() as (ns0, ip0, ns1, _):
        head = f"{ip0}:{plan.port}"
        nodes = [
            Node(rank, ns, _train(plan, plan.config, run_dir, "--nnodes", "2", "--node-rank", str(rank),
                                   "--head", head, "--join-timeout", "120"), root / f"soak-node{rank}.out")
            for rank, ns in ((0, ns0), (1, ns1))
        ]  # fmt: skip
        driver = SoakDriver(plan, run_dir, nodes)
        try:
            error = driver.run()
        finally:
            driver.stop()
        return driver, time.monotonic() - driver.started, error


def _run_without_kills(plan: NodesPlan, root: Path) -> tuple[soak.RunOutcome, dict[soak.Key, soak.Sample]]:
    """The reference config on one node under root/clean, undisturbed: its outcome and samples."""
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
    return soak.outcome(plan, root / "clean", time.monotonic() - started, error)


def _why_not_ok(
    plan: NodesPlan,
    driver: SoakDriver,
    outcomes: dict[str, soak.RunOutcome],
    *,
    differ: int,
    near: int,
    kills: Counter[str],
    relocated: list[str],
    unrestarted: dict[str, int],
) -> list[str]:
    """Every way the soak failed: a run's error or lost samples, samples that differ beyond near ties, a
    planned fault not made, an actor relocated that node 1 did not run, a death nothing restarted."""
    why: list[str] = []
    for name, outcome in outcomes.items():
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
    if eager := {a: n for a, n in unrestarted.items() if not a.startswith("verifier:")}:
        why.append(f"deaths no restart and no resume followed: {eager}")
    return why


def run(plan: NodesPlan, root: Path) -> NodesSoakResult:
    """The two-node run with kills under root/soak, then the one-node run without under root/clean."""
    for name in ("soak", "clean"):
        if (root / name).exists():
            raise ValueError(f"{root / name} exists: a soak needs fresh run directories (--run-dir)")
    run_dir = root / "soak"
    driver, wall_s, error = _run_with_kills(plan, root)
    soaked, soak_samples = soak.outcome(plan, run_dir, wall_s, error)
    clean, clean_samples = _run_without_kills(plan, root)

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
    unrestarted = {a: n for a, n in sorted(driver.pending.items()) if n > 0}
    why = _why_not_ok(
        plan, driver, {"soak": soaked, "clean": clean}, differ=differ, near=near, kills=kills,
        relocated=relocated, unrestarted=unrestarted,
    )  # fmt: skip
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
