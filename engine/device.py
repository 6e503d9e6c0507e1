"""Where engine tensors live: the `device` setting every actor takes, and the one probed switch for what
is specific to a device kind.

`parse_device` reads a setting ("cpu", "cuda", "cuda:1") and names the field when it is not a device;
`require_device` refuses, at start and naming the field, a device this host cannot run (no CUDA, an index
past the GPU count). Everything else in the engine is one code path: tensors are made on the device of
the model or cache they work with, and the CPU suite runs the functions a CUDA run runs.

What differs by device kind sits here, behind `Capabilities` (probed once per device and dtype):
- CPU: inference projections through oneDNN with prepacked weights, probed per dtype — a CPU without
  AVX-512 refuses the bf16 reorder ("bf16 path needs the cpu support avx_ne_convert or avx512bw…"), so
  bf16 takes F.linear there; torch threads are pinned per actor by the runtime, not here. Inputs of one
  or two rows are padded to four on AVX-512 (`onednn_pad_rows`): a decode pass of SmolLM2 at batch 1 / 2
  took 62 / 73 ms plain and 56 / 57 ms padded on an EPYC.
- CUDA: NCCL for the learner's process group; no oneDNN; attention (`sdpa`) without cuDNN's fused
  kernel, which builds a graph per new shape (2.2 ms of host time per call on an H100, and decode's
  shapes change every step: docs/gpu.md). Decode and verify run as fixed-shape steps replayed as CUDA
  graphs (`Capabilities.cuda_graphs`; engine/static_step.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "Capabilities",
    "blas_rows",
    "capabilities",
    "onednn_linear_ok",
    "onednn_pad_rows",
    "parse_device",
    "require_device",
    "sdpa",
    "set_onednn_linear",
]

DEVICE_KINDS = ("cpu", "cuda")

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)  # dtypes the packed path is tried for
_onednn_enabled = True
_onednn_works: dict[torch.dtype, bool] = {}  # probe result per dtype, made on first use
PAD_ROWS = 4  # what a one- or two-row input is padded to where that is faster (`onednn_pad_rows`)
_onednn_pad: dict[torch.dtype, frozenset[int]] = {}  # per dtype, decided on first use
_blas_rows: dict[torch.dtype, frozenset[int]] = {}  # per dtype, decided on first use (`blas_rows`)
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""What `sdpa` lets torch choose from on CUDA: every fused backend but cuDNN's (see the module docstring)."""


def parse_device(name: str | torch.device, *, field: str = "device") -> torch.device:
    """The torch device a setting names; ValueError naming `field` for anything but cpu / cuda[:N]."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{field}: {name!r} is not a device (cpu, cuda or cuda:N)") from exc
    if device.type not in DEVICE_KINDS:
        raise ValueError(f"{field}: {name!r} is not a device this engine runs on (cpu, cuda or cuda:N)")
    return device


def require_device(name: str | torch.device, *, field: str = "device") -> torch.device:
    """`parse_device`, then refuse a device this host cannot run, naming `field` and what is missing."""
    device = parse_device(name, field=field)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{field}: {str(name)!r} is not available: torch {torch.__version__} sees no CUDA device "
                "(torch.cuda.is_available() is False)"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{field}: {str(name)!r} is not available: this host has {count} CUDA device(s)")
    return device


@dataclass(frozen=True)
class Capabilities:
    """What one device runs beyond the common path."""

    kind: str
    """"cpu" or "cuda"."""
    dist_backend: str
    """torch.distributed backend for ranks on this kind: "gloo" on CPU, "nccl" on CUDA."""
    cuda_graphs: bool
    """Whether the Generator decodes in fixed-shape steps replayed as CUDA graphs (engine/static_step.py):
    on CUDA unless SLIPSTREAM_CUDA_GRAPHS=0 (the eager dynamic path, for A/B runs and as a way out)."""


def capabilities(device: str | torch.device) -> Capabilities:
    kind = parse_device(device).type
    graphs = kind == "cuda" and os.environ.get("SLIPSTREAM_CUDA_GRAPHS", "1") != "0"
    return Capabilities(kind=kind, dist_backend="nccl" if kind == "cuda" else "gloo", cuda_graphs=graphs)


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False
) -> Tensor:
    """`F.scaled_dot_product_attention`, kept off cuDNN's backend on CUDA. The first decode steps of a
    SmolLM2 rollout on an H100 took 78 ms with it and 25 ms without (the same once every shape was cached),
    and a rollout's shapes (batch × context length) rarely repeat. Scoped per call, not process-wide."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    with sdpa_kernel(CUDA_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)


def set_onednn_linear(enabled: bool) -> None:
    """Turn the oneDNN packed-weight path on (for each dtype where this torch build and CPU run it) or off,
    process-wide."""
    global _onednn_enabled
    _onednn_enabled = enabled
    _onednn_works.clear()
    _onednn_pad.clear()
    _blas_rows.clear()


def onednn_linear_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an inference projection in `dtype` on `device` takes the packed oneDNN path."""
    if not _onednn_enabled or device.type != "cpu":
        return False
    works = _onednn_works.get(dtype)
    if works is None:
        works = _onednn_works[dtype] = dtype in _ONEDNN_DTYPES and _probe_onednn(dtype)
    return works


def blas_rows(dtype: torch.dtype) -> frozenset[int]:
    """Row counts whose inference projections in `dtype` run faster through BLAS (`F.linear` on the plain
    weight: MKL's gemv) than through oneDNN's packed kernels.

    Why: on Intel, MKL's gemv streams a few rows' weights at the memory's pace and oneDNN's packed kernels
    do not, while from four rows oneDNN is the faster; on AMD, MKL takes a generic path and oneDNN wins
    at every row count (figures: docs/engine.md, "Model"). By CPU vendor, not timed (start-up timings
    swung by more than smaller effects on shared hosts): fp32 on Intel; elsewhere, and for other dtypes,
    none. A projection whose plain weight was dropped (`keep_packed_only`) stays on oneDNN."""
    rows = _blas_rows.get(dtype)
    if rows is None:
        rows = _blas_rows[dtype] = (
            frozenset({1, 2, 3}) if dtype == torch.float32 and _intel() else frozenset()
        )
    return rows


def _intel() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:  # not Linux: no claim
        return False


def onednn_pad_rows(dtype: torch.dtype) -> frozenset[int]:
    """Row counts below PAD_ROWS whose packed projections in `dtype` run faster padded to PAD_ROWS rows.

    Why: memory-bound decode streams every weight once a pass whatever the rows, and on AVX-512 oneDNN's
    kernels for one and two rows stream them slower than its kernel for four (an EPYC, fp32, SmolLM2's 30
    layers of projections from memory: 44 / 52 / 38 ms at 1 / 2 / 3 rows, the LM head 9.9 / 11.2 / 8.3 ms;
    a whole decode pass at batch 1 / 2: 62.4 / 72.8 ms plain, 56.0 / 57.1 ms padded to four; docs/engine.md).
    The padded rows' outputs are dropped (a row's result does not depend on the others: bitwise equal here).
    By CPU capability, not timed: a per-shape timing at start-up swung by more than the effect on a shared
    host. Elsewhere (AVX2, or bf16: unmeasured) nothing is padded."""
    pad = _onednn_pad.get(dtype)
    if pad is None:
        avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        pad = _onednn_pad[dtype] = frozenset({1, 2}) if avx512 and dtype == torch.float32 else frozenset()
    return pad


def _probe_onednn(dtype: torch.dtype) -> bool:
    """Whether a packed linear runs in `dtype` here (per dtype: AVX2-only CPUs refuse the bf16 reorder)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2, dtype=dtype), None)
            out = torch.ops.mkldnn._linear_pointwise(
                torch.ones(1, 2, dtype=dtype), packed, None, "none", [], ""
            )
        return bool(torch.equal(out, torch.full((1, 2), 2.0, dtype=dtype)))
    except (AttributeError, RuntimeError):
        return False
