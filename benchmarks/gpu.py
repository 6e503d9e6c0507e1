"""The GPU runbook: `slipstream bench gpu --json` measures where speculation pays on a CUDA device.

    slipstream bench gpu --json                  # on a CUDA host: ≤ 20 minutes on one H100
    slipstream bench gpu --json --quick          # one shape, batches 1/16/128, a few minutes
    slipstream bench gpu --json --shapes qwen2.5-7b --no-tests   # one shape (a device call is ≤ 10 min)

One JSON object (`GpuResult`): the device, versions and date; the `gpu`-marked tests (pytest -m gpu); then
per model shape (Qwen2.5-1.5B and -7B layouts with random bf16 weights, built here: nothing downloaded)
and batch size: plain decode tokens/s, the same weights under HF transformers' `generate` with a static
cache (the plain-decode peer), the verify cost cost(k+1)/cost(1) of one target pass scoring k+1 tokens
per sequence at a 256-token context, and the self-draft ceiling (the target's own recorded output
replayed as drafts, reproducible mode: the engine's mechanical limit). Exits at once, naming the missing
device, where torch sees no CUDA. The measuring functions take the device: the CPU suite runs them on
tiny shapes (tests/benchmarks/test_gpu_bench.py), so what runs on the GPU has run before. docs/gpu.md
has the set-up and what waits for a GPU.
"""

from __future__ import annotations

import argparse
import datetime
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

from slipstream.benchmarks.decode import Arm, bench_requests, interleaved_round, record_outputs
from slipstream.engine.batch import BatchLayout
from slipstream.engine.config import ModelConfig
from slipstream.engine.device import require_device
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.weights import hf_state_dict

__all__ = ["SHAPES", "GpuResult", "ShapeRow", "bench_shape", "main", "random_model", "run", "verify_cost"]

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
VERIFY_KS = (1, 3, 7)
SELF_ARMS = (Arm("off"), Arm("self", 3, 1, 3), Arm("self", 7, 1, 7))


class BatchRow(msgspec.Struct, frozen=True, kw_only=True):
    """One shape at one batch size."""

    batch: int
    plain_tok_s: float  # our engine, plain decoding (prefill included, as for the peer)
    hf_tok_s: float | None  # transformers generate, static cache, same weights and dtype (None: not run)
    plain_vs_hf: float | None  # plain_tok_s / hf_tok_s
    verify_cost: dict[str, float]  # "k" -> cost of a pass scoring k+1 tokens per sequence / one token
    self_draft: dict[str, float]  # "d3", "d7" -> self-draft tokens/s / plain tokens/s (the ceiling)
    self_accept: dict[str, float]  # "d3", "d7" -> tokens per target pass of the self-draft run


class ShapeRow(msgspec.Struct, frozen=True, kw_only=True):
    shape: str
    dtype: str
    params_m: float  # millions of parameters
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
    context_tokens: int  # cached tokens per sequence when the verify cost is measured
    wall_s: float


def random_model(
    shape: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0
) -> Transformer:
    """A `Transformer` of `shape` (config.json fields) with random weights, built on `device` in `dtype`."""
    config = ModelConfig.from_dict({**shape, "torch_dtype": str(dtype).removeprefix("torch.")})
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_cost(
    model: Transformer, batch: int, context: int, ks: Sequence[int] = VERIFY_KS, repeats: int = 5
) -> dict[str, float]:
    """cost(pass of k+1 tokens per sequence) / cost(pass of 1) at `batch` sequences of `context` cached
    tokens, logits at every new row (as a verify pass needs them); medians of `repeats` timed passes."""
    device = model.lm_head_weight.device
    dtype = model.lm_head_weight.dtype
    longest = 1 + max(ks)
    cache = KVCache.for_model(
        model.config, num_slots=batch, max_len=context + longest, dtype=dtype, device=device
    )
    slots = [cache.allocate() for _ in range(batch)]
    gen = torch.Generator(device="cpu").manual_seed(1)
    vocab = model.config.vocab_size

    def run_pass(n_new: int) -> float:
        layout = BatchLayout.build(cache, slots, [n_new] * batch, logit_rows=range(batch * n_new))
        ids = torch.randint(0, vocab, (batch * n_new,), generator=gen).to(device)
        _sync(device)
        started = time.perf_counter()
        model(ids, layout.positions, layout, cache)
        _sync(device)
        return time.perf_counter() - started

    # Prefill the context in chunks that keep one pass under ~16k tokens.
    step = max(1, min(context, 16384 // batch))
    filled = 0
    while filled < context:
        n = min(step, context - filled)
        layout = BatchLayout.build(cache, slots, [n] * batch, logit_rows=[])
        model(
            torch.randint(0, vocab, (batch * n,), generator=gen).to(device), layout.positions, layout, cache
        )
        filled += n

    def timed(n_new: int) -> float:
        seconds = []
        for _ in range(repeats + 1):  # the first pass of a shape warms kernels up: not counted
            seconds.append(run_pass(n_new))
            for slot in slots:
                cache.set_length(slot, context)  # roll the pass back: every pass sees the same context
        return statistics.median(seconds[1:])

    one = timed(1)
    return {str(k): round(timed(k + 1) / one, 3) for k in ks}


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
        # shorter warm-up left the compile inside the timed call (3 tok/s at batch 1 on an H100).
        hf.generate(ids, **kwargs)
        _sync(device)
        started = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        _sync(device)
        seconds = time.perf_counter() - started
    del hf
    return (out.shape[1] - ids.shape[1]) * len(prompts) / seconds


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
    peer: bool = True,
    say: Any = print,
) -> ShapeRow:
    """Every batch size's row for one shape (see the module docstring)."""
    model = random_model(shape, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (max(batches), prompt_tokens), generator=gen).tolist()
    rows = []
    for batch in batches:
        requests = bench_requests(prompts[:batch], max_tokens)
        recorded = record_outputs(model, requests)  # also the warm-up
        tallies = interleaved_round(model, requests, SELF_ARMS, recorded)
        plain = tallies[0].tokens / tallies[0].seconds
        self_draft = {
            f"d{a.depth}": round(t.tokens / t.seconds / plain, 3)
            for a, t in zip(SELF_ARMS[1:], tallies[1:], strict=True)
        }
        self_accept = {
            f"d{a.depth}": round(t.tokens / t.passes, 3)
            for a, t in zip(SELF_ARMS[1:], tallies[1:], strict=True)
        }
        hf = _hf_tokens_per_s(model, prompts[:batch], max_tokens) if peer else None
        cost = verify_cost(model, batch, context)
        rows.append(
            BatchRow(
                batch=batch,
                plain_tok_s=round(plain, 1),
                hf_tok_s=None if hf is None else round(hf, 1),
                plain_vs_hf=None if hf is None else round(plain / hf, 3),
                verify_cost=cost,
                self_draft=self_draft,
                self_accept=self_accept,
            )
        )
        # The row as JSON too: a run cut off at the device call's limit still leaves its rows in the log.
        say(f"bench gpu: {name} row {msgspec.json.encode(rows[-1]).decode()}")
    params = sum(p.numel() for p in model.parameters()) / 1e6
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ShapeRow(shape=name, dtype=str(dtype).removeprefix("torch."), params_m=round(params, 1), rows=rows)


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
    tests_log: Path | None = None,
    tests_timeout_s: int = 600,
    say: Any = print,
) -> GpuResult:
    """The runbook on cuda (ValueError naming the device where there is none); `shapes` picks SHAPES
    (default: all, or the 1.5B alone with `quick`)."""
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
    batches = QUICK_BATCHES if quick else BATCHES
    shapes = [bench_shape(n, SHAPES[n], device, batches=batches, peer=peer, say=say) for n in names]
    try:
        import transformers

        hf_version: str | None = transformers.__version__
    except ImportError:
        hf_version = None
    return GpuResult(
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slipstream bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one shape, batches 1/16/128")
    p.add_argument("--shapes", default="", help=f"comma-separated subset of {','.join(SHAPES)}")
    p.add_argument("--no-tests", action="store_true", help="skip the gpu-marked tests")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' generate")
    p.add_argument("--tests-log", type=Path, default=None, help="write the gpu tests' whole output here")
    p.add_argument("--tests-timeout", type=int, default=600, help="seconds the gpu tests may take")
    p.add_argument("--json", action="store_true", help="one JSON object (GpuResult) on stdout")
    args = p.parse_args(argv)
    try:
        require_device("cuda", field="device")
    except ValueError as exc:
        print(f"slipstream bench gpu: {exc}", file=sys.stderr)
        return 2
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    shapes = [n for n in args.shapes.split(",") if n]
    result = run(
        quick=args.quick,
        shapes=shapes,
        tests=not args.no_tests,
        peer=not args.no_peer,
        tests_log=args.tests_log,
        tests_timeout_s=args.tests_timeout,
        say=say,
    )
    print(
        msgspec.json.encode(result).decode()
        if args.json
        else msgspec.json.format(msgspec.json.encode(result)).decode()
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
