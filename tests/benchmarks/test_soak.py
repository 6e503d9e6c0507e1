"""`bench soak` end to end through the CLI: a 3-step tiny-model run with two real SIGKILLs (seeded victims
among rollouts, verifiers, drafters and the learner), beside the same run without; nothing lost, every kill restarted, the same
samples up to keyed near ties, and the JSON it prints round-trips through `SoakResult`. Then `--nodes 2`: the
same on two nodes in network namespaces (real `slipstream train` processes), with node 1's agent and the
coordinator killed too, the coordinator resumed; as root, like the multi-node tests.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import msgspec
import pytest

from slipstream.benchmarks.soak import VICTIMS, SoakResult, compare, near_tie
from slipstream.benchmarks.soak_nodes import NodesSoakResult
from slipstream.cli.main import main
from slipstream.runtime.process import pid_alive


def test_a_near_tie_shares_a_prefix_whose_log_probs_agree() -> None:
    base = ([5, 6, 7, 8], [-1.0, -2.0, -3.0, -4.0])
    assert near_tie(base, ([5, 6, 9, 9], [-1.0, -2.0000005, -7.0, -1.0]))  # flipped at the third token
    assert not near_tie(base, ([5, 6, 9, 9], [-1.0, -2.01, -7.0, -1.0]))  # other weights: the prefix moved
    assert not near_tie(base, ([4, 6, 7, 8], [-1.5, -2.0, -3.0, -4.0]))  # another seed: the first token
    assert near_tie(base, ([5, 6, 7], [-1.0, -2.0, -3.0]))  # ended one token earlier


def test_a_comparison_can_stop_at_the_first_near_tie() -> None:
    expected = [(s, g, 0) for s in range(3) for g in range(2)]
    clean = {k: ([1, 2, 3], [-1.0, -2.0, -3.0]) for k in expected}
    soaked = dict(clean)
    soaked[(1, 0, 0)] = ([1, 2, 9], [-1.0, -2.0000001, -0.5])  # a near tie in step 1
    soaked[(2, 1, 0)] = ([7, 7, 7], [-9.0, -9.0, -9.0])  # step 2 trained on another sample: diverged
    assert compare(expected, soaked, clean) == (2, 1, 2)
    assert compare(expected, soaked, clean, until_near_tie=True) == (1, 1, 1)
    soaked[(1, 1, 0)] = ([4, 2, 3], [-5.0, -2.0, -3.0])  # and a real difference beside it: no stop there
    assert compare(expected, soaked, clean, until_near_tie=True) == (3, 1, 2)
    del soaked[(0, 0, 0)]  # missing: differs, never a near tie
    assert compare(expected, soaked, clean)[:2] == (4, 1)


@pytest.mark.timeout(300)
def test_a_short_soak_loses_nothing_and_matches_the_run_without_kills(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Kills land only before the last step begins; a tiny model's step takes about a second.
    argv = ["bench", "soak", "--steps", "3", "--kills", "2", "--kill-every", "0.5", "--seed", "0"]
    code = main([*argv, "--run-dir", str(tmp_path), "--json", "prompts_per_step=3"])
    out = capsys.readouterr().out
    result = msgspec.json.decode(out, type=SoakResult)
    assert msgspec.json.decode(msgspec.json.encode(result)) == json.loads(out)

    assert len(result.kill_log) == 2 and sum(result.kills.values()) == 2, result.kill_log
    assert result.restarts == result.kills  # every kill restarted, within the run
    assert result.not_killed == {}
    assert set(result.kill_windows) >= {"rollout", "verifier", "drafter", "learner"}
    for run in (result.soak, result.clean):
        assert run.error == "" and run.steps_completed == 3
        assert run.recorded == run.expected == 3 * 3 * 4 and run.lost == 0
    # Identical but for keyed near ties (at most one here): a restarted rollout decodes in other batch shapes.
    assert result.differing == result.near_ties <= 1
    assert result.ok and code == 0
    # The builder's tiny model, with SmolLM2's tokenizer, in the run directory.
    assert (tmp_path / "model" / "tokenizer.json").is_file()


def _namespaces() -> set[str]:
    """The network namespaces benchmarks/namespaces.py names (sk<tag>a, sk<tag>b) that exist now."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {name for line in listed.splitlines() if (name := line.split(" ")[0]).startswith("sk")}


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_two_node_soak_kills_actors_the_agent_and_the_coordinator_and_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two namespaced nodes, every role on both; two random actor kills in step 0, node 1's agent once step 0
    # is recorded, the head once step 1 is (a checkpoint a step), then both nodes resumed from it.
    before = _namespaces()
    argv = ["bench", "soak", "--nodes", "2", "--steps", "3", "--kills", "2", "--kill-every", "1", "--seed", "0",
            "--agent-kill-step", "1", "--coordinator-kill-step", "2", "--timeout", "360", "--port", "29611"]  # fmt: skip
    code = main([*argv, "--run-dir", str(tmp_path), "--json", "prompts_per_step=3", "checkpoint_every=1"])
    out = capsys.readouterr().out
    result = msgspec.json.decode(out, type=NodesSoakResult)
    assert msgspec.json.decode(msgspec.json.encode(result)) == json.loads(out)

    assert result.why_not_ok == [] and result.ok and code == 0, result.why_not_ok
    actors = [k for k in result.kill_log if k.actor not in ("agent:1", "coordinator")]
    assert len(actors) == 2 and {k.actor.partition(":")[0] for k in actors} <= set(VICTIMS)
    assert result.kills["agent"] == 1 and result.kills["coordinator"] == 1
    assert result.resumed == 1 and result.resumed_from_step >= 2  # the head died after step 1's checkpoint
    # Node 1's actors died with its agent; those the run needed again restarted on node 0.
    assert result.relocated and all(k.node == 1 for k in result.kill_log if k.actor == "agent:1")
    assert sum(result.restarts.values()) >= 2 + len(result.relocated)
    assert result.lost == 0 and result.soak.lost == 0 and result.clean.lost == 0
    for run in (result.soak, result.clean):
        assert run.error == "" and run.steps_completed == 3
        assert run.recorded == run.expected == 3 * 3 * 4
    assert result.differing == result.near_ties <= 1
    assert result.compared_steps == 3 or result.near_ties == 1  # tokens compared up to a near tie at most
    # Over CURVE with the run's key; node 1's agent started twice: at the start, and beside the resumed head.
    logs = tmp_path / "soak" / "logs"
    assert (tmp_path / "soak" / "keys" / "run.key").is_file()
    agent = [json.loads(line) for line in (logs / "agent-1.jsonl").read_text().splitlines()]
    assert [e["event"] for e in agent].count("agent_started") == 2
    # Nothing of the run is left: every process its logs name is gone, and so are the namespaces.
    pids = [
        int(e["pid"])
        for log in logs.glob("*.jsonl")
        for e in map(json.loads, log.read_text().splitlines())
        if "pid" in e
    ]
    assert pids and not [p for p in pids if pid_alive(p)]
    assert _namespaces() <= before
