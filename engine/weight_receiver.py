"""The one weight receiver: what a rollout and a drafter decide about each bucket of a versioned push.

A push is `num_buckets` buckets of (names, tensors, checksum), in full or as XOR deltas against a base
version (engine/weight_delta.py). `WeightReceiver.receive` says, for one bucket, against the version held:
a `duplicate` (that version is held already: a restart's re-push), `dropped` (a delta of a version whose
deltas were refused, or a delta bucket decoded once already), `refused` (why; `want_full` for a delta,
so the pusher sends the version in full), or `accepted` with the bucket's full tensors (decoded where it
came as a delta). Names, shapes, dtypes and the checksum are checked after decoding, so a delta against
the wrong base fails as a checksum mismatch. Where the tensors go (staged, written in place) and when a
version is complete stay the actor's: a rollout waits for every bucket of the push, a drafter for every
head part. Pure: no sockets, no messages; the checksum function comes in (runtime's codec owns it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from slipstream.engine.weight_delta import apply_xor_delta

__all__ = ["Verdict", "WeightReceiver", "mistyped"]

XOR_ZSTD = "xor-zstd"
"""The delta encoding (protocols/learner.py names it for the wire: the same string)."""


@dataclass(frozen=True)
class Verdict:
    """What to do with one received bucket."""

    kind: Literal["accepted", "duplicate", "dropped", "refused"]
    tensors: list[Tensor] | None = None
    """accepted: the bucket's full tensors, in its names' order."""
    decoded: bool = False
    """accepted: `tensors` were decoded here (the receiver's own), not the message's (aliases of a frame)."""
    error: str | None = None
    """refused: why; dropped: why, for the log."""
    want_full: bool = False
    """refused delta: the version in full will do (said once per version)."""


@dataclass
class WeightReceiver:
    """Checks pushed buckets against the weights held: see the module docstring."""

    expected: Mapping[str, tuple[torch.Size, torch.dtype]]
    """name → (shape, dtype) of every tensor a push may carry."""
    base: Callable[[str], Tensor]
    """The tensor held for a name: what a delta decodes against."""
    checksum: Callable[[Sequence[str], Sequence[Tensor]], str]
    map_refs: Callable[[Sequence[str], Sequence[Any], Mapping[str, tuple[Any, Any]]], list[Tensor]] | None = (
        None
    )
    """Checks a bucket's GPU refs against `expected` and maps them (runtime's `cuda_ipc.map_refs`; ValueError
    naming a bad one); None: buckets that travel as refs are refused here."""
    device_checksum: Callable[[Sequence[str], Sequence[Tensor]], str] | None = None
    """The checksum of buckets mapped from the sender's GPU memory (runtime's `cuda_ipc.device_checksum`)."""
    version: int = 0
    """The version held (applied)."""
    held_as: str = "the loaded version {}"
    """How errors name the version held ("version 3 is not newer than the loaded version 4")."""
    holds: str = "this rollout holds v{}"
    """How a delta base mismatch names it ("against v2, this rollout holds v1")."""
    _accepted: dict[int, set[int]] = field(default_factory=dict)  # version → buckets accepted
    _delta_refused: set[int] = field(default_factory=set)  # versions whose deltas were refused

    def receive(
        self,
        *,
        version: int,
        bucket: int,
        num_buckets: int,
        names: Sequence[str],
        tensors: Sequence[Tensor],
        checksum: str,
        encoding: str = "",
        base_version: int = 0,
        ipc: Sequence[Any] = (),
    ) -> Verdict:
        """The verdict on one bucket (a pushed message's fields); an accepted bucket is remembered. `ipc`:
        the bucket's tensors as refs into the sender's GPU memory (then `tensors` is empty, `encoding` says
        so, and `checksum` is `device_checksum`'s): mapped here, once it is no duplicate."""
        if version == self.version:
            return Verdict("duplicate")
        on_device = bool(ipc)
        if on_device:
            mapped = self._map(names, tensors, ipc)
            if isinstance(mapped, Verdict):
                return mapped
            tensors, encoding = mapped, ""
        decoded = bool(encoding)
        if decoded:
            delta = self._decode(
                version, bucket, num_buckets, names, tensors, checksum, encoding, base_version
            )
            if isinstance(delta, Verdict):
                return delta
            tensors = delta
        elif (
            error := self._check(version, bucket, num_buckets, names, tensors, checksum, on_device)
        ) is not None:
            return Verdict("refused", error=error)
        self._accepted.setdefault(version, set()).add(bucket)
        return Verdict("accepted", tensors=list(tensors), decoded=decoded)

    def _map(
        self, names: Sequence[str], tensors: Sequence[Tensor], ipc: Sequence[Any]
    ) -> list[Tensor] | Verdict:
        """A bucket sent as refs into the sender's GPU memory, mapped here; or the verdict refusing it."""
        if self.map_refs is None or self.device_checksum is None or tensors:
            return Verdict("refused", error="a bucket as GPU refs, which this receiver cannot map")
        try:
            return self.map_refs(names, ipc, self.expected)
        except ValueError as exc:
            return Verdict("refused", error=str(exc))

    def _decode(
        self,
        version: int,
        bucket: int,
        num_buckets: int,
        names: Sequence[str],
        blobs: Sequence[Tensor],
        checksum: str,
        encoding: str,
        base_version: int,
    ) -> list[Tensor] | Verdict:
        """A delta bucket's full tensors, decoded against the weights held and checked; or the verdict
        dropping or refusing it (a refusal wants the version in full, and refuses its later deltas)."""
        if version in self._delta_refused:
            return Verdict("dropped", error="its version's deltas were refused")
        if version <= self.version:
            return Verdict(
                "refused",
                error=f"version {version} is not newer than {self.held_as.format(self.version)}",
            )
        if bucket in self._accepted.get(version, ()):
            # Decoding it again would XOR a base that may have been overwritten (in place) since.
            return Verdict("dropped", error="a delta bucket decoded once already")
        error = None
        tensors = blobs
        if encoding != XOR_ZSTD:
            error = f"unknown weight encoding {encoding!r}"
        elif base_version != self.version:
            error = f"delta base mismatch: against v{base_version}, {self.holds.format(self.version)}"
        elif (error := mistyped(names, blobs, self.expected, shapes=False)) is None:
            try:
                tensors = [apply_xor_delta(self.base(n), blob) for n, blob in zip(names, blobs, strict=True)]
            except ValueError as exc:
                error = f"undecodable delta: {exc}"
        if error is None:
            error = self._check(version, bucket, num_buckets, names, tensors, checksum)
        if error is not None:
            # A checksum mismatch after decoding: the bases differed. Either way the full version will do.
            self._delta_refused.add(version)
            return Verdict("refused", error=f"{error}; full weights wanted", want_full=True)
        return list(tensors)

    def applied(self, version: int) -> None:
        """A complete version was applied: it is the version held; what concerned it or older ones goes."""
        self.version = version
        self._accepted = {v: b for v, b in self._accepted.items() if v > version}
        self._delta_refused = {v for v in self._delta_refused if v > version}

    def forget(self, version: int) -> None:
        """A version that can no longer complete (a bucket of it refused): its accepted buckets go."""
        self._accepted.pop(version, None)

    def _check(
        self,
        version: int,
        bucket: int,
        num_buckets: int,
        names: Sequence[str],
        tensors: Sequence[Tensor],
        checksum: str,
        on_device: bool = False,
    ) -> str | None:
        if version <= self.version:
            return f"version {version} is not newer than {self.held_as.format(self.version)}"
        if bucket >= num_buckets:
            return f"out of range for num_buckets {num_buckets}"
        error = mistyped(names, tensors, self.expected)
        hasher = self.device_checksum if on_device else self.checksum
        if error is None and hasher is None:
            error = "a bucket mapped from GPU memory, and no device checksum to check it"
        elif error is None and hasher is not None and hasher(names, tensors) != checksum:
            error = "checksum mismatch"
        return error


def mistyped(
    names: Sequence[str],
    tensors: Sequence[Tensor],
    expected: Mapping[str, tuple[torch.Size, torch.dtype]],
    *,
    shapes: bool = True,
) -> str | None:
    """None if every name is one of `expected` (name → shape, dtype) and, with `shapes`, its tensor has that
    shape and dtype; else what is wrong."""
    if len(names) != len(tensors):
        return f"{len(names)} names for {len(tensors)} tensors"
    for name, t in zip(names, tensors, strict=True):
        if name not in expected:
            known = sorted(expected) if len(expected) <= 16 else f"the {len(expected)} parameters held"
            return f"{name!r} is not one of {known}"
        shape, dtype = expected[name]
        if shapes and (tuple(t.shape) != tuple(shape) or t.dtype != dtype):
            return f"{name}: got {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}"
    return None
