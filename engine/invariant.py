"""Batch-invariant inference kernels: a row's result does not depend on how many rows share the call.

Why: greedy decoding with speculation must be token-identical to plain decoding, and reproducible mode's
tokens must not depend on speculation. On a GPU, cuBLAS picks its GEMM algorithm (tile sizes, split-K) by
the problem's shape, so a pending token scored in a verify pass of B·(k+1) rows rounds differently in bf16
from the same token in a plain pass of B rows, and a near tie flips (docs/gpu.md: the self-draft replays
were rejected, accept length 1.05). `linear` is a Triton GEMM whose tiles and K-loop order are the same
for every M, so each output row is the same bits at any batch; attention's split-KV ranges become fixed
key ranges (engine/attention.py). Row-wise ops (norms, rotary, softmax, sampling) are invariant already.

On with SLIPSTREAM_BATCH_INVARIANT=1 (or `set_enabled`), for inference on CUDA, and on the CPU under
TRITON_INTERPRET=1 (how the suite tests it); training keeps cuBLAS/oneDNN. What it costs against cuBLAS is
`bench gpu --invariant`'s to say: off by default until a GPU has measured it.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from slipstream.engine.attention import triton, triton_enabled

__all__ = ["BLOCK_K", "active", "enabled", "linear", "set_enabled"]

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64
"""The GEMM's tiles, the same for every call: a row's dot products always run over K in the same
BLOCK_K chunks, in the same order."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_enabled = os.environ.get("SLIPSTREAM_BATCH_INVARIANT") == "1"


def enabled() -> bool:
    """Whether inference linears and attention use the batch-invariant kernels where they can run."""
    return _enabled


def set_enabled(flag: bool) -> None:
    """Switch the batch-invariant kernels on or off for this process (between steps; a captured CUDA
    graph keeps the kernels it was captured with)."""
    global _enabled
    _enabled = flag


def active(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear(x, weight)` takes the invariant kernel: switched on, an inference call (no autograd),
    a dtype it computes, on a device where Triton runs."""
    return (
        _enabled
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and triton_enabled(x.device)
    )


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _linear_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[m, n] = Σ_k x[m, k] · w[n, k] (+ b[n]), fp32 accumulation over fixed K chunks."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            a = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            b = tl.load(
                w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
            )
            acc += tl.dot(a, b, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm[:, None] * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) with the batch-invariant GEMM (x [..., K], weight [N, K]): each row of the
    result is the same bits whatever the other rows are. Needs `active(x, weight)`."""
    if not triton_enabled(x.device):
        raise RuntimeError(f"the batch-invariant linear needs Triton on {x.device}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](
            x2, w, bias if bias is not None else w, out, m, n, k, x2.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
        )  # fmt: skip
    return out.reshape(*shape[:-1], n)
