"""`slipstream bench gpu`: refused at once without CUDA; its measuring functions run on every device.

The runbook's functions take the device, so the CPU suite runs on tiny shapes exactly what a GPU session
runs on real ones (the cuda case is gpu-marked and skipped here with the reason).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from slipstream.benchmarks import decode, gpu, gpu_costs

TINY_QWEN = {
    **gpu.SHAPES["qwen2.5-1.5b"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_bench_gpu_exits_at_once_naming_the_missing_device() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "slipstream.cli.main", "bench", "gpu", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "'cuda' is not available" in done.stderr and "no CUDA device" in done.stderr
    assert done.stdout == ""  # no half-made JSON
    assert time.monotonic() - started < 30  # at once: no model was built, nothing measured


def test_shapes_are_real_model_layouts() -> None:
    # The published parameter counts of Qwen2.5-1.5B and -7B, from the shapes' fields alone.
    counts = {name: _count(shape) for name, shape in gpu.SHAPES.items()}
    assert counts == {
        "qwen2.5-1.5b": pytest.approx(1.54e9, rel=0.01),
        "qwen2.5-7b": pytest.approx(7.62e9, rel=0.01),
    }


def _count(shape: dict[str, int]) -> int:
    """Parameters of a Qwen2 shape from its config fields (biases on q, k, v)."""
    d, ff, layers, vocab = (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_hidden_layers"],
        shape["vocab_size"],
    )
    hd = d // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    attn = d * d + 2 * d * kv + d + 2 * kv + d * d
    per_layer = attn + 3 * d * ff + 2 * d
    head = 0 if shape["tie_word_embeddings"] else vocab * d
    return layers * per_layer + vocab * d + head + d


def test_bench_shape_measures_plain_peer_verify_and_self_draft(device: torch.device) -> None:
    torch.manual_seed(0)
    row = gpu.bench_shape(
        "tiny", TINY_QWEN, device, dtype=torch.float32, batches=(1, 3), prompt_tokens=8, max_tokens=24,
        context=16, peer_batches=(3,), eager_batches=(1,), static=True, say=lambda _: None,
    )  # fmt: skip
    assert [r.batch for r in row.rows] == [1, 3]
    for r in row.rows:
        assert r.plain_tok_s > 0 and r.step_ms > 0 and r.host_ms > 0
        assert (r.hf_tok_s is not None) == (r.batch == 3) and (r.eager_tok_s is not None) == (r.batch == 1)
        assert set(r.verify_cost) == {"1", "3", "7"} and all(v > 0 for v in r.verify_cost.values())
        assert set(r.draft_cost) == {"3", "7"} and all(v > 0 for v in r.draft_cost.values())
        # The self-draft oracle replays the plain run: every draft is accepted, so a pass commits d + 1
        # tokens until the end of the response (the last pass may be shorter).
        assert r.self_accept["d3"] > 3.0 and r.self_accept["d7"] >= 5.0
    assert row.params_m > 0 and (row.roofline_b1 is None) == (device.type != "cuda")


def test_step_costs_time_the_fixed_shape_step(device: torch.device) -> None:
    model = gpu.random_model(TINY_QWEN, device, torch.float32)
    step_ms, host_ms, cost = gpu_costs.step_costs(model, batch=2, context=10, ks=(1, 3), repeats=2)
    assert step_ms > 0 and host_ms > 0 and set(cost) == {"1", "3"} and all(v > 0 for v in cost.values())


def test_draft_costs_time_the_eagle_rounds(device: torch.device) -> None:
    model = gpu.random_model(TINY_QWEN, device, torch.float32)
    costs = gpu_costs.draft_costs(model, batch=3, context=10, plain_ms=1.0, ks=(1, 3), repeats=2)
    assert set(costs) == {"1", "3"} and all(v > 0 for v in costs.values())


def test_hbm_bandwidth_by_part() -> None:
    assert gpu.hbm_bandwidth("NVIDIA H200") == 4.8 and gpu.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35
    assert gpu.hbm_bandwidth("NVIDIA A10") is None


def test_random_model_is_reproducible_and_on_its_device(device: torch.device) -> None:
    a = gpu.random_model(TINY_QWEN, device, torch.float32, seed=3)
    b = gpu.random_model(TINY_QWEN, device, torch.float32, seed=3)
    assert all(p.device.type == device.type for p in a.parameters())
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert torch.equal(a.final_norm.weight, torch.full_like(a.final_norm.weight, gpu.PEAK))
    assert torch.equal(a.layers[0].input_norm.weight, torch.ones_like(a.layers[0].input_norm.weight))


def test_every_request_of_a_row_decodes_at_once() -> None:
    """A row's batch is the batch decoded: not waves of Generator.for_requests' default 32 (the rows from
    batch 64 up measured 32 at a time until 2026-11-26)."""
    model = gpu.random_model(TINY_QWEN, torch.device("cpu"), torch.float32)
    requests = decode.bench_requests([[1, 2, 3]] * 40, max_tokens=2)
    for arm in decode.ARMS[:2]:
        gen = decode._generator(model, requests, arm, {r.request_id: [1, 2, 3, 4, 5] for r in requests})
        for request in requests:
            gen.add(request)
        gen.step()  # admits and prefills everyone that fits
        assert gen.num_decoding == 40, arm
