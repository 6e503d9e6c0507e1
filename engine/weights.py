"""Load Hugging Face Llama/Qwen2 checkpoints (config.json + safetensors, single or sharded) into `Transformer`.

The checkpoint's per-projection tensors (q_proj, k_proj, v_proj; gate_proj, up_proj) land in row ranges
of our fused projections, so the map from HF names is explicit: `hf_weight_map(config)` lists every
tensor with its destination parameter, row range and expected shape, and both directions (`load_model`,
`hf_state_dict`) use it. Loading is strict: a missing tensor, a tensor we do not know, or a shape
mismatch is an error naming it — a silently half-loaded policy would train on garbage. The model is built
on the meta device first, so no time or memory goes into random initialisation that is overwritten.
`load_head_parts` reads only the embedding, final norm and LM head (all a drafter uses of its target):
the decoder layers are neither allocated nor read, so a drafter does not hold a second copy of the policy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from slipstream.engine.config import ModelConfig
from slipstream.engine.model import Transformer

# Present in some checkpoints, derived from the config here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightEntry:
    """Where one HF tensor lives in our module."""

    hf_name: str
    param: str
    """Our parameter's name in `Transformer.state_dict()`."""
    rows: tuple[int, int] | None
    """Row range [start, stop) inside a fused parameter, None for the whole parameter."""
    shape: tuple[int, ...]
    """Expected shape of the HF tensor."""


def hf_weight_map(config: ModelConfig) -> list[WeightEntry]:
    """Every tensor a checkpoint for `config` must hold, in a stable order."""
    hidden = config.hidden_size
    entries = [
        WeightEntry("model.embed_tokens.weight", "embed_tokens.weight", None, (config.vocab_size, hidden))
    ]
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        entries += _attention_entries(config, hf, ours) + _mlp_entries(config, hf, ours)
    entries.append(WeightEntry("model.norm.weight", "final_norm.weight", None, (hidden,)))
    if not config.tie_word_embeddings:
        entries.append(WeightEntry("lm_head.weight", "lm_head.weight", None, (config.vocab_size, hidden)))
    return entries


def _attention_entries(config: ModelConfig, hf: str, ours: str) -> list[WeightEntry]:
    """A layer's input norm and attention: q, k and v (and their biases) in row ranges of our fused qkv."""
    hidden = config.hidden_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    qkv_parts = (
        ("q_proj", 0, q_rows),
        ("k_proj", q_rows, kv_rows),
        ("v_proj", q_rows + kv_rows, kv_rows),
    )
    entries = [WeightEntry(f"{hf}.input_layernorm.weight", f"{ours}.input_norm.weight", None, (hidden,))]
    for name, start, rows in qkv_parts:
        entries.append(
            WeightEntry(
                f"{hf}.self_attn.{name}.weight",
                f"{ours}.attn.qkv.weight",
                (start, start + rows),
                (rows, hidden),
            )
        )
        if config.qkv_bias:
            entries.append(
                WeightEntry(
                    f"{hf}.self_attn.{name}.bias", f"{ours}.attn.qkv.bias", (start, start + rows), (rows,)
                )
            )
    entries.append(
        WeightEntry(f"{hf}.self_attn.o_proj.weight", f"{ours}.attn.o_proj.weight", None, (hidden, q_rows))
    )
    if config.o_bias:
        entries.append(
            WeightEntry(f"{hf}.self_attn.o_proj.bias", f"{ours}.attn.o_proj.bias", None, (hidden,))
        )
    return entries


def _mlp_entries(config: ModelConfig, hf: str, ours: str) -> list[WeightEntry]:
    """A layer's post-attention norm and MLP: gate and up (and their biases) in row ranges of our fused
    gate_up, then down."""
    hidden, inter = config.hidden_size, config.intermediate_size
    entries = [
        WeightEntry(f"{hf}.post_attention_layernorm.weight", f"{ours}.post_norm.weight", None, (hidden,))
    ]
    for name, start in (("gate_proj", 0), ("up_proj", inter)):
        entries.append(
            WeightEntry(
                f"{hf}.mlp.{name}.weight",
                f"{ours}.mlp.gate_up.weight",
                (start, start + inter),
                (inter, hidden),
            )
        )
        if config.mlp_bias:
            entries.append(
                WeightEntry(
                    f"{hf}.mlp.{name}.bias", f"{ours}.mlp.gate_up.bias", (start, start + inter), (inter,)
                )
            )
    entries.append(
        WeightEntry(f"{hf}.mlp.down_proj.weight", f"{ours}.mlp.down.weight", None, (hidden, inter))
    )
    if config.mlp_bias:
        entries.append(WeightEntry(f"{hf}.mlp.down_proj.bias", f"{ours}.mlp.down.bias", None, (hidden,)))
    return entries


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory: model.safetensors, or the shards its index names."""
    path = Path(path)
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index} has no valid 'weight_map': {err}") from err
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file.name} named by {index.name} is missing from {path}")
        return files
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_hf_tensors(
    model: Transformer, tensors: Iterable[tuple[str, Tensor]], *, source: str = "checkpoint"
) -> None:
    """Copy HF-named tensors into `model` (casting to its dtype); every expected tensor must appear once."""
    params = dict(model.named_parameters())
    # Only the model's own parameters: a `load_head_parts` model has no layers to fill.
    entries = {e.hf_name: e for e in hf_weight_map(model.config) if e.param in params}
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in tensors:
            entry = entries.get(name)
            if entry is None:
                if name.endswith(_IGNORED_SUFFIXES) or (
                    name == "lm_head.weight" and model.config.tie_word_embeddings
                ):
                    continue  # tied checkpoints sometimes store the head anyway; the embedding is the truth
                raise ValueError(
                    f"{source}: unexpected tensor {name!r} for a {model.config.model_type} model"
                )
            if tuple(tensor.shape) != entry.shape:
                raise ValueError(
                    f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {entry.shape}"
                )
            if name in seen:
                raise ValueError(f"{source}: tensor {name!r} appears twice")
            target = params[entry.param]
            if entry.rows is not None:
                target = target[entry.rows[0] : entry.rows[1]]
            target.copy_(tensor)
            seen.add(name)
    missing = [name for name in entries if name not in seen]
    if missing:
        listed = ", ".join(repr(name) for name in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{source}: missing tensor {listed}{more}")


def load_model(
    path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> Transformer:
    """Build a `Transformer` from a local HF model directory; dtype defaults to the config's."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype or config.dtype).to_empty(device=device)
    load_hf_tensors(model, _read_tensors(checkpoint_files(path)), source=str(path))
    return model.eval()


HEAD_PARTS = ("embed_tokens.weight", "final_norm.weight", "lm_head.weight")
"""The parameters `load_head_parts` holds (lm_head only for untied models)."""


class _HeadParts(Transformer):
    """A `Transformer` holding only HEAD_PARTS: its layers were never built, so it cannot run."""

    def forward(self, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        # Without layers a forward pass would be embed → head: plausible logits, silently wrong.
        raise RuntimeError("a model from load_head_parts has no decoder layers; use load_model to run it")

    forward_train = forward  # type: ignore[assignment]


def load_head_parts(
    path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> Transformer:
    """The embedding, final norm and LM head of a checkpoint, as a `Transformer` without decoder layers.

    What a drafter needs of its target (`eagle.py`): `config` still describes the whole model, but
    `layers` is empty and their tensors are never read (nor their memory allocated), and running the
    model raises. Strict like `load_model` for the tensors it reads.
    """
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = _HeadParts(config)
    model.layers = torch.nn.ModuleList()
    model = model.to(dtype or config.dtype).to_empty(device=device)
    wanted = {e.hf_name for e in hf_weight_map(config) if e.param in HEAD_PARTS}
    load_hf_tensors(model, _read_tensors(checkpoint_files(path), wanted), source=str(path))
    return model.eval()


def _read_tensors(files: Iterable[Path], names: set[str] | None = None) -> Iterable[tuple[str, Tensor]]:
    """(name, tensor) of every tensor in `files`, or only of `names`: the others are never read."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if names is None or name in names:
                    yield name, handle.get_tensor(name)


def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """The model's weights under HF names (the fused projections split back), for export and round trips."""
    params = dict(model.named_parameters())
    out = {}
    for entry in hf_weight_map(model.config):
        tensor = params[entry.param].detach()
        out[entry.hf_name] = tensor if entry.rows is None else tensor[entry.rows[0] : entry.rows[1]]
    return out
