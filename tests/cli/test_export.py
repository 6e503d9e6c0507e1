"""`slipstream export RUN [--step N] --out DIR` on a run directory whose checkpoints the learner actor wrote
with its own save (`on_checkpoint`), its weights moved between them as training moves them.

The export must hold the checkpoint's weights (not the model the run started from), load in transformers
with our model's logits, carry the run model's tokenizer, and refuse a missing step naming the run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from torch import Tensor

from slipstream.cli import export
from slipstream.engine import hf_export
from slipstream.engine.model import Transformer
from slipstream.engine.weights import load_model
from slipstream.protocols.control import CheckpointSaved, SaveCheckpoint
from slipstream.rl import run_dir as run_dir_files
from slipstream.rl.run_config import TrainConfig
from tests.actors.test_learner import make_learner
from tests.engine.conftest import build_checkpoint
from tests.engine.test_hf_export import assert_same_logits, moved, write_tokenizer

Run = tuple[Path, dict[int, dict[str, Tensor]]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A run directory with checkpoints at steps 1 and 2, and the policy's weights at each."""
    root = tmp_path_factory.mktemp("export")
    model = write_tokenizer(build_checkpoint(root / "model", tie_word_embeddings=True, bos_token_id=1))
    run_dir = root / "run"
    run_dir.mkdir()
    # As `slipstream train` writes it: the resolved config, which names the model the run started from.
    (run_dir / "config.json").write_text(json.dumps(msgspec.to_builtins(TrainConfig(model=str(model)))))
    learner, out = make_learner(model, run_dir, warm_up=False)
    weights = {}
    for step in (1, 2):
        moved(learner.model, seed=step)
        path = run_dir / "checkpoints" / f"step-{step}" / run_dir_files.CHECKPOINT_FILE
        learner.on_checkpoint(SaveCheckpoint(step=step, path=str(path)), "coordinator")
        weights[step] = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    assert [s.error for s in out.of(CheckpointSaved)] == [""] * 2
    return run_dir, weights


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="slipstream")
    export.add_parser(parser.add_subparsers(dest="command"))
    rc = export.run(parser.parse_args(["export", *argv]))
    out, err = capsys.readouterr()
    return rc, out, err


def policy_at(run_dir: Path, weights: dict[str, Tensor]) -> Transformer:
    model = load_model(export.run_model(run_dir))
    model.load_state_dict(weights)
    return model


def test_export_writes_the_newest_checkpoint_as_a_model_transformers_loads(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, weights = run
    rc, out, err = cli(capsys, str(run_dir), "--out", str(tmp_path / "hf"))
    assert rc == 0, err
    assert out.strip() == str(tmp_path / "hf")
    exported = Path(out.strip())
    source = json.loads((exported / "SOURCE.json").read_text())
    assert source["step"] == 2 and source["checkpoint"].endswith("step-2/learner")

    policy = policy_at(run_dir, weights[2])
    assert_same_logits(policy, exported)
    back = dict(load_model(exported).named_parameters())
    for name, value in weights[2].items():
        assert torch.equal(back[name], value), name  # fp32 masters, bit for bit
    model_dir = Path(export.run_model(run_dir))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (exported / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert json.loads((exported / "config.json").read_text())["bos_token_id"] == 1


def test_step_picks_an_older_checkpoint(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, weights = run
    rc, _, err = cli(capsys, str(run_dir), "--step", "1", "--out", str(tmp_path / "hf"))
    assert rc == 0, err
    back = dict(load_model(tmp_path / "hf").named_parameters())
    for name, value in weights[1].items():
        assert torch.equal(back[name], value), name
    assert not torch.equal(weights[1]["embed_tokens.weight"], weights[2]["embed_tokens.weight"])


def test_a_missing_step_names_the_run_and_the_steps_it_has(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = run
    rc, out, err = cli(capsys, str(run_dir), "--step", "7", "--out", str(tmp_path / "hf"))
    assert rc == 1 and out == ""
    assert str(run_dir) in err and "no checkpoint for step 7" in err and "steps 1, 2" in err
    assert not (tmp_path / "hf").exists()


def test_directories_without_a_checkpoint_are_refused(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = run
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text((run_dir / "config.json").read_text())
    rc, _, err = cli(capsys, str(fresh), "--out", str(tmp_path / "hf"))
    assert rc == 1 and str(fresh) in err and "no checkpoint" in err
    rc, _, err = cli(capsys, str(tmp_path / "nowhere"), "--out", str(tmp_path / "hf"))
    assert rc == 1 and "no such run directory" in err
    not_a_run = tmp_path / "not-a-run"
    (not_a_run / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-1", not_a_run / "checkpoints" / "step-1")
    rc, _, err = cli(capsys, str(not_a_run), "--out", str(tmp_path / "hf"))
    assert rc == 1 and "no config.json" in err
    assert not (tmp_path / "hf").exists()


def test_bf16_shards_and_an_existing_out_needs_force(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, weights = run
    target = tmp_path / "hf"
    args = (str(run_dir), "--out", str(target), "--dtype", "bfloat16", "--max-shard-size", "20KB")
    rc, _, err = cli(capsys, *args)
    assert rc == 0, err
    assert (target / hf_export.INDEX_FILE).is_file() and len(list(target.glob("model-*.safetensors"))) > 1
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target, dtype="auto")  # the config's: bf16
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(hf.model.embed_tokens.weight, weights[2]["embed_tokens.weight"].to(torch.bfloat16))

    rc, _, err = cli(capsys, *args)
    assert rc == 1 and "already exists" in err and "--force" in err
    rc, _, err = cli(capsys, str(run_dir), "--step", "1", "--out", str(target), "--force")
    assert rc == 0, err
    assert not (target / hf_export.INDEX_FILE).exists()  # replaced whole
    back = dict(load_model(target).named_parameters())
    assert torch.equal(back["embed_tokens.weight"], weights[1]["embed_tokens.weight"])


def test_parse_size() -> None:
    assert export.parse_size("5GB") == 5 * 10**9
    assert export.parse_size("2GiB") == 2 * 2**30
    assert export.parse_size("500mb") == 500 * 10**6
    assert export.parse_size("1234") == 1234
    assert export.parse_size(export.DEFAULT_MAX_SHARD_SIZE) == hf_export.DEFAULT_MAX_SHARD_BYTES
    for bad in ("", "five", "-1GB", "0", "3XB"):
        with pytest.raises(argparse.ArgumentTypeError):
            export.parse_size(bad)


def test_building_the_parser_imports_no_torch() -> None:
    """Every subcommand builds this parser: it must not cost a torch import."""
    code = "import sys, slipstream.cli.export; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
