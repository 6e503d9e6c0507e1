"""Where engine tensors live: the `device` setting every actor takes, and the one probed switch for what
is specific to a device kind.

`parse_device` reads a setting ("cpu", "cuda", "cuda:1") and names the field when it is not a device;
`require_device` refuses, at start and naming the field, a device this host cannot run (no CUDA, an index
past the GPU count). Everything else in the engine is one code path: tensors are made on the device of
the model or cache they work with, and the CPU suite runs the functions a CUDA run runs.

What differs by device kind sits here, behind `Capabilities` (probed once per device and dtype):
- CPU: inference projections through prepacked weights (`packed_gemm`): MKL's packed sgemm for fp32 on
  Intel, oneDNN's blocked weights elsewhere and for bf16 (a CPU without AVX-512 refuses the bf16 reorder,
  so bf16 takes F.linear there). On oneDNN, inputs of one or two rows are padded to four on AVX-512
  (`onednn_pad_rows`). Torch threads are pinned per actor by the runtime, not here.
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
    "capabilities",
    "onednn_pad_rows",
    "packed_gemm",
    "parse_device",
    "require_device",
    "sdpa",
    "set_packed_gemm",
]

DEVICE_KINDS = ("cpu", "cuda")

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)  # dtypes the oneDNN packed path is tried for
GEMMS = ("mkl", "onednn")  # the packed-weight kernels `packed_gemm` chooses from
_packed_enabled = True
# `packed_gemm`'s choice per dtype, made on first use: (up to MKL_MAX_WIDTH outputs, past it)
_gemm: dict[torch.dtype, tuple[str | None, str | None]] = {}
MKL_MAX_WIDTH = 8192
"""Output widths past this (an LM head) stay on oneDNN where MKL is chosen: a 49152 × 576 head took 5.9 / 8.2
ms at 4 / 16 rows through MKL's packed sgemm and 5.4 / 7.0 through oneDNN (2 threads, Xeon with AMX)."""
MKL_PACK_ROWS = 256
"""The row count MKL's weights are packed for. The pack's layout depends on it and serves any row count,
but a pack for 1 row ran 16 rows 1.6x slower; one for 256 was the fastest measured at 1, 4, 16 and 64."""
PAD_ROWS = 4  # what a one- or two-row input is padded to where that is faster (`onednn_pad_rows`)
_onednn_pad: dict[torch.dtype, frozenset[int]] = {}  # per dtype, decided on first use
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


def set_packed_gemm(enabled: bool) -> None:
    """Turn the packed-weight projections on (each dtype takes what `packed_gemm` probes) or off (every
    projection through F.linear), process-wide."""
    global _packed_enabled
    _packed_enabled = enabled
    _gemm.clear()
    _onednn_pad.clear()


def packed_gemm(device: torch.device, dtype: torch.dtype, width: int = 0) -> str | None:
    """Which packed-weight kernel an inference projection in `dtype` on `device` takes: "mkl" (MKL's packed
    sgemm), "onednn" (oneDNN's blocked weights) or None (F.linear: CUDA, or nothing probed runs here).

    fp32 on Intel takes MKL's packed sgemm where this torch build has it: SmolLM2's 120 layer projections
    streamed from memory (an Intel Xeon with AMX, 2 threads) took 16.2 / 19.7 / 27.7 / 48.5 ms at 1 / 4 /
    16 / 64 rows against oneDNN's 25.3 / 24.4 / 33.0 / 67.8 (docs/engine.md, "Model"); widths past
    MKL_MAX_WIDTH (an LM head) stay on oneDNN. On AMD, MKL takes a generic path and oneDNN wins at every
    row count; bf16 has no MKL packing. By vendor and a probe, not timed: start-up timings on a shared host
    swung by more than these effects. SLIPSTREAM_CPU_GEMM=onednn|mkl|none forces one, for A/B runs."""
    if not _packed_enabled or device.type != "cpu":
        return None
    if dtype not in _gemm:
        _gemm[dtype] = _choose_gemm(dtype)
    narrow, wide = _gemm[dtype]
    return wide if width > MKL_MAX_WIDTH else narrow


def _choose_gemm(dtype: torch.dtype) -> tuple[str | None, str | None]:
    forced = os.environ.get("SLIPSTREAM_CPU_GEMM", "")
    if forced not in ("", *GEMMS, "none"):
        raise ValueError(f"SLIPSTREAM_CPU_GEMM={forced!r}: expected one of {', '.join(GEMMS)}, none")
    if forced == "none":
        return None, None
    mkl = dtype == torch.float32 and _probe_mkl()
    onednn = dtype in _ONEDNN_DTYPES and _probe_onednn(dtype)
    if forced:
        if not {"mkl": mkl, "onednn": onednn}[forced]:
            raise ValueError(
                f"SLIPSTREAM_CPU_GEMM={forced}: this torch build and CPU do not run it for {dtype}"
            )
        return forced, forced
    onednn_or_none = "onednn" if onednn else None
    narrow = "mkl" if mkl and _intel() else onednn_or_none
    return narrow, onednn_or_none or narrow


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


def _probe_mkl() -> bool:
    """Whether MKL's packed sgemm runs here (a torch build without MKL has no such ops, or refuses them)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        with torch.inference_mode():
            packed = torch.ops.mkl._mkl_reorder_linear_weight(torch.ones(2, 2), 1)
            out = torch.ops.mkl._mkl_linear(torch.ones(1, 2), packed, torch.zeros(1).expand(2, 2), None, 1)
        return bool(torch.equal(out, torch.full((1, 2), 2.0)))
    except (AttributeError, RuntimeError):
        return False


def _intel() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:  # not Linux: no claim
        return False
