"""Where a rollout's accepted weight buckets wait until their version is whole, and how it is applied.

`WeightReceiver` (engine/weight_receiver.py) decides about each bucket; this holds the accepted ones. A
version whose first bucket finds the rollout idle (the synchronous loop's case) is written straight into
the parameters bucket by bucket, with no staged copy (that copy was a model's worth of memory per
rollout), and the rollout decodes nothing until its last bucket is in (`writing`): no token comes from a
mix of two versions. A version that starts while requests are in flight is cloned and staged, and applied
once none is, so a response is never produced by two policies. A newer version written over a half-written
one supersedes it. Pure: the checksum functions come in (runtime's codec and cuda_ipc own them); the
rollout actor (actors/rollout.py) sends the acks, spans and logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["Applied", "StagedBucket", "WeightStaging"]

Checksum = Callable[[Sequence[str], Sequence[Tensor]], str]


@dataclass
class StagedBucket:
    """One accepted bucket: its tensors (empty once written in place: only what verifies it stays)."""

    names: list[str]
    tensors: list[Tensor]
    checksum: str
    device_hashed: bool = False  # its checksum is the GPU's (a CUDA IPC bucket), not the codec's


@dataclass(frozen=True)
class Applied:
    """A version applied: when its first bucket arrived (monotonic ns) and, if verified, the buckets whose
    applied weights do not hash to the learner's checksum."""

    version: int
    first_bucket_ns: int | None
    differing: list[int] = field(default_factory=list)


class WeightStaging:
    """See the module docstring. `model` has `write_parameter(name, tensor)` and `named_weights()`."""

    def __init__(self, model: Any, checksum: Checksum, device_checksum: Checksum) -> None:
        self.model, self.checksum, self.device_checksum = model, checksum, device_checksum
        self.staged: dict[int, dict[int, StagedBucket]] = {}  # version -> bucket -> what is kept of it
        self.ready: int | None = None  # a complete, verified version waiting for a drained queue
        self.writing: int | None = None  # a version being written into the parameters: no decoding
        self._first_ns: dict[int, int] = {}  # version -> its first bucket's arrival

    def superseded(self, version: int) -> bool:
        """A newer version is being written over `version` already (a re-push after a learner restart)."""
        return self.writing is not None and version < self.writing

    def add(
        self, version: int, bucket: int, num_buckets: int, names: Sequence[str], tensors: Sequence[Tensor],
        checksum: str, *, device_hashed: bool, owned: bool, busy: bool,
    ) -> bool:  # fmt: skip
        """Keeps (or writes in place) one accepted bucket; True when its version is complete and can be
        applied now (written in place, or nothing in flight: `busy` says whether requests are). `owned`:
        the tensors are the caller's own (decoded), not aliases of a received frame."""
        self._first_ns.setdefault(version, time.monotonic_ns())
        buckets = self.staged.setdefault(version, {})
        if self.writing is not None or (len(buckets) == 0 and not busy):
            self.writing = version
            for name, tensor in zip(names, tensors, strict=True):
                self.model.write_parameter(name, tensor)
            kept: list[Tensor] = []
        else:
            # Clone: received tensors alias a frame or shared-memory slot that is recycled after the handler.
            kept = list(tensors) if owned else [t.clone() for t in tensors]
        buckets[bucket] = StagedBucket(list(names), kept, checksum, device_hashed)
        if len(buckets) < num_buckets:
            return False
        for old in [v for v in self.staged if v < version]:
            del self.staged[old]
        self.ready = version
        return self.writing == version or not busy

    def apply(self, *, verify: bool) -> Applied:
        """Writes the ready version's staged buckets; with `verify`, hashes what decoding now reads."""
        version = self.ready
        assert version is not None
        buckets = self.staged.pop(version)
        for staged in buckets.values():
            if not staged.tensors:
                continue  # written in place on arrival
            for name, tensor in zip(staged.names, staged.tensors, strict=True):
                self.model.write_parameter(name, tensor)
        self.ready = self.writing = None
        differing: list[int] = []
        if verify:
            held = dict(self.model.named_weights())  # packed-only projections unpacked: what decoding uses
            for i, staged in buckets.items():
                hash_of = self.device_checksum if staged.device_hashed else self.checksum
                if hash_of(staged.names, [held[n] for n in staged.names]) != staged.checksum:
                    differing.append(i)
        first = self._first_ns.pop(version, None)
        for old in [v for v in self._first_ns if v < version]:
            del self._first_ns[old]
        return Applied(version, first, sorted(differing))
