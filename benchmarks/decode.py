"""Decode benchmark: plain vs speculative tokens/s at batch 1/4/16/32, measured side by side in one run.

    slipstream bench decode --json                                    # smollm2-135m, the full run
    slipstream bench decode --drafter DIR --batches 1,4 --json        # with eagle rows
    slipstream bench decode --model DIR --batches 1 --max-tokens 16 --repeats 1 --json   # a quick one

Workload (DESIGN §11): B prompts of exactly 64 tokens of "think step by step" questions through the chat
template, 256 new tokens each at temperature 1 with EOS ignored, so every config decodes the same number
of tokens. Rows per batch size: plain, n-gram chains and a tree, self-draft (the oracle: the target's own
recorded output, replayed in reproducible mode, the engine's mechanical ceiling) and, with --drafter, a
trained EAGLE head's chains and tree. The non-obvious choice: the configs of one batch size advance one
decode iteration each in turn, so drift and the neighbours' load hit every config alike. The result is
`DecodeResult` (fields documented there); workload details and figures: docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from slipstream.engine import eagle_export, hub
from slipstream.engine.device import require_device
from slipstream.engine.drafters import Drafter, NGramDrafter, OracleDrafter
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.generator import Completion, Generator, Request
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig, capture_graphs
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weights import load_model
from slipstream.tasks.datasets import reasoning_gym_rows

__all__ = [
    "ARMS",
    "EAGLE_ARMS",
    "Arm",
    "DecodeResult",
    "DecodeRow",
    "Tally",
    "bench_prompts",
    "bench_requests",
    "interleaved_round",
    "record_outputs",
    "render",
    "run",
]

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_BATCHES = (1, 4, 16, 32)
INSTRUCTION = (
    "Think it through step by step: restate what is asked, work out every intermediate result, check "
    "the arithmetic twice, explain each step in plain words, and give the final answer on its own line."
)
SENTINEL = "\x00CONTENT\x00"


@dataclass(frozen=True)
class Arm:
    """One benchmark config: a drafter and a tree shape."""

    spec: str
    """"off" (plain), "ngram", "self" or "eagle"."""
    depth: int = 0
    topk: int = 0
    verify: int = 0

    @property
    def mode(self) -> str | None:
        """Verification mode; None for plain decoding (nothing to verify)."""
        if self.spec == "off":
            return None
        # The oracle is only meaningful when its replay can be accepted in full (docs/benchmarks.md).
        return "reproducible" if self.spec == "self" else "rejection"

    @property
    def label(self) -> str:
        return self.spec if self.spec == "off" else f"{self.spec} d{self.depth} k{self.topk} v{self.verify}"


ARMS = (
    Arm("off"),
    Arm("ngram", 3, 1, 3),
    Arm("ngram", 7, 1, 7),
    Arm("ngram", 4, 4, 16),
    Arm("self", 3, 1, 3),
    Arm("self", 7, 1, 7),
)
EAGLE_ARMS = (Arm("eagle", 3, 1, 3), Arm("eagle", 5, 1, 5), Arm("eagle", 7, 1, 7), Arm("eagle", 4, 4, 16))
"""Rows added with --drafter DIR (a trained EAGLE head, rejection verification like the n-gram rows)."""


# -- result --------------------------------------------------------------------------------------------


class DecodeRow(msgspec.Struct, frozen=True, kw_only=True):
    """One config at one batch size."""

    batch: int  # requests decoded together
    spec: str  # drafter: "off" (plain), "ngram", "self" (oracle) or "eagle"
    depth: int  # draft depth (0 for plain)
    topk: int  # children per draft-tree node; 1 = a chain
    verify: int  # draft nodes verified per target pass
    mode: str | None  # verification: "rejection" or "reproducible"; None for plain
    tokens_per_s: float  # median over the rounds of tokens / the config's own iteration seconds
    tokens_per_s_rounds: list[float]  # every round's figure
    ratio: float | None  # tokens_per_s / plain's at this batch size (None without a plain row)
    accept_length: float | None  # tokens per target pass over every round (1.0 for plain)
    drafted: int  # draft tokens proposed, every round
    accepted: int  # draft tokens accepted, every round


class DecodeResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `bench decode --json` prints."""

    model: str  # the model as named on the command line
    threads: int  # torch threads
    rows: list[DecodeRow]  # batch size by batch size, configs in ARMS order (then EAGLE_ARMS)
    batches: list[int]
    prompt_tokens: int  # tokens per prompt, exactly
    max_tokens: int  # new tokens per request, exactly (EOS ignored)
    temperature: float
    repeats: int  # interleaved rounds per batch size
    prompt_source: str  # where the prompts came from (reasoning-gym tasks, built-in problems, random ids)
    ignore_eos: bool  # always true: every config decodes the same tokens
    torch: str  # torch version
    self_mode: str  # how the self-draft (oracle) rows are verified
    timing: str  # how a config's time is taken
    drafter: str | None  # the EAGLE head behind the eagle rows (None: no eagle rows)
    device: str = "cpu"  # where the model ran
    wall_s: float  # the whole run, seconds


# -- prompts -------------------------------------------------------------------------------------------


def _questions(count: int, seed: int) -> tuple[list[tuple[str, str]], str]:
    """About `count` (source, question) pairs per task, interleaved, and the family they come from."""
    try:
        import reasoning_gym  # noqa: F401  (the fallback below runs without it)
    except ImportError:
        rng = random.Random(seed)
        templates = (
            "A shop has {a} boxes of {b} pencils and sells {c} pencils. How many pencils are left?",
            "Tom reads {a} pages a day for {b} days, then {c} pages more. How many pages did he read?",
            "A train goes {a} km per hour for {b} hours and then {c} km more. How far does it go?",
            "Calculate {a} * {b} - {c}.",
        )
        return [
            (
                "builtin",
                rng.choice(templates).format(
                    a=rng.randint(2, 99), b=rng.randint(2, 30), c=rng.randint(1, 99)
                ),
            )
            for _ in range(count)
        ], "builtin arithmetic word problems"
    # Tasks whose questions mostly fit the ~30 tokens a 64-token chat prompt leaves for the user turn.
    tasks = ("basic_arithmetic", "chain_sum", "simple_equations", "lcm")
    per_task = [[(t, row.question) for row in reasoning_gym_rows(t, count, seed)] for t in tasks]
    return [q for group in zip(*per_task, strict=True) for q in group], "reasoning-gym"


def bench_prompts(
    tokenizer: Tokenizer | None, count: int, length: int, *, vocab: int, seed: int = 0
) -> tuple[list[list[int]], str]:
    """`count` prompts of exactly `length` ids, and a description of where they came from."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (count, length), generator=gen)
        return ids.tolist(), "random ids (the model directory has no tokenizer)"
    text = tokenizer.render_chat([{"role": "user", "content": SENTINEL}])
    head, tail = text.split(SENTINEL)
    head_ids = tokenizer.encode(head, add_special_tokens=False)
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)
    room = length - len(head_ids) - len(tail_ids)
    if room < 8:
        raise ValueError(f"the chat template alone takes {length - room} of the {length} prompt tokens")
    candidates = count
    while True:
        questions, family = _questions(candidates, seed)
        prompts: list[list[int]] = []
        used: set[str] = set()
        for task, question in questions:
            # Keep the question whole; the instruction after it is what gets cut to fit.
            if len(tokenizer.encode(question, add_special_tokens=False)) > room - 4:
                continue
            body = tokenizer.encode(f"{question}\n{INSTRUCTION}", add_special_tokens=False)
            if len(body) >= room:
                prompts.append(head_ids + body[:room] + tail_ids)
                used.add(task)
            if len(prompts) == count:
                return prompts, f"{family} ({', '.join(sorted(used))})"
        if candidates > 64 * count:
            raise ValueError(f"could not build {count} prompts of {length} tokens from {family}")
        candidates *= 4


# -- measurement ---------------------------------------------------------------------------------------


@dataclass
class Tally:
    """One config's totals over one round."""

    seconds: float = 0.0
    tokens: int = 0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, completion: Completion) -> None:
        self.tokens += len(completion.token_ids)
        self.passes += completion.target_passes
        self.drafted += completion.drafted
        self.accepted += completion.accepted


def bench_requests(prompts: Sequence[list[int]], max_tokens: int, temperature: float = 1.0) -> list[Request]:
    # Seed i for prompt i whatever the batch: the recording run and every config see the same requests.
    return [
        Request(
            request_id=f"p{i}",
            prompt_ids=ids,
            params=SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens),
        )
        for i, ids in enumerate(prompts)
    ]


def _generator(
    model: Transformer,
    requests: list[Request],
    arm: Arm,
    recorded: dict[str, list[int]],
    drafter_dir: Path | None = None,
    *,
    static: bool | None = None,
) -> Generator:
    # max_batch: every request at once. for_requests' default (32) would decode a larger batch in waves of
    # 32, as `bench gpu`'s large-batch rows once did (docs/gpu.md). share_prompts off: a
    # row's prompts may repeat, and shared ones would join the decode batch a pass after the first.
    if arm.spec == "off":
        gen = Generator.for_requests(
            model, requests, max_batch=len(requests), eos_token_ids=(), share_prompts=False, static=static
        )
        capture_graphs(
            gen, [(None, len(requests))]
        )  # untimed: a capture on first use was timed (docs/gpu.md)
        return gen
    spec = SpecConfig(method=arm.spec, depth=arm.depth, topk=arm.topk, verify=arm.verify, mode=arm.mode)  # type: ignore[arg-type]
    drafter: Drafter
    if arm.spec == "eagle":
        assert drafter_dir is not None
        drafter = eagle_export.load(drafter_dir, model)
    elif arm.spec == "self":
        drafter = OracleDrafter(recorded, device=model.lm_head_weight.device)
    else:
        drafter = NGramDrafter(device=model.lm_head_weight.device)
    gen = Generator.for_requests(
        model,
        requests,
        max_batch=len(requests),
        spec=spec,
        drafters={arm.spec: drafter},
        eos_token_ids=(),
        share_prompts=False,
        static=static,
    )
    capture_graphs(gen, [(spec, len(requests))], drafter if isinstance(drafter, EagleDrafter) else None)
    return gen


def interleaved_round(
    model: Transformer,
    requests: list[Request],
    arms: Sequence[Arm],
    recorded: dict[str, list[int]],
    drafter_dir: Path | None = None,
) -> list[Tally]:
    """Every arm decodes `requests` once, one iteration each in turn; returns each arm's totals."""
    gens = [_generator(model, requests, arm, recorded, drafter_dir) for arm in arms]
    tallies = [Tally() for _ in arms]
    for gen in gens:
        for request in requests:
            gen.add(request)
    live = list(range(len(arms)))
    gc.collect()
    gc.disable()  # a collection inside one config's iteration would be charged to that config alone
    try:
        while live:
            for a in list(live):
                started = time.perf_counter()
                outputs = gens[a].step()
                tallies[a].seconds += time.perf_counter() - started
                for output in outputs:
                    if output.completion is not None:
                        tallies[a].add(output.completion)
                if not gens[a].has_unfinished():
                    live.remove(a)
    finally:
        gc.enable()
    return tallies


def record_outputs(model: Transformer, requests: list[Request]) -> dict[str, list[int]]:
    """Plain outputs (prompt + response) by request id, for the self-draft oracle; also the warm-up."""
    gen = Generator.for_requests(model, requests, max_batch=len(requests), eos_token_ids=())
    return {c.request_id: [*c.prompt_ids, *c.token_ids] for c in gen.generate(requests)}


def _check_workload(
    *, temperature: float, batches: Sequence[int], threads: int | None, **positive: int
) -> None:
    """A ValueError naming the first argument of `run` out of its range."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not batches or min(batches) < 1:
        raise ValueError(f"batches must be positive, got {list(batches)}")
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")


def _measured_rounds(
    target: Transformer,
    requests: list[Request],
    arms: Sequence[Arm],
    *,
    repeats: int,
    drafter: Path | None,
    say: Callable[[str], None],
) -> list[list[Tally]]:
    """One batch size's `repeats` interleaved rounds (each a Tally per arm), after the untimed plain run
    the self-draft rows replay."""
    batch = len(requests)
    t0 = time.perf_counter()
    recorded = record_outputs(target, requests)
    say(f"batch {batch}: recorded the plain run for self-draft in {time.perf_counter() - t0:.1f} s")
    rounds: list[list[Tally]] = []
    for r in range(repeats):
        t0 = time.perf_counter()
        rounds.append(interleaved_round(target, requests, arms, recorded, drafter))
        rates = ", ".join(
            f"{arm.label} {t.tokens / t.seconds:.0f}" for arm, t in zip(arms, rounds[-1], strict=True)
        )
        say(f"batch {batch} round {r + 1}/{repeats} ({time.perf_counter() - t0:.0f} s): {rates} tok/s")
    return rounds


def _rows(batch: int, arms: Sequence[Arm], rounds: list[list[Tally]]) -> list[DecodeRow]:
    """One batch size's rows: each arm's median rate over the rounds, its ratio to plain's, its totals."""
    medians = [statistics.median(rd[a].tokens / rd[a].seconds for rd in rounds) for a in range(len(arms))]
    plain = medians[[arm.spec for arm in arms].index("off")] if any(a.spec == "off" for a in arms) else None
    rows = []
    for a, arm in enumerate(arms):
        tokens = sum(rd[a].tokens for rd in rounds)
        passes = sum(rd[a].passes for rd in rounds)
        rows.append(
            DecodeRow(
                batch=batch,
                spec=arm.spec,
                depth=arm.depth,
                topk=arm.topk,
                verify=arm.verify,
                mode=arm.mode,
                tokens_per_s=round(medians[a], 2),
                tokens_per_s_rounds=[round(rd[a].tokens / rd[a].seconds, 2) for rd in rounds],
                ratio=round(medians[a] / plain, 3) if plain else None,
                accept_length=round(tokens / passes, 3) if passes else None,
                drafted=sum(rd[a].drafted for rd in rounds),
                accepted=sum(rd[a].accepted for rd in rounds),
            )
        )
    return rows


def _eagle_dir(drafter: Path) -> Path:
    """--drafter's directory: a shipped drafter's name or a directory; a ValueError naming it otherwise."""
    try:
        return hub.drafter_dir(drafter)
    except ValueError as exc:
        raise ValueError(f"--drafter {drafter}: not an exported EAGLE drafter: {exc}") from None


def run(
    model: str | None = None,
    *,
    batches: Sequence[int] = DEFAULT_BATCHES,
    max_tokens: int = 256,
    repeats: int = 1,
    prompt_tokens: int = 64,
    threads: int | None = None,
    arms: Sequence[Arm] = ARMS,
    log: bool = True,
    drafter: Path | None = None,
    temperature: float = 1.0,
    device: str = "cpu",
) -> DecodeResult:
    """Run the benchmark (see the module docstring). drafter: an exported EAGLE head; its rows
    (`EAGLE_ARMS`) are added to `arms`. temperature: of every request (> 0: the oracle rows need a
    sampled, keyed run to replay; a head trained at T = 0.7 is best measured there)."""
    _check_workload(temperature=temperature, batches=batches, threads=threads, max_tokens=max_tokens,
                    repeats=repeats, prompt_tokens=prompt_tokens)  # fmt: skip
    if threads is not None:
        torch.set_num_threads(threads)
    if drafter is not None:
        drafter = _eagle_dir(drafter)
        arms = [*arms, *EAGLE_ARMS]
    started = time.perf_counter()
    name = model or DEFAULT_MODEL
    path = hub.resolve(name)
    target = load_model(path, device=require_device(device, field="--device"))
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    prompts, source = bench_prompts(tokenizer, max(batches), prompt_tokens, vocab=target.config.vocab_size)

    def say(message: str) -> None:
        if log:
            print(f"bench decode: {message}", file=sys.stderr, flush=True)

    say(f"{name}, {torch.get_num_threads()} threads, prompts from {source}")
    rows: list[DecodeRow] = []
    for batch in batches:
        requests = bench_requests(prompts[:batch], max_tokens, temperature)
        rounds = _measured_rounds(target, requests, arms, repeats=repeats, drafter=drafter, say=say)
        rows += _rows(batch, arms, rounds)
    return DecodeResult(
        model=name,
        threads=torch.get_num_threads(),
        rows=rows,
        batches=list(batches),
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        temperature=temperature,
        repeats=repeats,
        prompt_source=source,
        ignore_eos=True,
        torch=str(torch.__version__),  # a str subclass msgspec does not encode
        self_mode="reproducible: the oracle replays an untimed plain run with the same seeds",
        timing="configs interleaved per iteration; median tokens/s over repeats; prefill included",
        drafter=None if drafter is None else str(drafter),
        device=str(target.lm_head_weight.device),
        wall_s=round(time.perf_counter() - started, 1),
    )


def render(result: DecodeResult) -> str:
    """A readable table of `run`'s result."""
    lines = [f"{result.model}  threads={result.threads}  prompts: {result.prompt_source}"]
    lines.append(f"{'batch':>5}  {'config':<18} {'mode':<12} {'tok/s':>8} {'ratio':>6} {'accept':>6}")
    for row in result.rows:
        arm = Arm(row.spec, row.depth, row.topk, row.verify)
        ratio = "" if row.ratio is None else f"{row.ratio:.2f}"
        accept = "" if row.accept_length is None else f"{row.accept_length:.2f}"
        lines.append(
            f"{row.batch:>5}  {arm.label:<18} {row.mode or '-':<12} {row.tokens_per_s:>8.1f} "
            f"{ratio:>6} {accept:>6}"
        )
    return "\n".join(lines)
