"""Periodic averaging of one drafter over several ranks, as tensor operations (docs/actors.md).

Rank 0 owns the global drafter. Every other rank trains a local copy and sends, every few steps, the
delta local − base, where base is the global weights it last adopted (then base = local). The owner folds
a delta in as global += delta / n, n being the ranks training now: a rank counts as training while its
next delta is expected (about one interval after its last; after twice that plus a second it no longer
does), so a rank that stopped does not keep shrinking the others' steps. A rank adopts the global weights
as local = global + (local − base): what it trained and has not sent yet is carried over, not lost;
with nothing unsent, it copies them exactly (then its weights equal the owner's bitwise).
Pure functions of tensors plus one small table: the drafter actor sends and receives the messages.
"""

from __future__ import annotations

import torch

from slipstream.engine.weight_receiver import mistyped


def take_delta(
    weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor], names: list[str]
) -> list[torch.Tensor]:
    """local − base per name, as new host tensors (safe to send zero-copy); then base = local."""
    deltas = []
    with torch.no_grad():
        for name in names:
            deltas.append((weights[name] - base[name]).cpu())
            base[name].copy_(weights[name])
    return deltas


def fold_delta(
    weights: dict[str, torch.Tensor], names: list[str], deltas: list[torch.Tensor], ranks: int
) -> None:
    """The owner's global += delta / ranks, in place (`weights`: views of the parameters)."""
    with torch.no_grad():
        for name, delta in zip(names, deltas, strict=True):
            weights[name].add_(delta.to(weights[name].device), alpha=1.0 / ranks)


def adopt(
    weights: dict[str, torch.Tensor],
    base: dict[str, torch.Tensor],
    names: list[str],
    tensors: list[torch.Tensor],
    *,
    exact: bool,
) -> None:
    """local = global (`exact`), else local = global + (local − base); then base = global. In place."""
    with torch.no_grad():
        for name, received in zip(names, tensors, strict=True):
            new = received.to(weights[name].device)
            if exact:
                weights[name].copy_(new)
            else:
                weights[name].add_(new - base[name])
            base[name].copy_(new)


def check_weights(
    names: list[str],
    tensors: list[torch.Tensor],
    shapes: dict[str, tuple[torch.Size, torch.dtype]],
) -> str | None:
    """None if names/shapes/dtypes are exactly the head's trainable weights (`shapes`, its names sorted)
    and every value is finite; else why not."""
    expected = sorted(shapes)
    if names != expected:
        return f"names {names[:3]}… ({len(names)}) are not the head's {len(expected)} weights"
    why = mistyped(names, tensors, shapes)
    if why is not None:
        return why
    for name, t in zip(names, tensors, strict=True):
        if not bool(torch.isfinite(t).all()):
            return f"{name}: non-finite values"
    return None


class TrainingRanks:
    """The owner's view of which other ranks are training now: n in global += delta / n."""

    def __init__(self) -> None:
        self.until: dict[str, float] = {}  # rank -> monotonic time until which it counts as training
        self.last_delta_at: dict[str, float] = {}

    def heard(self, rank: str, now: float, *, steps: int, elapsed_s: float, final: bool) -> None:
        """A delta from `rank` at `now`: `final` (its lease ended) stops it counting; one with steps
        extends it to twice the gap since its previous delta (+ 1 s), `elapsed_s` standing in for a first."""
        if final:
            self.until.pop(rank, None)
            self.last_delta_at.pop(rank, None)
        elif steps:
            gap = now - self.last_delta_at.get(rank, now - elapsed_s)
            self.last_delta_at[rank] = now
            self.until[rank] = now + 2.0 * gap + 1.0

    def count(self, now: float, *also: str) -> int:
        """n: the ranks training at `now`, with `also` (the sender, the owner itself); at least one."""
        active = {rank for rank, until in self.until.items() if until > now} | set(also)
        return max(1, len(active))


__all__ = ["TrainingRanks", "adopt", "check_weights", "fold_delta", "take_delta"]
