"""`slipstream generate` and `slipstream bench decode` on a tiny random model written by the test.

Most cases call the CLI's `main()` in-process (a subprocess pays ~2 s of torch import each); one runs the
real command line in a child process to check the stdout/stderr split and the exit status. The expected
outputs come from driving `Generator` directly with the seeds the command documents.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from slipstream.cli.main import main
from slipstream.engine.generator import Generator, Request
from slipstream.engine.sampling import SamplingParams, sample_seed
from slipstream.engine.weights import load_model
from tests.engine.conftest import TINY, build_checkpoint

VOCAB = TINY["vocab_size"]
MAX_TOKENS = 12
PROMPT_IDS = [[5, 9, 14, 3, 77, 5, 9], [1, 2, 3], [100, 101, 100, 101, 100], [42] * 9]
RECORD_KEYS = {"id", "token_ids", "finish_reason", "num_tokens", "target_passes", "drafted", "accepted"}
ROW_KEYS = {"batch", "spec", "depth", "topk", "verify", "mode", "tokens_per_s", "ratio", "accept_length"}
ARMS = {
    ("off", 0, 0, 0),
    ("ngram", 3, 1, 3),
    ("ngram", 7, 1, 7),
    ("ngram", 4, 4, 16),
    ("self", 3, 1, 3),
    ("self", 7, 1, 7),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


@pytest.fixture(scope="module")
def tokenized_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model plus a word-level tokenizer (no chat template): words w0 … w159."""
    path = build_checkpoint(tmp_path_factory.mktemp("tiny-tok"), "llama", seed=3)
    backend = Backend(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = Whitespace()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": f"q{i}", "prompt_ids": ids}) for i, ids in enumerate(PROMPT_IDS)]
    path.write_text("\n".join(lines) + "\n")
    return path


def generate(
    capsys: pytest.CaptureFixture[str], model: Path, prompts: Path, *extra: str
) -> tuple[int, list[dict[str, Any]], str]:
    """(exit status, JSON records from stdout, stderr) of one in-process `slipstream generate`."""
    argv = ["generate", "--model", str(model), "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS)]
    rc = main([*argv, "--json", *extra])
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines()], err


def direct(model_dir: Path, params: SamplingParams, seed: int) -> list[list[int]]:
    """The same requests straight through `Generator`, with the documented per-request seeds."""
    requests = [
        Request(
            request_id=f"q{i}",
            prompt_ids=ids,
            params=SamplingParams(**{**vars(params), "seed": sample_seed(seed, i)}),
        )
        for i, ids in enumerate(PROMPT_IDS)
    ]
    generator = Generator(load_model(model_dir), num_slots=len(requests), max_len=64)
    return [c.token_ids for c in generator.generate(requests)]


def test_json_lines_shape_and_greedy_output(
    capsys: pytest.CaptureFixture[str], model_dir: Path, prompts_file: Path
) -> None:
    rc, records, err = generate(capsys, model_dir, prompts_file, "--temperature", "0")
    assert rc == 0
    assert [r["id"] for r in records] == ["q0", "q1", "q2", "q3"]
    for r in records:
        assert set(r) == RECORD_KEYS | {"accept_length"}
        assert r["finish_reason"] == "length" and r["num_tokens"] == len(r["token_ids"]) == MAX_TOKENS
        assert r["target_passes"] == MAX_TOKENS and r["drafted"] == r["accepted"] == 0
        assert r["accept_length"] == 1.0
    assert [r["token_ids"] for r in records] == direct(
        model_dir, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), 0
    )
    assert "4 requests" in err


def test_sampled_output_uses_the_documented_seeds(
    capsys: pytest.CaptureFixture[str], model_dir: Path, prompts_file: Path
) -> None:
    rc, records, _ = generate(capsys, model_dir, prompts_file, "--seed", "5", "--top-k", "40")
    assert rc == 0
    expected = direct(model_dir, SamplingParams(temperature=1.0, top_k=40, max_tokens=MAX_TOKENS), 5)
    assert [r["token_ids"] for r in records] == expected
    assert len({tuple(r["token_ids"]) for r in records}) == len(records)


@pytest.fixture(scope="module")
def eagle_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An (untrained) EAGLE head for the tiny model, exported as `drafter warmup` would."""
    from slipstream.engine import eagle_export
    from slipstream.engine.eagle import EagleHead

    target = load_model(model_dir)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("eagle")
    eagle_export.export(EagleHead.for_target(target.config), target.config, out)
    return out


@pytest.mark.parametrize("spec", ["ngram", "auto", "self", "eagle"])
def test_speculation_is_invisible_in_the_output(
    capsys: pytest.CaptureFixture[str], model_dir: Path, prompts_file: Path, spec: str, eagle_dir: Path
) -> None:
    _, greedy_off, _ = generate(capsys, model_dir, prompts_file, "--temperature", "0")
    drafter = ["--drafter", str(eagle_dir)] if spec == "eagle" else []
    _, greedy_spec, err = generate(
        capsys, model_dir, prompts_file, "--temperature", "0", "--spec", spec, *drafter
    )
    assert [r["token_ids"] for r in greedy_spec] == [r["token_ids"] for r in greedy_off]
    if spec == "auto":
        assert "picks ngram" in err
    # Sampling in reproducible mode is token-identical to plain decoding with the same seeds too.
    _, sampled_off, _ = generate(capsys, model_dir, prompts_file, "--seed", "9")
    _, sampled_spec, _ = generate(
        capsys,
        model_dir,
        prompts_file,
        "--seed",
        "9",
        "--spec",
        spec,
        "--reproducible",
        "--depth",
        "3",
        *drafter,
    )
    assert [r["token_ids"] for r in sampled_spec] == [r["token_ids"] for r in sampled_off]
    for r in sampled_spec:
        assert r["target_passes"] * r["accept_length"] == pytest.approx(r["num_tokens"], abs=0.01)
        assert r["accepted"] <= r["drafted"]
    if spec == "self":  # the oracle replays the plain run: every draft is accepted
        assert all(r["accepted"] == r["drafted"] > 0 for r in sampled_spec)
        assert all(r["accept_length"] > 2 for r in sampled_spec)


def test_text_prompts_through_a_tokenizer(
    capsys: pytest.CaptureFixture[str], tokenized_dir: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "text.jsonl"
    lines = [{"id": 1, "prompt": "w5 w9 w14"}, {"id": 2, "prompt_ids": [5, 9, 14]}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rc, records, _ = generate(capsys, tokenized_dir, prompts, "--temperature", "0")
    assert rc == 0
    assert records[0]["token_ids"] == records[1]["token_ids"]  # no template: the text encodes plainly
    text = " ".join(f"w{t}" for t in records[0]["token_ids"])
    assert records[0]["text"] == text
    # Without --json: a readable block per request, the text under a header.
    argv = ["generate", "--model", str(tokenized_dir), "--prompts", str(prompts), "--temperature", "0"]
    assert main([*argv, "--max-tokens", str(MAX_TOKENS)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"### 1  (length, {MAX_TOKENS} tokens, accept length 1.0)\n{text}\n")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "prompts file .*missing.jsonl not found"),
        ("bad_json", r"bad.jsonl:2: not valid JSON"),
        ("text_without_tokenizer", r"bad.jsonl:1: 'prompt' needs a tokenizer"),
        ("out_of_vocab", r"outside the vocabulary|must lie in \[0, 160\)"),
        ("unknown_model", "unknown model 'no-such-model'"),
        ("eagle", "--spec eagle needs --drafter"),
        ("eagle_with_dir", "not an exported EAGLE drafter"),
        ("drafter_without_eagle", "--drafter is for --spec eagle only"),
        ("bad_seed", r"--seed must be in \[0, 2\*\*39\)"),
    ],
)
def test_bad_input_is_one_clear_line(
    capsys: pytest.CaptureFixture[str],
    model_dir: Path,
    prompts_file: Path,
    tmp_path: Path,
    case: str,
    message: str,
) -> None:
    model, prompts, extra = str(model_dir), str(prompts_file), []
    if case == "missing":
        prompts = str(tmp_path / "missing.jsonl")
    elif case == "bad_json":
        prompts = str(write(tmp_path, '{"id": "a", "prompt_ids": [1]}\n{"id": "b", prompt_ids}\n'))
    elif case == "text_without_tokenizer":
        prompts = str(write(tmp_path, '{"id": "a", "prompt": "hello"}\n'))
    elif case == "out_of_vocab":
        prompts = str(write(tmp_path, f'{{"id": "a", "prompt_ids": [1, {VOCAB}]}}\n'))
    elif case == "unknown_model":
        model = "no-such-model"
    elif case == "eagle":
        extra = ["--spec", "eagle"]
    elif case == "eagle_with_dir":
        extra = ["--spec", "eagle", "--drafter", str(tmp_path)]
    elif case == "drafter_without_eagle":
        extra = ["--spec", "ngram", "--drafter", str(tmp_path)]
    elif case == "bad_seed":
        extra = ["--seed", "-1"]
    rc = main(["generate", "--model", model, "--prompts", prompts, "--json", *extra])
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("slipstream generate: ")
    assert re.search(message, err), err


def test_real_command_line(model_dir: Path, prompts_file: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "slipstream.cli.main", "generate", "--model", str(model_dir)]
    ok = [*cli, "--prompts", str(prompts_file), "--json", "--max-tokens", "5", "--spec", "ngram"]
    done = subprocess.run(ok, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["id"] for line in done.stdout.splitlines()] == ["q0", "q1", "q2", "q3"]
    assert "tok/s" in done.stderr and "tok/s" not in done.stdout
    bad = [*cli, "--prompts", "nope.jsonl"]
    failed = subprocess.run(bad, capture_output=True, text=True, env=env, timeout=120)
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.strip() == "slipstream generate: prompts file nope.jsonl not found"


def test_bench_decode_schema(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    quick = [
        "--batches",
        "1,2",
        "--max-tokens",
        "16",
        "--repeats",
        "1",
        "--threads",
        str(torch.get_num_threads()),
    ]
    assert main(["bench", "decode", "--model", str(model_dir), *quick, "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["model"] == str(model_dir) and result["threads"] == torch.get_num_threads()
    assert result["max_tokens"] == 16 and result["batches"] == [1, 2] and result["repeats"] == 1
    assert result["prompt_tokens"] == 64 and "random ids" in result["prompt_source"]
    rows = result["rows"]
    for batch in (1, 2):
        arms = {(r["spec"], r["depth"], r["topk"], r["verify"]) for r in rows if r["batch"] == batch}
        assert arms == ARMS
    for row in rows:
        assert set(row) >= ROW_KEYS
        assert row["tokens_per_s"] > 0 and row["ratio"] > 0
        assert row["mode"] == {"off": None, "ngram": "rejection", "self": "reproducible"}[row["spec"]]
        assert len(row["tokens_per_s_rounds"]) == 1
        if row["spec"] == "off":
            assert row["ratio"] == 1.0 and row["accept_length"] == 1.0
        if row["spec"] == "self":  # the replay of the recorded plain run is accepted all the way
            assert row["accept_length"] > 2
    assert "bench decode: batch 2" in err


def test_bench_decode_rejects_bad_batches(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    assert main(["bench", "decode", "--model", str(model_dir), "--batches", "1,x"]) == 1
    assert "--batches must be comma-separated integers" in capsys.readouterr().err


def test_drafter_takes_a_shipped_name() -> None:
    # The README names the shipped head; `--drafter NAME` resolves it as train's drafter.init_from does.
    from slipstream.cli.generate import _check_options
    from slipstream.engine import hub

    args = argparse.Namespace(
        spec="eagle", drafter=Path("smollm2-135m-chain-sum"), threads=None, max_batch=8, seed=0
    )
    _check_options(args)
    assert args.drafter == hub.DRAFTER_ASSETS / "smollm2-135m-chain-sum"
