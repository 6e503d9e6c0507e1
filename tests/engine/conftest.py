"""Tiny random Llama/Qwen2 checkpoints written by transformers into a temp dir (never downloaded).

`make_checkpoint(arch, shards=..., **config)` returns a directory holding config.json and
model.safetensors (or shards + model.safetensors.index.json when `shards` > 1). The weights use a larger
init scale than HF's default (0.02) so logits are far from uniform: greedy argmax then has clear
margins, and parity tests compare logits that actually vary.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

torch.set_num_threads(1)

TINY = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.15,
    "eos_token_id": None,
    "bos_token_id": None,
}


def build_checkpoint(
    path: Path, arch: str = "llama", *, shards: int = 1, seed: int = 0, **overrides: Any
) -> Path:
    """Write a tiny random HF checkpoint for `arch` ("llama" or "qwen2") to `path` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        # HF initialises norms to one and biases to zero; randomise them so their loading is tested too.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    path.mkdir(parents=True, exist_ok=True)
    if shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(path, max_shard_size=max(1, total // shards))
    else:
        model.save_pretrained(path)
    return path


def build_chat_checkpoint(path: Path, **overrides: Any) -> Path:
    """`build_checkpoint` with SmolLM2's vocabulary, tokenizer and chat template (its EOS, id 2): a tiny
    random decoder that real prompts and turns go through."""
    from slipstream.engine import hub

    smol = hub.pull("smollm2-135m")
    vocab = json.loads((smol / "config.json").read_text())["vocab_size"]
    build_checkpoint(path, vocab_size=vocab, eos_token_id=2, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(smol / name, path / name)
    return path


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: every call writes a fresh checkpoint directory (tests may edit theirs)."""

    def make(arch: str = "llama", *, shards: int = 1, seed: int = 0, **overrides: Any) -> Path:
        path = tmp_path_factory.mktemp(f"{arch}-ckpt")
        return build_checkpoint(path, arch, shards=shards, seed=seed, **overrides)

    return make
