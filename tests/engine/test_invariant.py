"""engine/invariant.py: batch-invariant inference kernels. A row's result must be the same bits whatever
else shares the call — the linear at any number of rows, and attention's node 0 in a verify pass of n nodes
as in a plain pass — and agree with the ordinary kernels to rounding.

The kernels run under Triton's interpreter in one subprocess (TRITON_INTERPRET=1 must be set before triton
is imported); this file run as a script prints the checks as JSON. fp32 there (the interpreter computes
bf16 wrong on these hosts); the bf16 proof on a GPU, over a whole fixed-shape step, is the gpu test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slipstream.engine import invariant


def _checks() -> dict:
    """Under TRITON_INTERPRET=1 and SLIPSTREAM_BATCH_INVARIANT=1: the invariance and accuracy checks."""
    from slipstream.engine.attention import paged_attention, paged_attention_ref

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    out: dict = {"enabled": invariant.enabled()}
    x = torch.randn(9, 100, generator=gen)
    w, b = torch.randn(70, 100, generator=gen), torch.randn(70, generator=gen)
    assert invariant.active(x, w)
    full = invariant.linear(x, w, b)
    out["linear_error"] = (full - F.linear(x, w, b)).abs().max().item()
    out["linear_rows_invariant"] = all(
        torch.equal(invariant.linear(x[i : i + 1], w, b)[0], full[i])
        and torch.equal(invariant.linear(x[2:7], w, b)[i - 2], full[i])
        for i in range(2, 7)
    )
    # Attention: 3 rows of a 2048-position slot layout. Row 0's 1023 cached keys are 16 tiles with one new
    # node and 17 with four: the ordinary kernel's equal shares of 16 splits then cut its keys differently.
    kvh, g, hd, page, max_len = 2, 3, 16, 64, 2048
    k_cache = torch.randn(4, kvh, max_len, hd, generator=gen)
    v_cache = torch.randn(4, kvh, max_len, hd, generator=gen)
    table = torch.arange(3)[:, None] * (max_len // page) + torch.arange(max_len // page)
    ctx = torch.tensor([1023, 37, 1500])
    q4 = torch.randn(3, 4, kvh * g, hd, generator=gen)
    chain = torch.tensor([[1, 3, 7, 15]] * 3)  # node 0 sees only the prefix and itself
    kwargs = {"scale": hd**-0.5, "page_size": page}

    def node0_as_plain() -> bool:
        verify = paged_attention(q4, k_cache, v_cache, table, ctx, chain, **kwargs)
        plain = paged_attention(q4[:, :1].contiguous(), k_cache, v_cache, table, ctx, chain[:, :1], **kwargs)
        out["attention_error"] = (
            (verify - paged_attention_ref(q4, k_cache, v_cache, table, ctx, chain, **kwargs))
            .abs()
            .max()
            .item()
        )
        alone = paged_attention(
            q4[1:2, :1].contiguous(), k_cache, v_cache, table[1:2], ctx[1:2], chain[1:2, :1], **kwargs
        )
        out["row_as_alone"] = bool(torch.equal(plain[1], alone[0]))
        return bool(torch.equal(verify[:, 0], plain[:, 0]))

    out["node0_as_plain"] = node0_as_plain()
    invariant.set_enabled(False)
    out["node0_as_plain_ordinary"] = node0_as_plain()  # the check can fail: the ordinary splits differ
    return out


@pytest.fixture(scope="module")
def checks() -> dict:
    import triton  # noqa: F401  (the dev extra pins it: a missing triton fails here, never skips)

    env = {**os.environ, "TRITON_INTERPRET": "1", "SLIPSTREAM_BATCH_INVARIANT": "1", "OMP_NUM_THREADS": "1"}
    # Under the interpreter tl.dot is numpy's matmul: OpenBLAS's FMA sgemm kernels (Haswell's, also picked on
    # AMD Zen) gave a row another last bit beside other rows (2.9e-6, an AMD EPYC host, 2026-12-02) -- the
    # interpreter's arithmetic, not the kernel's. Its AVX kernels without FMA keep each row's sum in order.
    env["OPENBLAS_CORETYPE"] = "Sandybridge"
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=110, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_linear_is_the_same_bits_at_any_number_of_rows(checks: dict) -> None:
    assert checks["enabled"] and checks["linear_rows_invariant"]
    assert checks["linear_error"] < 1e-4


def test_attention_node0_of_a_verify_pass_is_the_plain_pass_bits(checks: dict) -> None:
    assert checks["node0_as_plain"] and checks["row_as_alone"]
    assert not checks["node0_as_plain_ordinary"]  # without the fixed key ranges the bits differ
    assert checks["attention_error"] < 1e-5


def test_off_by_default_and_never_for_training_or_where_triton_cannot_run() -> None:
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert not invariant.enabled() and not invariant.active(x, w)
    invariant.set_enabled(True)
    try:
        assert not invariant.active(x, w)  # this CPU process runs no Triton kernel (no interpreter)
        with pytest.raises(RuntimeError, match="needs Triton"):
            invariant.linear(x, w)
    finally:
        invariant.set_enabled(False)


@pytest.mark.gpu
def test_a_fixed_shape_steps_node0_is_the_plain_steps_bits_in_bf16(
    make_checkpoint: Callable[..., Path],
) -> None:
    """The whole step on a GPU in bf16: the pending token's last-layer state in a verify step of 8 nodes a
    row is bitwise its state in a plain step, at batch 1 and 13 — what self-draft replays need."""
    from slipstream.engine.kv_cache import KVCache
    from slipstream.engine.sampling import SamplingParams
    from slipstream.engine.static_step import PAGE_SIZE, StaticStep, StepRow
    from slipstream.engine.weights import load_model

    device = torch.device("cuda", torch.cuda.current_device())
    model = load_model(make_checkpoint("qwen2", seed=7), dtype=torch.bfloat16, device=device)
    invariant.set_enabled(True)
    try:
        for batch in (1, 13):
            cache = KVCache.for_model(
                model.config, num_slots=batch, max_len=256, dtype=torch.bfloat16, device=device,
                page_size=PAGE_SIZE, dummy_slot=True,
            )  # fmt: skip
            torch.manual_seed(0)
            cache.storage.normal_()
            step = StaticStep(model, cache, max_batch=batch, max_nodes=8, graphs=False)
            slots = [cache.allocate() for _ in range(batch)]
            states = []
            for drafts in ([], [5, 6, 7, 8, 9, 10, 11]):
                rows = [
                    StepRow(
                        slot=s,
                        context=100 + i,
                        params=SamplingParams(temperature=0.0),
                        tokens=[3 + i, *drafts],
                    )
                    for i, s in enumerate(slots)
                ]
                result = step.run(rows)
                assert (result.path[:, 0] == 0).all()
                states.append(step.hidden[:batch, 0].clone())
            assert torch.equal(states[0], states[1]), batch
    finally:
        invariant.set_enabled(False)


if __name__ == "__main__":  # the interpreter run behind `checks`
    print(json.dumps(_checks()))
