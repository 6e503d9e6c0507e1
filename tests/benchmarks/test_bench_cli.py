"""`slipstream bench NAME`: one subcommand per bench, each declaring its own flags (cli/bench.py is the
only place they are parsed), with the defaults its help states being the benchmark modules' own."""

from __future__ import annotations

import argparse

import pytest

from slipstream.benchmarks import decode, gpu, sync
from slipstream.cli import bench
from slipstream.cli.main import build_parser, main


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    top = build_parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    names = next(a for a in commands.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    return dict(names.choices)


def _help(parser: argparse.ArgumentParser, flag: str) -> str:
    return next(a.help for a in parser._actions if flag in a.option_strings) or ""


def test_every_bench_has_its_subcommand_and_json() -> None:
    parsers = _bench_parsers()
    assert set(parsers) == set(bench.BENCHES)
    for name, parser in parsers.items():
        assert "--json" in parser.format_help(), name


def test_the_gpu_runbook_line_parses() -> None:
    # deploy/gpu_session.sh and docs/gpu.md run exactly this shape of line.
    args, rest = build_parser().parse_known_args(
        ["bench", "gpu", "--json", "--quick", "--shapes", "qwen2.5-7b", "--no-tests", "--batches", "1,16",
         "--peer-batches", "all"]
    )  # fmt: skip
    assert rest == [] and args.what == "gpu" and args.json and args.quick and args.no_tests
    assert (args.shapes, args.batches, args.peer_batches) == ("qwen2.5-7b", "1,16", "all")


def test_the_defaults_stated_in_help_are_the_modules() -> None:
    parsers = _bench_parsers()
    commas = lambda values: ",".join(map(str, values))  # noqa: E731
    assert commas(gpu.BATCHES) in _help(parsers["gpu"], "--batches")
    assert commas(gpu.PEER_BATCHES) in _help(parsers["gpu"], "--peer-batches")
    assert commas(gpu.EAGER_BATCHES) in _help(parsers["gpu"], "--eager-batches")
    assert commas(gpu.SHAPES) in _help(parsers["gpu"], "--shapes")
    assert commas(decode.DEFAULT_BATCHES) in _help(parsers["decode"], "--batches")
    assert decode.DEFAULT_MODEL in _help(parsers["decode"], "--model")
    assert parsers["sync"].get_default("model") == sync.run.__defaults__[0]  # type: ignore[index]
    assert parsers["sync"].get_default("steps") == sync.run.__defaults__[1]  # type: ignore[index]


@pytest.mark.parametrize("argv", [["bench", "decode", "prompts=4"], ["bench", "transport", "x=1"]])
def test_overrides_are_refused_where_no_config_is_read(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 1
    assert "key=value overrides are for bench rollout, e2e and soak" in capsys.readouterr().err


def test_a_flag_of_another_bench_is_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "transport", "--kills", "3"])
    assert exc.value.code == 2
