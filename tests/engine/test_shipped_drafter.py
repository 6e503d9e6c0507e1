"""The drafter shipped with the package (`hub.DRAFTERS`, engine/assets/drafters/): its name resolves, it
is a small bf16 export without the target's tensors, it loads into the embedded model's fp32 rollout and
drafter owner, and it drafts for it. Uses the real SmolLM2-135M (`hub.pull`, converted offline, cached).
"""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from slipstream.engine import eagle_export, hub
from slipstream.engine.config import ModelConfig
from slipstream.engine.eagle import EagleHead
from slipstream.engine.generator import Generator, Request, run_requests
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weights import load_head_parts, load_model

NAME = "smollm2-135m-chain-sum"
ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 10 << 20  # "a few MB": one bf16 decoder layer and fc of a 576-wide model is ~8.4 MB


@pytest.fixture(scope="module")
def smol() -> Path:
    return hub.pull(hub.DRAFTERS[NAME].model)


def test_every_shipped_name_resolves_to_its_packaged_folder() -> None:
    for name, spec in hub.DRAFTERS.items():
        path = hub.drafter_dir(name)
        assert path == hub.DRAFTER_ASSETS / name
        assert {p.name for p in path.iterdir()} >= {"config.json", "model.safetensors", "token_counts.json"}
        assert spec.model in hub.MODELS


def test_package_data_carries_the_assets() -> None:
    """A non-editable install copies what pyproject's package-data names: every asset file must match."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["slipstream.engine"]
    files = [p for p in hub.DRAFTER_ASSETS.rglob("*") if p.is_file()]
    assert files
    for file in files:
        relative = file.relative_to(ROOT / "engine").as_posix()
        assert any(fnmatch(relative, pattern) for pattern in patterns), relative


def test_a_shipped_name_wins_over_a_same_named_directory_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's config names the shipped head wherever it runs, even beside a warmup's `--out NAME`."""
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert hub.drafter_dir(NAME) == hub.DRAFTER_ASSETS / NAME
    assert hub.drafter_dir(f"./{NAME}") == Path(NAME)


def test_a_directory_is_used_as_is_and_an_unknown_name_lists_the_known(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert hub.drafter_dir(tmp_path) == tmp_path
    with pytest.raises(ValueError, match=rf"unknown drafter 'nope'.*{NAME}"):
        hub.drafter_dir("nope")
    with pytest.raises(ValueError, match="unknown drafter"):
        eagle_export.load_token_counts(tmp_path / "absent")


@pytest.mark.parametrize("name", sorted(hub.DRAFTERS))
def test_the_asset_is_a_small_bf16_head_of_the_embedded_model(smol: Path, name: str) -> None:
    path = hub.drafter_dir(name)
    target = ModelConfig.from_pretrained(smol)
    weights = path / "model.safetensors"
    assert weights.stat().st_size < MAX_BYTES
    expected = eagle_export.exported_state_dict(EagleHead.for_target(target))  # names and shapes
    with safe_open(str(weights), framework="pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        dtypes = {f.get_slice(key).get_dtype() for key in f.keys()}
    assert shapes == {key: tuple(t.shape) for key, t in expected.items()}  # no embedding or LM head copy
    assert dtypes == {"BF16"}
    counts = eagle_export.load_token_counts(name)
    assert counts and max(counts) < target.vocab_size


def test_bf16_loads_into_the_fp32_drafter_owner(smol: Path) -> None:
    """The drafter actor's path: head parts of the target (fp32), then `load_head` by name."""
    parts = load_head_parts(smol)
    head, version = eagle_export.load_head(NAME, parts)
    assert version > 0
    assert {p.dtype for p in head.parameters()} == {torch.float32}
    with safe_open(str(hub.drafter_dir(NAME) / "model.safetensors"), framework="pt") as f:
        fc = f.get_tensor("fc.weight")
    assert torch.equal(head.fc.weight.detach(), fc.float())  # bf16 → fp32 is exact


def test_the_shipped_head_drafts_for_smollm2_in_reproducible_mode(smol: Path) -> None:
    """The rollout's path (`eagle_export.load` by name into the fp32 target) in the demo's mode and depth:
    fewer target passes than tokens. (That speculation never changes the tokens: test_eagle.py.)"""
    target = load_model(smol)
    tokenizer = Tokenizer.from_dir(smol)
    ask = "State the final answer to the following arithmetic problem: {} ="
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": ask.format(q)}])
        for q in ("3 + 4", "8 - 5")
    ]
    gen = Generator(
        target,
        num_slots=len(prompts),
        eos_token_ids=sorted(tokenizer.stop_ids),
        spec=SpecConfig(method="eagle", depth=3, mode="reproducible"),
        drafters={"eagle": eagle_export.load(NAME, target)},
    )
    requests = [
        Request(
            request_id=str(i), prompt_ids=p, params=SamplingParams(temperature=0.8, max_tokens=32, seed=i)
        )
        for i, p in enumerate(prompts)
    ]
    done = run_requests(gen, requests)
    tokens, passes = sum(len(c.token_ids) for c in done), sum(c.target_passes for c in done)
    assert tokens / passes > 1.3, (tokens, passes)  # an untrained head stays near 1.0
