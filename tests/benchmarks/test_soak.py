"""`bench soak` end to end through the CLI: a 3-step tiny-model run with two real SIGKILLs (seeded victims
among rollouts, verifiers, drafters and the learner), beside the same run without; nothing lost, every kill restarted, the same
samples, and the JSON it prints round-trips through `SoakResult`.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from slipstream.benchmarks.soak import SoakResult
from slipstream.cli.main import main


@pytest.mark.timeout(300)
def test_a_short_soak_loses_nothing_and_matches_the_run_without_kills(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "soak", "--steps", "3", "--kills", "2", "--kill-every", "1", "--seed", "0"]
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
    assert result.differing == 0
    assert result.ok and code == 0
    # The builder's tiny model, with SmolLM2's tokenizer, in the run directory.
    assert (tmp_path / "model" / "tokenizer.json").is_file()
