"""Write a policy as a Hugging Face model directory that transformers, vLLM and our own loader all load.

`export(config, weights, out)` takes our parameters (`Transformer.state_dict()` names, fused q/k/v and
gate/up) and writes the layout `hub.pull` writes: config.json (LlamaForCausalLM or Qwen2ForCausalLM),
model.safetensors under HF tensor names, and the tokenizer files copied from `source` (the model the run
started from). Past `max_shard_bytes` the weights go to model-0000k-of-0000n.safetensors with HF's
model.safetensors.index.json. `export_model(model, out)` is the same for a live `Transformer`.

Non-obvious choices:
- The name map is `weights.hf_weight_map`, the loader's own, read backwards: the fused projections are
  split by its row ranges, so what the loader reads is exactly what is written. No Q/K permutation is
  undone here: GGUF's Llama Q/K permutation is already reversed by transformers when `models pull`
  converts, and the loader applies none. A tied head is not written (HF omits it too).
- Tensors are cast and copied one shard at a time: peak memory is the weights plus one shard.
- config.json is rebuilt from `ModelConfig` (what the engine ran), not copied: only the source's token
  ids (bos/pad/unk) are carried over. RoPE is written classic-style (`rope_theta`, `rope_scaling`).
- The directory is written beside `out` and renamed into place when complete; an existing non-empty
  `out` is refused unless `overwrite` (then replaced whole: no stale shard of an older export remains).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from slipstream.engine.config import ModelConfig, dtype_name
from slipstream.engine.model import Transformer
from slipstream.engine.weights import WeightEntry, hf_weight_map

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "TOKENIZER_FILES",
    "config_dict",
    "export",
    "export_model",
    "shard_plan",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Shard size past which the weights are split (HF's long-standing default, "5GB")."""
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""Files copied from the source model directory when present (what tokenizers and generation read)."""
_TOKEN_ID_KEYS = ("bos_token_id", "pad_token_id", "unk_token_id")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def config_dict(
    config: ModelConfig, *, dtype: torch.dtype | None = None, source: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The HF config.json for `config` with weights in `dtype` (default: the config's); `source` is the
    origin's parsed config.json, of which only the bos/pad/unk token ids are kept."""
    if config.model_type == "qwen2" and (config.o_bias or config.mlp_bias):
        raise ValueError("a qwen2 model with o_proj or mlp biases has no Qwen2ForCausalLM equivalent")
    if config.model_type == "llama" and config.qkv_bias != config.o_bias:
        raise ValueError(
            "a llama model with q/k/v bias but no o_proj bias has no LlamaForCausalLM equivalent"
        )
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else config.rope_scaling.hf_dict(),
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": dtype_name(dtype or config.dtype),
    }
    if config.model_type == "llama":
        out |= {"attention_bias": config.o_bias, "mlp_bias": config.mlp_bias}
    else:  # Qwen2: bias on q/k/v is built in, not a field
        out |= {"use_sliding_window": False}
    if config.eos_token_ids:
        eos = list(config.eos_token_ids)
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    for key in _TOKEN_ID_KEYS:
        if source is not None and source.get(key) is not None:
            out[key] = source[key]
    return out


def shard_plan(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Names grouped into shards in order: a shard closes before the tensor that would take it past
    `max_shard_bytes` (a tensor larger than that gets a shard of its own)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def export(
    config: ModelConfig,
    weights: Mapping[str, Tensor],
    out: str | os.PathLike[str],
    *,
    source: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    info: Mapping[str, Any] | None = None,
) -> Path:
    """Write `weights` (our parameter names, any device) as an HF model directory at `out`; returns it.

    source: the model directory the weights started from (its tokenizer files are copied, its token ids
    kept). dtype: of the written tensors (default: the config's). info: written as SOURCE.json (where
    the weights came from), as `models pull` does.
    """
    out = Path(out)
    dtype = dtype or config.dtype
    entries = _checked_entries(config, weights)
    source_dir = Path(source) if source is not None else None
    source_config = _read_json(source_dir / "config.json") if source_dir is not None else None
    _refuse_existing(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        _write_weights(entries, weights, staging, dtype, max_shard_bytes)
        _write_json(staging / "config.json", config_dict(config, dtype=dtype, source=source_config))
        if source_dir is not None:
            for name in TOKENIZER_FILES:
                if (source_dir / name).is_file():
                    shutil.copyfile(source_dir / name, staging / name)
        if not (staging / "generation_config.json").is_file() and config.eos_token_ids:
            eos = list(config.eos_token_ids)
            _write_json(
                staging / "generation_config.json", {"eos_token_id": eos[0] if len(eos) == 1 else eos}
            )
        if info is not None:
            _write_json(staging / "SOURCE.json", dict(info))
        _publish(staging, out, overwrite)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def export_model(model: Transformer, out: str | os.PathLike[str], **options: Any) -> Path:
    """`export` for a live model (packed-only projections are unpacked); options as `export`'s."""
    return export(model.config, dict(model.named_weights()), out, **options)


def _checked_entries(config: ModelConfig, weights: Mapping[str, Tensor]) -> list[WeightEntry]:
    """The HF tensors to write, after checking `weights` holds exactly the parameters they come from, each
    of the shape the config implies (strict, like the loader: a half-exported policy is worse than none)."""
    entries = hf_weight_map(config)
    expected: dict[str, tuple[int, ...]] = {}
    for e in entries:
        if e.rows is None:
            expected[e.param] = e.shape
        else:  # a fused parameter: its row ranges stack
            rows = max(e.rows[1], expected.get(e.param, (0,))[0])
            expected[e.param] = (rows, *e.shape[1:])
    unknown = sorted(set(weights) - set(expected))
    missing = sorted(set(expected) - set(weights))
    if unknown or missing:
        raise ValueError(
            f"weights do not match a {config.model_type} model of this config: "
            f"missing {missing[:5]}, unexpected {unknown[:5]}"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
    return entries


def _write_weights(
    entries: list[WeightEntry],
    weights: Mapping[str, Tensor],
    out: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
) -> None:
    by_name = {e.hf_name: e for e in entries}
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [(e.hf_name, _numel(e.shape) * itemsize) for e in entries]
    shards = shard_plan(sizes, max_shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for names, file in zip(shards, files, strict=True):
        tensors = {}
        for name in names:
            entry = by_name[name]
            tensor = weights[entry.param].detach()
            if entry.rows is not None:
                tensor = tensor[entry.rows[0] : entry.rows[1]]
            # A copy always: a fused parameter's row slices share storage, which safetensors refuses.
            tensors[name] = tensor.to(device="cpu", dtype=dtype, copy=True).contiguous()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        # safetensors creates its file 0600; give it the umask's default like every other file here.
        (out / file).chmod(0o666 & ~_umask())
        del tensors
    if len(shards) > 1:
        weight_map = {name: file for names, file in zip(shards, files, strict=True) for name in names}
        index = {
            "metadata": {"total_size": sum(n for _, n in sizes)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        _write_json(out / INDEX_FILE, index)


def _refuse_existing(out: Path, overwrite: bool) -> None:
    if overwrite or not out.exists():
        return
    if out.is_dir() and not any(out.iterdir()):
        return
    raise FileExistsError(f"{out} already exists and is not an empty directory")


def _publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished `staging` to `out`; an existing `out` (empty, or any with `overwrite`) goes."""
    old = None
    if out.exists() or out.is_symlink():
        _refuse_existing(out, overwrite)  # again: it may have been filled since the check at the start
        old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        out.rename(old)
    staging.rename(out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return raw


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
