"""engine/hf_export.py: an exported policy loads in transformers with our model's logits, loads back into our
loader with equal weights, shards as HF does, carries its tokenizer, and never half-overwrites a directory.

The models are tiny random checkpoints (tests/engine/conftest.py) whose weights are then moved, so an
export that copied the source files instead of writing the model's weights would fail.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from slipstream.engine import hf_export
from slipstream.engine.config import ModelConfig
from slipstream.engine.model import Transformer
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weights import load_model
from tests.engine.conftest import TINY

ATOL = 1e-5
CASES = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-untied-gqa": ("llama", {}),
    "llama3-rope-biases": (
        "llama",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "qwen2-bias-untied": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2, "rope_theta": 1e6}),
}
CHAT_TEMPLATE = "{% for m in messages %}{{ bos_token }}{{ m['content'] }} {{ eos_token }} {% endfor %}"


def write_tokenizer(path: Path, vocab: int = TINY["vocab_size"]) -> Path:
    """A word-level tokenizer (<unk> <s> </s>, then words w3 … w{vocab-1}) with special tokens, a chat
    template and a generation config: the files a model directory carries besides its weights."""
    specials = ["<unk>", "<s>", "</s>"]
    words = {**{t: i for i, t in enumerate(specials)}, **{f"w{i}": i for i in range(len(specials), vocab)}}
    backend = Backend(WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    backend.add_special_tokens(specials)
    backend.save(str(path / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3]}))
    return path


def moved(model: Transformer, seed: int = 7) -> Transformer:
    """`model` with every weight shifted by noise: what a training step leaves, unlike any file on disk."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_same_logits(ours: Transformer, exported: Path) -> None:
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours.forward_train(ids)
        got = hf_model(exported)(ids).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def assert_same_weights(a: Transformer, b: Transformer) -> None:
    theirs = dict(b.named_weights())
    assert sorted(theirs) == sorted(n for n, _ in a.named_weights())
    for name, value in a.named_weights():
        assert torch.equal(value, theirs[name]), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_gives_our_logits_and_our_loader_our_weights(
    make_checkpoint: Callable[..., Path], tmp_path: Path, case: str
) -> None:
    arch, overrides = CASES[case]
    source = make_checkpoint(arch, **overrides)
    model = moved(load_model(source))
    out = hf_export.export_model(model, tmp_path / "hf", source=source)

    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= files and hf_export.INDEX_FILE not in files
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert config["torch_dtype"] == "float32"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) is not model.config.tie_word_embeddings
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.1.self_attn.k_proj.weight",
    } <= names
    assert ModelConfig.from_pretrained(out) == model.config  # the engine reads back what it ran

    assert_same_logits(model, out)
    assert_same_weights(model, load_model(out))


def test_forced_shards_are_an_index_transformers_and_our_loader_read(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = make_checkpoint("qwen2", tie_word_embeddings=True)
    model = moved(load_model(source))
    out = hf_export.export_model(model, tmp_path / "hf", source=source, max_shard_bytes=60_000)

    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and not (out / "model.safetensors").exists()
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / hf_export.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    on_disk = 0
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            sizes = [f.get_tensor(name).nbytes for name in f.keys()]
            assert all(index["weight_map"][name] == shard for name in f.keys())
        assert sum(sizes) <= 60_000 or len(sizes) == 1  # within the limit, unless one tensor exceeds it
        on_disk += sum(sizes)
    assert index["metadata"]["total_size"] == on_disk
    assert_same_logits(model, out)
    assert_same_weights(model, load_model(out))


def test_shard_plan_closes_a_shard_before_the_limit() -> None:
    sizes = [("a", 40), ("b", 40), ("c", 30), ("d", 200), ("e", 10)]
    assert hf_export.shard_plan(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert hf_export.shard_plan(sizes, 10**9) == [["a", "b", "c", "d", "e"]]
    with pytest.raises(ValueError, match="max_shard_bytes"):
        hf_export.shard_plan(sizes, 0)


def test_tokenizer_files_and_token_ids_come_with_the_export(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = write_tokenizer(
        make_checkpoint("llama", tie_word_embeddings=True, bos_token_id=1, pad_token_id=2)
    )
    model = load_model(source)
    out = hf_export.export_model(model, tmp_path / "hf", source=source, info={"step": 3})

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert json.loads((out / "SOURCE.json").read_text()) == {"step": 3}
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["pad_token_id"]) == (1, 2)
    ours = Tokenizer.from_dir(out)
    assert ours.stop_ids == frozenset({2, 3})

    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(out)
    text = "w5 w17 w33 w159"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text) == [5, 17, 33, 159]
    chat = [{"role": "user", "content": "w9 w8"}]
    rendered = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.render_chat(chat, add_generation_prompt=True) == "<s>w9 w8 </s> "


def test_bf16_export_holds_the_weights_rounded(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    source = make_checkpoint("llama")
    model = moved(load_model(source))
    out = hf_export.export_model(model, tmp_path / "hf", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_model(out)
    assert back.embed_tokens.weight.dtype == torch.bfloat16
    for name, value in model.named_weights():
        assert torch.equal(dict(back.named_weights())[name], value.to(torch.bfloat16)), name


def test_an_existing_directory_is_refused_or_replaced_whole(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    model = load_model(make_checkpoint("llama"))
    out = hf_export.export_model(model, tmp_path / "hf", max_shard_bytes=60_000)
    assert (out / hf_export.INDEX_FILE).is_file()
    with pytest.raises(FileExistsError, match="already exists"):
        hf_export.export_model(model, out)
    assert (out / hf_export.INDEX_FILE).is_file()  # untouched by the refusal

    hf_export.export_model(moved(model), out, overwrite=True)
    # One file now: an older export's shards and index would make loaders read stale weights.
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_weights(model, load_model(out))
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging or old directory left behind

    empty = tmp_path / "empty"
    empty.mkdir()
    hf_export.export_model(model, empty)  # an empty directory is fine
    assert (empty / "model.safetensors").is_file()


def test_weights_that_do_not_fit_the_config_are_refused(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    model = load_model(make_checkpoint("llama"))
    weights = dict(model.named_weights())
    config = model.config
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.down\.weight"):
        hf_export.export(
            config, {k: v for k, v in weights.items() if k != "layers.1.mlp.down.weight"}, tmp_path / "a"
        )
    with pytest.raises(ValueError, match=r"unexpected.*extra"):
        hf_export.export(config, {**weights, "extra": torch.zeros(1)}, tmp_path / "b")
    bad = {**weights, "layers.0.attn.qkv.weight": weights["layers.0.attn.qkv.weight"][:-1]}
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.qkv\.weight.*shape"):
        hf_export.export(config, bad, tmp_path / "c")
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_packed_only_model_exports_its_packed_weights(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A rollout's model keeps only oneDNN-packed projections; exporting it must unpack them, not write meta."""
    source = make_checkpoint("llama")
    model = moved(load_model(source))
    reference = {n: w.clone() for n, w in model.named_weights()}
    if model.keep_packed_only() == 0:
        pytest.skip("oneDNN does not run these weights on this host: nothing is packed")
    out = hf_export.export_model(model, tmp_path / "hf")
    back = dict(load_model(out).named_weights())
    for name, value in reference.items():
        assert torch.equal(back[name], value), name


def test_configs_without_an_hf_equivalent_are_refused() -> None:
    base = {k: v for k, v in TINY.items() if k not in ("initializer_range", "eos_token_id", "bos_token_id")}
    config = ModelConfig(model_type="qwen2", head_dim=16, qkv_bias=True, mlp_bias=True, **base)
    with pytest.raises(ValueError, match="qwen2"):
        hf_export.config_dict(config)
