"""A node lost mid-run: node 1's agent is SIGKILLed after the first step (its rollout and drafter die with
it); the head declares the node lost, restarts their work on node 0, tells every peer where they are now,
and the run completes with every applied version verified. Two network namespaces, as in test_train_nodes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest

from tests import netns
from tests.cli.conftest import config
from tests.cli.test_train_nodes import events, node

pytestmark = pytest.mark.timeout(600)


def test_a_lost_nodes_rollout_and_drafter_move_to_node_0_and_the_run_completes(
    tiny_chat: Path, tmp_path: Path
) -> None:
    cfg = config(
        tiny_chat,
        steps=3,
        checkpoint_every=1,  # the moved drafter restarts from the run's newest checkpoint
        faults={"node_lost_s": 4.0},  # node 1 is declared lost 4 s after its agent's last beat (default 10)
        rollout={"devices": 2, "verify_weights": True},
        nodes=[{"learners": 1, "verifiers": 1, "rollouts": 1}, {"rollouts": 1}],
    )
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(msgspec.to_builtins(cfg)))
    run_dir = tmp_path / "run"
    with netns.two_nodes() as (ns0, ip0, ns1, _):
        head = node(ns0, 0, cfg_file, run_dir, ip0, tmp_path / "node0.out")
        agent = node(ns1, 1, cfg_file, run_dir, ip0, tmp_path / "node1.out")
        try:
            metrics = run_dir / "metrics.jsonl"
            deadline = time.monotonic() + 300
            while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
                assert head.poll() is None, (tmp_path / "node0.out").read_text()[-3000:]
                assert time.monotonic() < deadline, "the first step never finished"
                time.sleep(0.2)
            os.kill(agent.pid, signal.SIGKILL)  # node 1 is gone: its actors die with their agent
            assert head.wait(timeout=400) == 0, (tmp_path / "node0.out").read_text()[-3000:]
        finally:
            for p in (head, agent):
                if p.poll() is None:
                    p.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["steps"]) == 3
    logged = events(run_dir, "coordinator")
    assert any(e["event"] == "node_lost" and e["node"] == 1 for e in logged)
    moved = {e["actor"] for e in logged if e["event"] == "relocated" and e["from_node"] == 1}
    assert moved == {"rollout:1", "drafter:1"}
    # rollout:1 restarted on node 0 holds every later version bitwise (re-hashed against the learner's).
    applied = [e for e in events(run_dir, "rollout-1") if e["event"] == "weights_applied"]
    assert applied[-1]["version"] == 3 and all(e["verified"] for e in applied)
    # Its peers were told where it is now (the learner pushes to it, rollout:0 streams to drafter:1).
    assert any(e["event"] == "peer_moved" and e["peer"] == "rollout:1" for e in events(run_dir, "learner-0"))
