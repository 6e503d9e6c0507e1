"""Export an `EagleHead` as an EAGLE-1 draft model that vLLM and SGLang load, and load it back.

`export` writes `model.safetensors` + `config.json` in the layout of the EAGLE-1 reference checkpoints
(yuhuili/EAGLE-LLaMA3-Instruct-8B and siblings): a one-layer Llama config and the head's tensors under
their Llama names, fused q/k/v and gate/up split apart (the table: docs/engine.md, "EAGLE export layout").
The embedding, final norm and LM head are the target's and are not written; nor is layer 0's input norm
(EAGLE-1 has none). `load` / `load_head` read either variant back, strictly, in the target's dtype (a
bf16 export loads into an fp32 target), from a directory or a shipped drafter's name (`hub.drafter_dir`).

The servers differ in two details, so `server` picks the variant (tensors otherwise equal): "vllm" (the
default) writes `architectures: ["LlamaForCausalLM"]` and no `fc.bias`; "sglang" writes
`["LlamaForCausalLMEagle"]` and a zero `fc.bias`. Optionally `token_counts.json` ({"ids", "counts"}): the
token counts of the head's training data, which `load` primes the draft vocabulary with (servers ignore
it). config.json also carries a `slipstream` block (drafter version, feature convention).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from slipstream.engine import hub
from slipstream.engine.config import ModelConfig, dtype_name
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.eagle import EagleHead
from slipstream.engine.model import Transformer

__all__ = [
    "COUNTS_FILE",
    "config_dict",
    "export",
    "exported_state_dict",
    "load",
    "load_head",
    "load_token_counts",
]

Server = Literal["vllm", "sglang"]
_ARCHITECTURES: dict[str, list[str]] = {"vllm": ["LlamaForCausalLM"], "sglang": ["LlamaForCausalLMEagle"]}


def _slices(config: ModelConfig) -> list[tuple[str, str, int, int]]:
    """(exported name, our parameter, first row, rows): the table in the module docstring."""
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return [
        ("fc.weight", "fc.weight", 0, d),
        ("layers.0.self_attn.q_proj.weight", "layer.attn.qkv.weight", 0, q),
        ("layers.0.self_attn.k_proj.weight", "layer.attn.qkv.weight", q, kv),
        ("layers.0.self_attn.v_proj.weight", "layer.attn.qkv.weight", q + kv, kv),
        ("layers.0.self_attn.o_proj.weight", "layer.attn.o_proj.weight", 0, d),
        ("layers.0.post_attention_layernorm.weight", "layer.post_norm.weight", 0, d),
        ("layers.0.mlp.gate_proj.weight", "layer.mlp.gate_up.weight", 0, inter),
        ("layers.0.mlp.up_proj.weight", "layer.mlp.gate_up.weight", inter, inter),
        ("layers.0.mlp.down_proj.weight", "layer.mlp.down.weight", 0, d),
    ]


COUNTS_FILE = "token_counts.json"


def exported_state_dict(
    head: EagleHead, *, server: Server = "vllm", dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The head's tensors under EAGLE-1 names (contiguous copies, in `dtype` or the head's)."""
    if server not in _ARCHITECTURES:
        raise ValueError(f"server must be one of {sorted(_ARCHITECTURES)}, got {server!r}")
    params = {name: p.detach() for name, p in head.named_parameters()}
    out = {
        name: params[ours][start : start + rows].to(dtype or params[ours].dtype).contiguous().clone()
        for name, ours, start, rows in _slices(head.config)
    }
    if server == "sglang":
        out["fc.bias"] = torch.zeros(head.config.hidden_size, dtype=out["fc.weight"].dtype)
    return out


def config_dict(
    head: EagleHead,
    target_config: ModelConfig,
    *,
    server: Server = "vllm",
    version: int = 0,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """config.json of the exported draft model (a one-layer Llama config; see the module docstring)."""
    config = head.config
    if config.hidden_size != target_config.hidden_size or config.vocab_size != target_config.vocab_size:
        raise ValueError("the head's hidden_size and vocab_size must equal the target's")
    rope_scaling = None if config.rope_scaling is None else config.rope_scaling.hf_dict()
    torch_dtype = dtype_name(dtype or head.fc.weight.dtype)
    return {
        "architectures": list(_ARCHITECTURES[server]),
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": target_config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bias": server == "sglang",
        "torch_dtype": torch_dtype,
        "slipstream": {
            "drafter_version": version,
            "features": "target last-layer state after the target's final norm",
            "target_model_type": target_config.model_type,
        },
    }


def export(
    head: EagleHead,
    target_config: ModelConfig,
    out_dir: str | Path,
    *,
    server: Server = "vllm",
    version: int = 0,
    dtype: torch.dtype | None = None,
    token_counts: Mapping[int, int] | None = None,
) -> Path:
    """Write model.safetensors + config.json (+ token_counts.json when given) to out_dir (created if
    needed); returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = config_dict(head, target_config, server=server, version=version, dtype=dtype)
    tensors = exported_state_dict(head, server=server, dtype=dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if token_counts:
        ids = sorted(token_counts, key=lambda t: (-token_counts[t], t))
        body = {"ids": ids, "counts": [int(token_counts[t]) for t in ids]}
        (out / COUNTS_FILE).write_text(json.dumps(body) + "\n")
    return out


def load_token_counts(path: str | Path) -> dict[int, int]:
    """The token counts exported with a head (a directory or a shipped drafter's name; {} when it has
    none); a malformed file raises, naming it."""
    file = hub.drafter_dir(path) / COUNTS_FILE
    if not file.is_file():
        return {}
    try:
        body = json.loads(file.read_text())
        ids, counts = body["ids"], body["counts"]
        if len(ids) != len(counts) or not all(isinstance(x, int) and x >= 0 for x in [*ids, *counts]):
            raise ValueError("ids and counts must be equally long lists of non-negative integers")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: {e}") from None
    return dict(zip(ids, counts, strict=True))


def load(path: str | Path, target: Transformer, **drafter_kwargs: Any) -> EagleDrafter:
    """An `EagleDrafter` for `target` from an exported directory (either server variant) or a shipped
    drafter's name, in the target's dtype and on its device; drafter_kwargs go to `EagleDrafter`
    (num_slots, max_len). Strict: every tensor must be known."""
    head, version = load_head(path, target)
    drafter = EagleDrafter(head, target, version=version, **drafter_kwargs)
    drafter.prime_counts(load_token_counts(path))
    return drafter


def load_head(path: str | Path, target: Transformer) -> tuple[EagleHead, int]:
    """(the exported head in the target's dtype, on its device; its drafter version): `load` without a
    drafter's cache."""
    path = hub.drafter_dir(path)
    raw = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    if config.num_hidden_layers != 1:
        raise ValueError(f"{path}: an EAGLE head has one layer, config says {config.num_hidden_layers}")
    if config.hidden_size != target.config.hidden_size or config.vocab_size != target.config.vocab_size:
        raise ValueError(f"{path}: hidden_size/vocab_size differ from the target's")
    tensors = load_file(str(path / "model.safetensors"))
    bias = tensors.pop("fc.bias", None)
    if bias is not None and bool(bias.ne(0).any()):
        raise ValueError(f"{path}: fc.bias is non-zero; this head has no fc bias")
    weight = target.lm_head_weight
    head = EagleHead(config).to(device=weight.device, dtype=weight.dtype)
    weights = _our_weights(head, tensors, str(path))
    head.load_state_dict(weights)
    return head, int(raw.get("slipstream", {}).get("drafter_version", 0))


def _our_weights(head: EagleHead, tensors: Mapping[str, Tensor], source: str) -> dict[str, Tensor]:
    slices = _slices(head.config)
    known = {name for name, _, _, _ in slices}
    unknown, missing = sorted(set(tensors) - known), sorted(known - set(tensors))
    if unknown or missing:
        raise ValueError(f"{source}: unknown tensors {unknown}, missing tensors {missing}")
    ours = {name: torch.empty_like(p.detach()) for name, p in head.named_parameters()}
    for name, param, start, rows in slices:
        tensor = tensors[name]
        expected = (rows, *ours[param].shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)}, expected {expected}")
        ours[param][start : start + rows] = tensor
    return ours
