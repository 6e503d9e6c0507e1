"""Export an `EagleHead` as an EAGLE-1 draft model that vLLM and SGLang load, and load it back.

`export` writes `model.safetensors` + `config.json` in the layout of the EAGLE-1 reference checkpoints
(yuhuili/EAGLE-LLaMA3-Instruct-8B and siblings): a one-layer Llama config and these tensors —

    ours (EagleHead.state_dict)             exported                                    shape
    fc.weight                               fc.weight                                   [d, 2d]
    layer.attn.qkv.weight  rows [0, H·hd)   layers.0.self_attn.q_proj.weight           [H·hd, d]
                           next K·hd rows   layers.0.self_attn.k_proj.weight            [K·hd, d]
                           last K·hd rows   layers.0.self_attn.v_proj.weight            [K·hd, d]
    layer.attn.o_proj.weight                layers.0.self_attn.o_proj.weight            [d, H·hd]
    layer.post_norm.weight                  layers.0.post_attention_layernorm.weight    [d]
    layer.mlp.gate_up.weight rows [0, I)    layers.0.mlp.gate_proj.weight               [I, d]
                             rows [I, 2I)   layers.0.mlp.up_proj.weight                 [I, d]
    layer.mlp.down.weight                   layers.0.mlp.down_proj.weight               [d, I]
    (none)                                  fc.bias, zeros — server="sglang" only       [d]

(H query heads, K key/value heads, hd head_dim, I intermediate_size.) Not written, on purpose: the
embedding, final norm and LM head are the target's (both servers share the target's embedding and LM head
with an EAGLE-1 draft when the checkpoint has none), and `layers.0.input_layernorm.weight` (layer 0 has
no input norm in EAGLE-1; vLLM's and SGLang's `LlamaDecoderLayer` for EAGLE replace it with an identity).

How the servers run it, which is what `eagle.py` computes (sources: vLLM
`model_executor/models/llama_eagle.py`, `transformers_utils/configs/eagle.py` and `models/registry.py`;
SGLang `srt/models/llama_eagle.py`; EAGLE `eagle/model/ea_model.py`): hidden = fc(cat(embed(token),
target_feature)) → layer 0 without input norm → residual added, no final norm → the target's LM head;
the target features are the target's post-final-norm last-layer states.

The two servers disagree on two details, so `server` picks the variant (the tensors are otherwise equal):
- vLLM (default): `architectures: ["LlamaForCausalLM"]`, which vLLM's EAGLEConfig renames to its
  `EagleLlamaForCausalLM` for method "eagle"; no `fc.bias` — that model's fc has no bias and its loader
  fails on an unknown tensor.
- SGLang: `architectures: ["LlamaForCausalLMEagle"]` (SGLang's EAGLE-1 class); a zero `fc.bias`, since
  that class's fc always has a bias and would otherwise keep its random initialisation (sglang#5773).

Optionally, `token_counts.json` ({"ids": [...], "counts": [...]}): how often each token occurs in the
head's training data. Servers ignore it; `load` primes the drafter's draft vocabulary with it (the tokens
a draft may use; see `EagleDrafter`), so a fresh rollout drafts the task's tokens from its first step.

config.json carries the Llama fields both need (hidden_size, intermediate_size, num_hidden_layers = 1,
num_attention_heads, num_key_value_heads, head_dim, hidden_act, rms_norm_eps, rope_theta, rope_scaling,
max_position_embeddings, vocab_size, tie_word_embeddings, attention_bias, mlp_bias, torch_dtype), the
EAGLE reference's fc-bias flag `bias`, and a `slipstream` block (drafter version, feature convention).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from slipstream.engine.config import ModelConfig
from slipstream.engine.eagle import EagleDrafter, EagleHead
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
    rope_scaling = None
    if config.rope_scaling is not None:
        scaling = config.rope_scaling
        rope_scaling = {"rope_type": scaling.rope_type, "factor": scaling.factor}
        if scaling.rope_type == "llama3":
            rope_scaling |= {
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings,
            }
    dtype_name = str(dtype or head.fc.weight.dtype).removeprefix("torch.")
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
        "torch_dtype": dtype_name,
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
    """The token counts exported with a head ({} when it has none); a malformed file raises, naming it."""
    file = Path(path) / COUNTS_FILE
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
    """An `EagleDrafter` for `target` from an exported directory (either server variant), in the target's
    dtype; drafter_kwargs go to `EagleDrafter` (num_slots, max_len). Strict: every tensor must be known."""
    head, version = load_head(path, target)
    drafter = EagleDrafter(head, target, version=version, **drafter_kwargs)
    drafter.prime_counts(load_token_counts(path))
    return drafter


def load_head(path: str | Path, target: Transformer) -> tuple[EagleHead, int]:
    """(the exported head in the target's dtype, its drafter version): `load` without a drafter's cache."""
    path = Path(path)
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
    dtype = target.lm_head_weight.dtype
    head = EagleHead(config).to(dtype)
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
