"""The GPU runbook: `slipstream bench gpu --json` measures where speculation pays on a CUDA device.

    slipstream bench gpu --json                  # every shape and batch size, the gpu tests first
    slipstream bench gpu --json --quick          # one shape, batches 1/16/128
    slipstream bench gpu --json --shapes qwen2.5-7b --no-tests   # one shape, no tests

One JSON object (`GpuResult`): the device, versions and date; the `gpu`-marked tests; then per model shape
(Qwen2.5-1.5B and -7B layouts, random bf16 weights built here: nothing downloaded) and batch size: plain
decode tokens/s, HF transformers' `generate` with a static cache on the same weights (the peer), the
verify cost cost(k+1)/cost(1) at a 256-token context, an EAGLE round's cost over a plain step, and the
self-draft ceiling (the target's own output replayed as drafts, reproducible mode). `run` refuses a host
without CUDA, naming the device; the measuring functions take the device, and the CPU suite runs them on
tiny shapes (tests/benchmarks/test_gpu_bench.py). Set-up and results: docs/gpu.md; run lengths:
docs/benchmarks.md.
"""

from __future__ import annotations

import datetime
import gc
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from slipstream.benchmarks.decode import Arm, Tally, _generator, bench_requests, record_outputs
from slipstream.engine import invariant
from slipstream.engine.config import ModelConfig
from slipstream.engine.device import require_device
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.drafters.eagle_rounds import EXTEND_WIDTHS
from slipstream.engine.eagle import EagleHead
from slipstream.engine.generator import Request
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.static_step import BATCH_BUCKETS, PAGE_SIZE, StaticStep, StepRow, bucket
from slipstream.engine.weights import hf_state_dict

__all__ = [
    "SHAPES",
    "GpuResult",
    "ShapeRow",
    "bench_shape",
    "draft_costs",
    "random_model",
    "run",
    "step_costs",
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
VERIFY_KS = (1, 3, 7)
DRAFT_KS = (3, 7)
"""Chain lengths whose EAGLE round cost is measured (`draft_costs`)."""
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    """Device time of a stretch of work: CUDA events on a GPU, wall time elsewhere (milliseconds)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def __enter__(self) -> _Timer:
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def step_costs(
    model: Transformer, batch: int, context: int, ks: Sequence[int] = VERIFY_KS, repeats: int = 20
) -> tuple[float, float, dict[str, float]]:
    """(device ms of one plain step, host ms of one plain iteration up to the launch, verify cost per k)
    of the fixed-shape step at `batch` rows of `context` cached tokens: chains of k random drafts, match
    verification, the step replayed `repeats` times per shape (its cache content is whatever is there:
    the cost does not depend on the values)."""
    device = model.lm_head_weight.device
    dtype = model.lm_head_weight.dtype
    longest = 1 + max(ks)
    cache = KVCache.for_model(
        model.config, num_slots=batch, max_len=context + longest, dtype=dtype, device=device,
        page_size=PAGE_SIZE, dummy_slot=True,
    )  # fmt: skip
    step = StaticStep(model, cache, max_batch=batch, max_nodes=longest)
    gen = torch.Generator(device="cpu").manual_seed(1)
    vocab = model.config.vocab_size
    slots = [cache.allocate() for _ in range(batch)]

    def rows(n: int) -> list[StepRow]:
        ids = torch.randint(0, vocab, (batch, n), generator=gen).tolist()
        return [
            StepRow(slot=s, context=context, params=SamplingParams(seed=i), tokens=ids[i])
            for i, s in enumerate(slots)
        ]

    def device_ms(n: int) -> float:
        plan = rows(n)
        key = step.key(plan)
        step.run(plan)  # capture (a GPU) or warm up
        step.pack(plan, key)
        step.inp[: key.batch].copy_(step.staging[: key.batch])
        with _Timer(device) as timer:
            for _ in range(repeats):
                step.runner(key)
        return timer.ms / repeats

    plain_ms = device_ms(1)
    plan = rows(1)
    host = []
    for _ in range(repeats):
        step.run(plan)
        host.append(step.last_host_s * 1e3)
    costs = {str(k): round(device_ms(k + 1) / plain_ms, 3) for k in ks}
    step.runner.reset()
    return round(plain_ms, 3), round(statistics.median(host), 3), costs


def draft_costs(
    model: Transformer,
    batch: int,
    context: int,
    plain_ms: float,
    ks: Sequence[int] = DRAFT_KS,
    repeats: int = 20,
) -> dict[str, float]:
    """An EAGLE round's device time over one plain step's, per chain length k: the head's pass over k + 1
    committed pairs plus a chain of k drafts, both fixed-shape (graphs on CUDA), at `batch` rows of
    `context` cached pairs, over a 4096-token draft vocabulary. A random head (the cost, not acceptance)."""
    device, dtype = model.lm_head_weight.device, model.lm_head_weight.dtype
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).to(device=device, dtype=dtype)
    drafter = EagleDrafter(head, model, num_slots=batch, max_len=context + 2 * max(ks) + 2, static=True)
    drafter.prime_counts({t: 1 for t in range(min(4096, model.config.vocab_size))})
    rounds = drafter.rounds
    assert rounds is not None
    restricted = drafter.vocab.refresh()
    slots = [drafter.cache.allocate() for _ in range(batch)]

    def device_ms(key: tuple, count: int | None) -> float:
        rounds.stage(slots, [context] * batch, None if count is None else [count] * batch)
        rounds.runner(key)  # capture (a GPU) or warm up
        with _Timer(device) as timer:
            for _ in range(repeats):
                rounds.runner(key)
        return timer.ms / repeats

    rows = bucket(batch, BATCH_BUCKETS)
    costs = {}
    for k in ks:
        width = bucket(k + 1, EXTEND_WIDTHS)
        total = device_ms(("extend", rows, width), k + 1) + device_ms(
            ("chain", rows, k, False, restricted), None
        )
        costs[str(k)] = round(total / plain_ms, 3)
    rounds.runner.reset()
    return costs


def _hf_tokens_per_s(model: Transformer, prompts: list[list[int]], max_tokens: int) -> float | None:
    """transformers' generate on the same weights, static cache, sampling at T = 1, EOS ignored."""
    try:
        import transformers
    except ImportError:
        return None
    cfg = model.config
    device = model.lm_head_weight.device
    hf_config = transformers.Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    # Built on the device in the target's dtype (its rotary buffers computed there), then given our weights.
    default = torch.get_default_dtype()
    torch.set_default_dtype(model.lm_head_weight.dtype)
    try:
        with torch.device(device):
            hf = transformers.Qwen2ForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head has no tensor of its own
        raise RuntimeError(f"HF peer: weights missing {missing}, unexpected {unexpected}")
    hf.eval()
    ids = torch.tensor(prompts, dtype=torch.int64, device=device)
    kwargs = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": max_tokens,
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "cache_implementation": "static",
        "pad_token_id": 0,
    }
    with torch.inference_mode():
        # Warm-up with the timed call itself: generate with a static cache compiles (transformers 5), and a
        # shorter warm-up left the compile inside the timed call (docs/benchmarks.md).
        hf.generate(ids, **kwargs)
        _sync(device)
        started = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        _sync(device)
        seconds = time.perf_counter() - started
    del hf
    return (out.shape[1] - ids.shape[1]) * len(prompts) / seconds


def timed_generate(
    model: Transformer,
    requests: list[Request],
    arm: Arm,
    recorded: dict[str, list[int]],
    *,
    static: bool | None = None,
) -> tuple[Tally, float]:
    """One generator for `arm` (bench decode's), run over `requests` twice: the first warms it up (graphs
    captured, kernels compiled), the second is timed. Returns the timed run's tally and the seconds spent
    capturing graphs. static: as `Generator`'s (None: the device's default)."""
    gen = _generator(model, requests, arm, recorded, static=static)
    gen.generate(requests)
    device = model.lm_head_weight.device
    tally = Tally()
    _sync(device)
    started = time.perf_counter()
    for completion in gen.generate(requests):
        tally.add(completion)
    _sync(device)
    tally.seconds = time.perf_counter() - started
    capture_s = 0.0
    if gen._static is not None:
        capture_s = gen._static.runner.capture_s
        gen._static.runner.reset()  # its graphs' memory goes now, not at some later collection
    return tally, capture_s


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
        requests = bench_requests(prompts[:batch], max_tokens)
        recorded = record_outputs(model, requests)  # the oracle's script (the static path when on)
        timed = [timed_generate(model, requests, arm, recorded, static=static) for arm in SELF_ARMS]
        tallies = [tally for tally, _ in timed]
        capture_s += sum(seconds for _, seconds in timed)
        plain = tallies[0].tokens / tallies[0].seconds
        self_draft = {
            f"d{a.depth}": round(t.tokens / t.seconds / plain, 3)
            for a, t in zip(SELF_ARMS[1:], tallies[1:], strict=True)
        }
        self_accept = {
            f"d{a.depth}": round(t.tokens / t.passes, 3)
            for a, t in zip(SELF_ARMS[1:], tallies[1:], strict=True)
        }
        eager = None
        if batch in eager_batches:
            t, _ = timed_generate(model, requests, SELF_ARMS[0], recorded, static=False)
            eager = round(t.tokens / t.seconds, 1)
        run_peer = peer_batches is None or batch in peer_batches
        hf = _hf_tokens_per_s(model, prompts[:batch], max_tokens) if run_peer else None
        step_ms, host_ms, cost = step_costs(model, batch, context)
        drafting = draft_costs(model, batch, context, step_ms)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(
            BatchRow(
                batch=batch,
                plain_tok_s=round(plain, 1),
                eager_tok_s=eager,
                hf_tok_s=None if hf is None else round(hf, 1),
                plain_vs_hf=None if hf is None else round(plain / hf, 3),
                step_ms=step_ms,
                host_ms=host_ms,
                verify_cost=cost,
                draft_cost=drafting,
                self_draft=self_draft,
                self_accept=self_accept,
            )
        )
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
