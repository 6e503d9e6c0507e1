"""`engine.warmup.warmup` end to end on a tiny random Llama: a bf16 export, evals of the export as loaded
(the head a user gets), and the summary's fields, keyed chains at the demo's depth 3 included."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from slipstream.engine import eagle_export
from slipstream.engine.warmup import warmup
from slipstream.engine.weights import load_model


def test_a_bf16_warmup_exports_and_measures_the_export(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    target = load_model(make_checkpoint("llama"))
    prompts = [[5 + i, 17, 30 + i] for i in range(6)]
    summary = warmup(
        target, prompts[:4], prompts[4:], eos=[], steps=2, out=tmp_path, max_tokens=8, temperature=0.8,
        batch_tokens=64, export_dtype=torch.bfloat16,
    )  # fmt: skip
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    head, version = eagle_export.load_head(tmp_path, target)
    assert version == 2 and {p.dtype for p in head.parameters()} == {torch.float32}
    assert summary["dtype"] == "bfloat16" and summary["samples"] == 4 and summary["eval_samples"] == 2
    keyed = {k for k in summary["accept_length"] if k.endswith("_keyed")}
    assert keyed == {"t0.8_chain3_keyed", "t0.8_chain5_keyed", "t0.8_chain7_keyed"}
    assert all(value >= 1.0 for value in summary["accept_length"].values())
    assert (tmp_path / "warmup.json").is_file() and eagle_export.load_token_counts(tmp_path)
