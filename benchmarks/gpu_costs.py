"""What decode costs on a device, as `slipstream bench gpu` measures it for each shape and batch size.

`step_costs`: device ms of one fixed-shape plain step (CUDA events on a GPU, wall time elsewhere), the
host ms of an iteration up to its launch, and the verify cost cost(k+1)/cost(1) of a chain of k drafts;
`draft_costs`: an EAGLE round's device time over a plain step's; `timed_generate`: tokens/s of a bench
decode config, warmed up first; `hf_tokens_per_s`: transformers' `generate` on the same weights, the
peer. The non-obvious choice: step and round costs are timed on a replayed fixed-shape step over whatever
the cache holds, with random drafts and a random head, since the cost does not depend on the values
(acceptance is what the self-draft rows measure); HF's generate is timed on its second call, as the first
compiles it. Each runs on the model's device, so the CPU suite runs them on tiny shapes
(tests/benchmarks/test_gpu_bench.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from slipstream.benchmarks.decode import Arm, Tally, _generator
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.drafters.eagle_rounds import EXTEND_WIDTHS
from slipstream.engine.eagle import EagleHead
from slipstream.engine.generator import Request
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.static_step import BATCH_BUCKETS, PAGE_SIZE, StaticStep, StepRow, bucket
from slipstream.engine.weights import hf_state_dict

__all__ = ["DRAFT_KS", "VERIFY_KS", "draft_costs", "hf_tokens_per_s", "step_costs", "timed_generate"]

VERIFY_KS = (1, 3, 7)
DRAFT_KS = (3, 7)
"""Chain lengths whose EAGLE round cost is measured (`draft_costs`)."""


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


def hf_tokens_per_s(model: Transformer, prompts: list[list[int]], max_tokens: int) -> float | None:
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
