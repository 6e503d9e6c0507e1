"""The GPU runbook: `slipstream bench gpu --json` measures where speculation pays on a CUDA device.

    slipstream bench gpu --json                  # every shape and batch size, the gpu tests first
    slipstream bench gpu --json --quick          # one shape, batches 1/16/128
    slipstream bench gpu --json --shapes qwen2.5-7b --no-tests   # one shape, no tests

One JSON object (`GpuResult`): the device, versions and date; the `gpu`-marked tests; then per model shape
(Qwen2.5-1.5B and -7B layouts, random bf16 weights built here: nothing downloaded) and batch size: plain
decode tokens/s, HF transformers' `generate` with a static cache on the same weights (the peer), the
verify cost cost(k+1)/cost(1) at a 256-token context, an EAGLE round's cost over a plain step, and the
self-draft ceiling (the target's own output replayed as drafts, reproducible mode). `run` refuses a host
without CUDA, naming the device; the measuring functions (here and benchmarks/gpu_costs.py) take the
device, and the CPU suite runs them on tiny shapes (tests/benchmarks/test_gpu_bench.py). Set-up and
results: docs/gpu.md; run lengths: docs/benchmarks.md.
"""

from __future__ import annotations

import datetime
import gc
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from slipstream.benchmarks.decode import Arm, bench_requests, record_outputs
from slipstream.benchmarks.gpu_costs import draft_costs, hf_tokens_per_s, step_costs, timed_generate
from slipstream.engine import invariant
from slipstream.engine.config import ModelConfig
from slipstream.engine.device import require_device
from slipstream.engine.model import Transformer

__all__ = [
    "SHAPES",
    "GpuResult",
    "ShapeRow",
    "bench_shape",
    "random_model",
    "run",
]

_QWEN = {"model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": {
        **_QWEN,
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        **_QWEN,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
}
"""config.json fields of real model shapes (public architecture figures); the weights are random."""
BATCHES = (1, 4, 16, 64, 128, 256)
QUICK_BATCHES = (1, 16, 128)
PEER_BATCHES = (1, 64)
"""HF generate compiles per batch size (tens of seconds each, docs/benchmarks.md): a call measures it where
it calibrates the card."""
EAGER_BATCHES = (1, 16)
"""The dynamic eager path (before graphs) on the same card, for the before/after ratio."""
SELF_ARMS = (Arm("off"), Arm("self", 3, 1, 3), Arm("self", 7, 1, 7))


class BatchRow(msgspec.Struct, frozen=True, kw_only=True):
    """One shape at one batch size."""

    batch: int
    plain_tok_s: float  # our engine, plain decoding, fixed-shape steps (graphs on CUDA), prefill included
    eager_tok_s: float | None  # the dynamic eager path (static=False) on the same requests (None: not run)
    hf_tok_s: float | None  # transformers generate, static cache, same weights and dtype (None: not run)
    plain_vs_hf: float | None  # plain_tok_s / hf_tok_s
    step_ms: float  # device time of one plain decode step at `context_tokens` (CUDA events; wall on a CPU)
    host_ms: float  # host time of one plain iteration up to the launch: pack, copy, replay
    verify_cost: dict[str, float]  # "k" -> step time scoring k+1 nodes a row / step time scoring one
    draft_cost: dict[str, float]  # "k" -> an EAGLE round (k+1 pairs in, k drafted) / one plain step
    self_draft: dict[str, float]  # "d3", "d7" -> self-draft tokens/s / plain tokens/s (the ceiling)
    self_accept: dict[str, float]  # "d3", "d7" -> tokens per target pass of the self-draft run


class ShapeRow(msgspec.Struct, frozen=True, kw_only=True):
    shape: str
    dtype: str
    params_m: float  # millions of parameters
    weight_gb: float  # bytes a decode step reads in weights (every parameter once), GB
    roofline_b1: float | None  # (weight bytes / HBM bandwidth) / batch-1 step time: the fraction reached
    hbm_tb_s: float | None  # the bandwidth assumed for the device (None: unknown device)
    capture_s: float  # seconds spent warming up and capturing graphs over the shape's rows
    rows: list[BatchRow]


class GpuResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `bench gpu --json` prints."""

    device: str  # torch's name for the device
    device_name: str  # e.g. "NVIDIA H100 80GB HBM3"
    torch: str
    cuda: str | None
    transformers: str | None
    python: str
    date: str  # UTC, ISO 8601
    gpu_tests: dict[str, Any]  # pytest -m gpu: counts and the closing line
    shapes: list[ShapeRow]
    prompt_tokens: int
    max_tokens: int
    context_tokens: int  # cached tokens per row when step times and verify costs are measured
    wall_s: float
    batch_invariant: bool = False  # SLIPSTREAM_BATCH_INVARIANT=1: every step on the invariant kernels


HBM_TB_S = {"H200": 4.8, "H100": 3.35}
"""Datasheet HBM bandwidth by device-name fragment (TB/s; the H100 figure is the SXM part's)."""


def hbm_bandwidth(name: str) -> float | None:
    """TB/s for a device name, None when it is not a known part."""
    return next((bw for part, bw in HBM_TB_S.items() if part in name), None)


PEAK = 5.0
"""The final norm's weight in `random_model`. N(0, 0.02) weights give nearly flat logits over a 152k
vocabulary, so the sampler picks by inverse CDF over all of it, where any kernel's last-bit rounding moves
the pick, and a self-draft replay measures rounding, not the engine. Scaled by `PEAK` the distributions
are peaked, as a trained model's are (the logits' spread either way: docs/benchmarks.md). It changes no
cost."""


def random_model(
    shape: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0, peak: float = PEAK
) -> Transformer:
    """A `Transformer` of `shape` (config.json fields) with random weights, built on `device` in `dtype`;
    the final norm's weight is `peak` (`PEAK`), the other norms' 1."""
    config = ModelConfig.from_dict({**shape, "torch_dtype": str(dtype).removeprefix("torch.")})
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(peak if name == "final_norm.weight" else 1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def _batch_row(
    model: Transformer,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    context: int,
    static: bool | None,
    eager: bool,
    peer: bool,
) -> tuple[BatchRow, float]:
    """One batch size's row (a prompt a row of the batch) and the seconds its generators spent capturing
    graphs. eager: the dynamic eager path runs too; peer: HF's generate runs too."""
    batch = len(prompts)
    device = model.lm_head_weight.device
    requests = bench_requests(prompts, max_tokens)
    recorded = record_outputs(model, requests)  # the oracle's script (the static path when on)
    timed = [timed_generate(model, requests, arm, recorded, static=static) for arm in SELF_ARMS]
    tallies = [tally for tally, _ in timed]
    capture_s = sum(seconds for _, seconds in timed)
    plain = tallies[0].tokens / tallies[0].seconds
    self_draft = {
        f"d{a.depth}": round(t.tokens / t.seconds / plain, 3)
        for a, t in zip(SELF_ARMS[1:], tallies[1:], strict=True)
    }
    self_accept = {
        f"d{a.depth}": round(t.tokens / t.passes, 3) for a, t in zip(SELF_ARMS[1:], tallies[1:], strict=True)
    }
    eager_tok_s = None
    if eager:
        t, _ = timed_generate(model, requests, SELF_ARMS[0], recorded, static=False)
        eager_tok_s = round(t.tokens / t.seconds, 1)
    hf = hf_tokens_per_s(model, prompts, max_tokens) if peer else None
    step_ms, host_ms, cost = step_costs(model, batch, context)
    drafting = draft_costs(model, batch, context, step_ms)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row = BatchRow(
        batch=batch,
        plain_tok_s=round(plain, 1),
        eager_tok_s=eager_tok_s,
        hf_tok_s=None if hf is None else round(hf, 1),
        plain_vs_hf=None if hf is None else round(plain / hf, 3),
        step_ms=step_ms,
        host_ms=host_ms,
        verify_cost=cost,
        draft_cost=drafting,
        self_draft=self_draft,
        self_accept=self_accept,
    )
    return row, capture_s


def bench_shape(
    name: str,
    shape: dict[str, Any],
    device: torch.device,
    *,
    dtype: torch.dtype = torch.bfloat16,
    batches: Sequence[int] = BATCHES,
    prompt_tokens: int = 64,
    max_tokens: int = 128,
    context: int = 256,
    peer_batches: Sequence[int] | None = None,
    eager_batches: Sequence[int] = (),
    static: bool | None = None,
    say: Any = print,
) -> ShapeRow:
    """Every batch size's row for one shape (see the module docstring). peer_batches: where HF's generate
    runs (None: every batch); eager_batches: where the dynamic eager path runs too; static: the
    Generator's (None: fixed-shape steps where the device has graphs; tests pass True on the CPU)."""
    model = random_model(shape, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (max(batches), prompt_tokens), generator=gen).tolist()
    rows = []
    capture_s = 0.0
    for batch in batches:
        row, captured = _batch_row(
            model, prompts[:batch], max_tokens=max_tokens, context=context, static=static,
            eager=batch in eager_batches, peer=peer_batches is None or batch in peer_batches,
        )  # fmt: skip
        rows.append(row)
        capture_s += captured
        # The row as JSON too: a run cut off at the device call's limit still leaves its rows in the log.
        say(f"bench gpu: {name} row {msgspec.json.encode(rows[-1]).decode()}")
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = hbm_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    b1 = next((r for r in rows if r.batch == 1), None)
    roofline = None
    if bandwidth is not None and b1 is not None:
        roofline = round(weight_bytes / (bandwidth * 1e12) / (b1.step_ms / 1e3), 3)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ShapeRow(
        shape=name,
        dtype=str(dtype).removeprefix("torch."),
        params_m=round(params / 1e6, 1),
        weight_gb=round(weight_bytes / 1e9, 3),
        roofline_b1=roofline,
        hbm_tb_s=bandwidth,
        capture_s=round(capture_s, 2),
        rows=rows,
    )


def gpu_tests(root: Path, timeout_s: int = 600, log: Path | None = None) -> dict[str, Any]:
    """`pytest -m gpu` over the suite in a child process: its counts, closing line and the first failures'
    summary lines (pytest's whole output goes to `log` when given: a GPU session's only debugging aid)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-m", "gpu", "-p", "no:cacheprovider"]
    cmd.append(str(root / "tests"))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=root)
        out, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        out, code = partial + f"\n(timed out after {timeout_s} s)", None
    if log is not None:
        log.write_text(out)
    lines = out.splitlines()
    last = next((line for line in reversed(lines) if line.strip()), "")
    counts = {
        word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", last)
    }
    failures = [line[:300] for line in lines if line.startswith(("FAILED ", "ERROR "))][:20]
    return {"exit_code": code, "closing_line": last, "failures": failures, **counts}


def run(
    *,
    quick: bool = False,
    shapes: Sequence[str] = (),
    tests: bool = True,
    peer: bool = True,
    peer_batches: Sequence[int] | None = PEER_BATCHES,
    eager_batches: Sequence[int] = EAGER_BATCHES,
    batches: Sequence[int] | None = None,
    tests_log: Path | None = None,
    tests_timeout_s: int = 600,
    say: Any = print,
) -> GpuResult:
    """The runbook on cuda (ValueError naming the device where there is none); `shapes` picks SHAPES
    (default: all, or the 1.5B alone with `quick`); peer_batches: where HF's generate runs (None: every
    batch; its compile per batch size is what makes a call long); eager_batches: where the dynamic eager
    path runs beside the fixed-shape one."""
    unknown = [n for n in shapes if n not in SHAPES]
    if unknown:
        raise ValueError(f"--shapes: {unknown} not among {list(SHAPES)}")
    device = require_device("cuda", field="device")
    started = time.perf_counter()
    root = Path(__file__).resolve().parents[1]
    tested = (
        gpu_tests(root, tests_timeout_s, tests_log)
        if tests and (root / "tests").is_dir()
        else {"closing_line": "not run"}
    )
    say(f"bench gpu: gpu tests: {tested.get('closing_line')}")
    names = list(shapes) or (["qwen2.5-1.5b"] if quick else list(SHAPES))
    batches = batches or (QUICK_BATCHES if quick else BATCHES)
    peers = peer_batches if peer else ()
    shapes = [
        bench_shape(
            n, SHAPES[n], device, batches=batches, peer_batches=peers, eager_batches=eager_batches, say=say
        )
        for n in names
    ]
    try:
        import transformers

        hf_version: str | None = transformers.__version__
    except ImportError:
        hf_version = None
    return GpuResult(
        batch_invariant=invariant.enabled(),
        device=str(device),
        device_name=torch.cuda.get_device_name(device),
        torch=str(torch.__version__),
        cuda=torch.version.cuda,
        transformers=hf_version,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        gpu_tests=tested,
        shapes=shapes,
        prompt_tokens=64,
        max_tokens=128,
        context_tokens=256,
        wall_s=round(time.perf_counter() - started, 1),
    )
