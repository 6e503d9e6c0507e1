"""engine/device.py: the one attention entry point every engine module uses, on each device kind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from slipstream.engine import device as engine_device
from slipstream.engine.device import CUDA_SDPA_BACKENDS, sdpa

ENGINE = Path(engine_device.__file__).resolve().parent


def test_cuda_attention_leaves_out_cudnn_only() -> None:
    # cuDNN's backend rebuilds a graph for each new shape (docs/gpu.md); the others stay allowed.
    assert SDPBackend.CUDNN_ATTENTION not in CUDA_SDPA_BACKENDS
    assert {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH} <= set(
        CUDA_SDPA_BACKENDS
    )


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_torch(device: torch.device, causal: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen).to(device) for _ in range(3))
    mask = None if causal else (torch.rand(5, 5, generator=gen) > 0.3).fill_diagonal_(True).to(device)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask, is_causal=causal), expected)


def test_no_engine_module_calls_torch_attention_directly() -> None:
    # One entry point: an attention call that bypasses `sdpa` would take cuDNN's backend on CUDA again.
    direct = []
    for path in sorted(ENGINE.rglob("*.py")):
        if path.name == "device.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "scaled_dot_product_attention":
                direct.append(f"{path.name}:{node.lineno}")
    assert direct == [], f"call engine.device.sdpa instead: {direct}"
