"""Model configuration for the Llama/Qwen2 family, read from a Hugging Face `config.json`.

`ModelConfig` is the only shape description the engine uses; the model, the loader and the KV cache are
all built from it. It accepts both config generations seen in the wild: transformers ≤ 4 (`rope_theta` +
`rope_scaling`, `torch_dtype`) and transformers ≥ 5 (`rope_parameters`, `dtype`). Anything the engine
cannot run exactly (an unknown architecture, sliding-window attention, an unsupported RoPE variant) is
refused with an error naming the field, rather than run subtly wrong: a rollout whose log-probs disagree
with the learner's is worse than one that does not start.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Config and checkpoint dtype names (HF's `torch_dtype`, actor configs), aliases included; `dtype_from_name`
# is the one lookup. (runtime/codec.py keeps the wire's own table: the runtime may not import the engine.)
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How RoPE frequencies are stretched beyond the pre-training context."""

    rope_type: str
    """"linear" (all frequencies divided by `factor`) or "llama3" (low frequencies only, smoothly)."""
    factor: float
    """Context stretch factor."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are untouched."""
    original_max_position_embeddings: int = 8192
    """llama3: the pre-training context length."""

    def hf_dict(self) -> dict[str, Any]:
        """As an HF config.json's `rope_scaling` (what the exports write)."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out |= {
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
            }
        return out


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of one Llama- or Qwen2-family decoder."""

    model_type: str
    """"llama" or "qwen2"."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """SwiGLU inner width."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA: divides num_attention_heads)."""
    head_dim: int
    """Width of one head (hidden_size // num_attention_heads unless the config says otherwise)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: RopeScaling | None = None
    """RoPE context extension, None for plain RoPE."""
    max_position_embeddings: int = 2048
    """Context length the model was trained for (the RoPE table is built lazily, so this is no limit)."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix."""
    qkv_bias: bool = False
    """Bias on the q, k and v projections (Qwen2; Llama with attention_bias)."""
    o_bias: bool = False
    """Bias on the output projection (Llama with attention_bias)."""
    mlp_bias: bool = False
    """Bias on gate, up and down projections (Llama with mlp_bias)."""
    torch_dtype: str = "float32"
    """Checkpoint dtype name; the default dtype the loader builds the model in."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids from the config, the generator's default stop ids."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config field 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"config field 'head_dim' must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(
                f"config field 'rms_norm_eps' must be a positive number, got {self.rms_norm_eps!r}"
            )
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"config field 'rope_theta' must be a positive number, got {self.rope_theta!r}")
        dtype_from_name(self.torch_dtype, field="config field 'torch_dtype'")

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint dtype as a torch dtype."""
        return dtype_from_name(self.torch_dtype)

    @property
    def queries_per_kv(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.json, naming the field on any missing or malformed value."""
        if "model_type" not in raw:
            raise ValueError("config is missing field 'model_type'")
        model_type = raw["model_type"]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config field 'hidden_act' must be 'silu' (SwiGLU), got {hidden_act!r}")
        if raw.get("use_sliding_window", False):
            raise ValueError(
                "config field 'use_sliding_window' is true: sliding-window attention is not supported"
            )

        def need(name: str) -> Any:
            if raw.get(name) is None:
                raise ValueError(f"config is missing field {name!r}")
            return raw[name]

        hidden = _as_int("hidden_size", need("hidden_size"))
        heads = _as_int("num_attention_heads", need("num_attention_heads"))
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"config field 'head_dim' is absent and hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {heads}"
                )
            head_dim = hidden // heads
        rope_theta, rope_scaling = _parse_rope(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=_as_int("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=_as_int("intermediate_size", need("intermediate_size")),
            num_hidden_layers=_as_int("num_hidden_layers", need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=_as_int("num_key_value_heads", raw.get("num_key_value_heads") or heads),
            head_dim=_as_int("head_dim", head_dim),
            rms_norm_eps=_as_float("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_as_int(
                "max_position_embeddings", raw.get("max_position_embeddings", 2048)
            ),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes bias on q/k/v only; Llama's attention_bias puts it on all four projections.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=_parse_dtype(raw),
            eos_token_ids=_parse_eos(raw.get("eos_token_id")),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a model directory (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{file} is not valid JSON: {err}") from err
        if not isinstance(raw, dict):
            raise ValueError(f"{file} must hold a JSON object")
        return cls.from_dict(raw)


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    params = raw.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        field = "rope_scaling"
        if "rope_theta" in raw:
            params["rope_theta"] = raw["rope_theta"]
    if not isinstance(params, dict):
        raise ValueError(f"config field {field!r} must be an object, got {params!r}")
    theta = _as_float(f"{field}.rope_theta", params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config field '{field}.rope_type' {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"config field '{field}.factor' is required for rope_type {rope_type!r}")
    factor = _as_float(f"{field}.factor", params["factor"])
    if factor <= 0:
        raise ValueError(f"config field '{field}.factor' must be positive, got {factor}")
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=factor)
    for name in ("low_freq_factor", "high_freq_factor"):
        if name not in params:
            raise ValueError(f"config field '{field}.{name}' is required for rope_type 'llama3'")
    low = _as_float(f"{field}.low_freq_factor", params["low_freq_factor"])
    high = _as_float(f"{field}.high_freq_factor", params["high_freq_factor"])
    if not high > low:
        raise ValueError(
            f"config field '{field}.high_freq_factor' ({high}) must exceed low_freq_factor ({low})"
        )
    original = params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    if original is None:
        raise ValueError(f"config field '{field}.original_max_position_embeddings' is required for llama3")
    return theta, RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=_as_int(f"{field}.original_max_position_embeddings", original),
    )


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config field {name!r} must be an integer, got {value!r}")
    return value


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"config field {name!r} must be a number, got {value!r}")
    return float(value)


def _parse_dtype(raw: dict[str, Any]) -> str:
    name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    dtype_from_name(name, field="config field 'torch_dtype'")
    return name.removeprefix("torch.")


def _parse_eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(
            f"config field 'eos_token_id' must be an integer or a list of integers, got {value!r}"
        )
    return tuple(ids)


def dtype_from_name(name: str, *, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a config or checkpoint dtype name ("bfloat16", "float32", "torch.float16", "half",
    ...); ValueError naming `field` for anything else."""
    key = name.removeprefix("torch.") if isinstance(name, str) else None
    if key not in _DTYPES:
        raise ValueError(f"{field} {name!r} is not one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """The config name of a torch dtype ("bfloat16"): what a config.json's `torch_dtype` holds."""
    name = str(dtype).removeprefix("torch.")
    dtype_from_name(name)
    return name
