"""A generator set up for a set of speculation arms (the tuner's): the drafters and draft room they need, and
each arm warmed up before real work.

Only the drafters some arm drafts with are held, because a held drafter observes every commit: plain
decoding (arms ["off"]) pays for no n-gram tables. An EAGLE head is built only when the caller says one is
worth holding (it starts trained or will be trained online); without it, eagle and hybrid arms never run,
and "self" (it replays recordings, which only benchmarks have) never does. The deepest speculative arm's
verify budget sizes the generator's draft buffers. The warm-up decodes synthetic requests with each arm and
captures every CUDA graph each can meet, so a real step pays no first touches; the EAGLE head's draft
vocabulary counts none of those tokens. The arms' grammar: `tuner_config.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from slipstream.engine.drafters import Drafter, EagleDrafter, NGramDrafter, SuffixDrafter
from slipstream.engine.generator import Generator
from slipstream.engine.history import HistoryConfig
from slipstream.engine.speculator import COMPOSITE, SpecMode, capture_graphs, warm_up
from slipstream.engine.tuner_config import Arm

__all__ = ["held_drafters", "max_draft", "runnable_methods", "warm_up_arms"]


def held_drafters(
    arms: Sequence[Arm],
    *,
    device: torch.device,
    eagle: Callable[[], EagleDrafter] | None,
    history: HistoryConfig | None = None,
) -> dict[str, Drafter]:
    """The drafters `arms` draft with, by method: "ngram" (on `device`) if an arm drafts n-grams (or the
    hybrid), "history" as `history` says (defaults if None) if an arm drafts from it (or the cascade), "eagle"
    built by `eagle` if an arm runs a head (or a composite) and a head is worth holding (`eagle` given)."""
    methods = {arm.method for arm in arms}
    needs = methods | {part for m in methods & set(COMPOSITE) for part in COMPOSITE[m]}
    head = eagle() if eagle is not None and "eagle" in needs else None
    drafters: dict[str, Drafter] = {}
    if "ngram" in needs:
        drafters["ngram"] = NGramDrafter(device=device)
    if "history" in needs:
        cfg = history if history is not None else HistoryConfig()
        drafters["history"] = SuffixDrafter(
            cfg.build(),
            max_extend=cfg.max_extend,
            growth=cfg.growth,
            head_depth=cfg.head_depth,
            head_below=cfg.head_below,
            device=device,
        )
    if head is not None:
        drafters["eagle"] = head
    return drafters


def max_draft(arms: Sequence[Arm]) -> int:
    """The deepest speculative arm's verify budget: the draft room the generator allocates (0: none)."""
    return max((arm.spec().verify_budget for arm in arms if arm.method != "off"), default=0)


def runnable_methods(held: Collection[str]) -> set[str]:
    """The methods that can run on drafters `held`: "off" always, a composite (hybrid, cascade) with both of
    its parts."""
    return {"off", *held} | {m for m, parts in COMPOSITE.items() if set(parts) <= set(held)}


def warm_up_arms(
    generator: Generator, arms: Sequence[Arm], caps: Sequence[int], *, mode: SpecMode,
    eagle: EagleDrafter | None, num_requests: int, max_len: int,
) -> int:  # fmt: skip
    """Decodes `num_requests` synthetic requests for two iterations with each of `arms` (specs in `mode`),
    then captures every CUDA graph each can meet up to its batch cap (`caps`, one per arm). Returns the
    graphs captured (0 on the CPU)."""
    specs = [None if arm.method == "off" else arm.spec(mode) for arm in arms]
    if eagle is not None:
        eagle.vocab.frozen = True
    try:
        warm_up(generator, specs, num_requests=num_requests, max_len=max_len)
    finally:
        if eagle is not None:
            eagle.vocab.frozen = False
    return capture_graphs(generator, list(zip(specs, caps, strict=True)), eagle)
