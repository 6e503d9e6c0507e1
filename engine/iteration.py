"""One timed decode iteration of a `Generator`: its outputs and what it did, for the tuner and the stats.

A rollout runs `timed_step(generator)` once per iteration and reports the `Iteration` (its batch, prefill,
committed, drafted and accepted tokens, per draft depth what was offered and accepted, its clock) as an
`IterationStats` message and spans; the tuner is rewarded with `committed / seconds` where no prefill ran.
The counters are the generator's running totals, so this takes differences around one `step()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from slipstream.engine.generator import Generator
from slipstream.engine.request import StepOutput

__all__ = ["Iteration", "timed_step"]


@dataclass(frozen=True)
class Iteration:
    batch: int  # sequences decoding when it began
    prefilling: int  # sequences with a prefill chunk in it
    prefill_tokens: int
    started_ns: int  # time.monotonic_ns()
    ended_ns: int
    seconds: float  # perf_counter: what the tuner is rewarded by
    committed: int
    drafted: int
    accepted: int
    offered_at: list[int]  # per draft depth: sequence-passes whose draft reached it
    accepted_at: list[int]  # of those, accepted there
    draft_ns: int  # of it, drafting (0: a plain iteration)


def _diff(after: list[int], before: list[int]) -> list[int]:
    return [n - (before[d] if d < len(before) else 0) for d, n in enumerate(after)]


def timed_step(generator: Generator) -> tuple[list[StepOutput], Iteration]:
    """`generator.step()` and what it did."""
    batch, prefilling = generator.num_decoding, generator.num_prefilling
    before = generator.stats
    offered_before, accepted_before = generator.position_stats
    started_ns, started = time.monotonic_ns(), time.perf_counter()
    outputs = generator.step()
    seconds = time.perf_counter() - started
    ended_ns = time.monotonic_ns()
    after = generator.stats
    offered_after, accepted_after = generator.position_stats
    return outputs, Iteration(
        batch=batch,
        prefilling=prefilling,
        prefill_tokens=generator.last_prefill_tokens,
        started_ns=started_ns,
        ended_ns=ended_ns,
        seconds=seconds,
        committed=after["committed"] - before["committed"],
        drafted=after["drafted"] - before["drafted"],
        accepted=after["accepted"] - before["accepted"],
        offered_at=_diff(offered_after, offered_before),
        accepted_at=_diff(accepted_after, accepted_before),
        draft_ns=generator.last_draft_ns,
    )
