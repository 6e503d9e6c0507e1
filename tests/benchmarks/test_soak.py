"""`bench soak` end to end through the CLI: a 3-step tiny-model run with two real SIGKILLs (seeded victims
among rollouts, verifiers, drafters and the learner), beside the same run without; nothing lost, every kill restarted, the same
samples up to keyed near ties, and the JSON it prints round-trips through `SoakResult`.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from slipstream.benchmarks.soak import SoakResult, near_tie
from slipstream.cli.main import main


@pytest.mark.timeout(300)
def test_a_near_tie_shares_a_prefix_whose_log_probs_agree() -> None:
    base = ([5, 6, 7, 8], [-1.0, -2.0, -3.0, -4.0])
    assert near_tie(base, ([5, 6, 9, 9], [-1.0, -2.0000005, -7.0, -1.0]))  # flipped at the third token
    assert not near_tie(base, ([5, 6, 9, 9], [-1.0, -2.01, -7.0, -1.0]))  # other weights: the prefix moved
    assert not near_tie(base, ([4, 6, 7, 8], [-1.5, -2.0, -3.0, -4.0]))  # another seed: the first token
    assert near_tie(base, ([5, 6, 7], [-1.0, -2.0, -3.0]))  # ended one token earlier


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
