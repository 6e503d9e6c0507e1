"""`bench startup` at its smallest: one round of each mode through real processes. The figures are not
judged here (timed figures live in the bench's JSON and docs/benchmarks.md); what is checked is that both
modes ran as named — exec'd with the switch off, forked with it on — and that the command line reaches it."""

from __future__ import annotations

import os

import pytest

from slipstream.benchmarks import startup
from slipstream.cli.main import build_parser
from slipstream.runtime.fork_server import ENV_SWITCH


@pytest.mark.timeout(180)
def test_bench_startup_times_both_modes_and_leaves_the_switch_as_it_found_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    seen: list[str | None] = []
    real = startup._round

    async def noting(run_dir, actors):  # type: ignore[no-untyped-def]
        seen.append(os.environ.get(ENV_SWITCH))
        return await real(run_dir, actors)

    monkeypatch.setattr(startup, "_round", noting)
    result = startup.run(actors=2, rounds=1)
    assert seen == ["0", "1"] and ENV_SWITCH not in os.environ  # exec'd, then forked; restored
    for mode in (result.exec, result.fork):
        assert mode.start_s > 0 and mode.restart_s > 0 and mode.cpu_s > 0
    assert result.start_ratio == round(result.fork.start_s / result.exec.start_s, 3)
    assert "ratio" in startup.render(result)
    with pytest.raises(ValueError, match="--actors and --rounds must be >= 1"):
        startup.run(actors=0)


def test_bench_startup_is_on_the_command_line_with_the_modules_defaults() -> None:
    args = build_parser().parse_args(["bench", "startup", "--json"])
    assert (args.what, args.json) == ("startup", True)
    assert (args.actors, args.rounds) == startup.run.__defaults__  # what `bench startup --help` states
