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

from slipstream.engine.drafters import Drafter, EagleDrafter, NGramDrafter
from slipstream.engine.generator import Generator
from slipstream.engine.speculator import SpecMode, capture_graphs, warm_up
from slipstream.engine.tuner_config import Arm

__all__ = ["held_drafters", "max_draft", "runnable_methods", "warm_up_arms"]


def held_drafters(
    arms: Sequence[Arm], *, device: torch.device, eagle: Callable[[], EagleDrafter] | None
) -> dict[str, Drafter]:
    """The drafters `arms` draft with, by method: "ngram" (on `device`) if an arm drafts n-grams (or the
    hybrid), "eagle" built by `eagle` if an arm runs a head (or the hybrid) and a head is worth holding
    (`eagle` given)."""
    methods = {arm.method for arm in arms}
    head = eagle() if eagle is not None and methods & {"eagle", "hybrid"} else None
    drafters: dict[str, Drafter] = {}
    if methods & {"ngram", "hybrid"}:
        drafters["ngram"] = NGramDrafter(device=device)
    if head is not None:
        drafters["eagle"] = head
    return drafters


def max_draft(arms: Sequence[Arm]) -> int:
    """The deepest speculative arm's verify budget: the draft room the generator allocates (0: none)."""
    return max((arm.spec().verify_budget for arm in arms if arm.method != "off"), default=0)


def runnable_methods(held: Collection[str]) -> set[str]:
    """The methods that can run on drafters `held`: "off" always, "hybrid" with both n-gram and EAGLE."""
    return {"off", *held} | ({"hybrid"} if {"ngram", "eagle"} <= set(held) else set())


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
