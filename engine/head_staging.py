"""A drafter's copy of its target's head parts, updated from the learner's pushes between two steps.

The drafter holds only what the EAGLE head reads of the target (embedding, final norm, LM head when
untied). The learner's buckets of a version are staged here, by version, until every head part is in,
then copied in place into the held parameters: in place because the packed LM-head copies the drafter's
trainer keeps follow a tensor's version counter. Completion is judged by the parts, not by a bucket
count: the head's buckets lead a push to the rollouts (numbered over that whole push) or make a push of
their own (numbered over themselves). A version whose every bucket came without some part can never
complete and is refused. Completing a version drops older staged ones (they can no longer complete).
"""

from __future__ import annotations

import torch


class HeadStaging:
    """Staged buckets, version -> bucket -> {name: tensor}, of the head parts in `params` (held, not copied)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.staged: dict[int, dict[int, dict[str, torch.Tensor]]] = {}

    def drop(self, version: int) -> None:
        """Forgets what is staged of `version` (a refused bucket: it can no longer complete)."""
        self.staged.pop(version, None)

    def add(
        self, version: int, bucket: int, num_buckets: int, tensors: dict[str, torch.Tensor], *, owned: bool
    ) -> int | None:
        """Stages bucket `bucket` of `version`. Once every head part is in, copies them into the parameters
        and returns how many buckets the version took; None while it waits for more. `owned`: the tensors
        are this process's (decoded deltas), else they alias a received frame and a staged one is cloned
        (the completing bucket is copied once, into the parameters). Raises ValueError when every bucket of
        the push is in and a head part is still missing (the version is dropped)."""
        buckets = self.staged.setdefault(version, {})
        received = {n: t for staged in buckets.values() for n, t in staged.items()} | tensors
        if received.keys() != self.params.keys():
            if len(buckets) + (bucket not in buckets) == num_buckets:  # every bucket of the push
                del self.staged[version]
                raise ValueError(f"the buckets lack {sorted(self.params.keys() - received.keys())}")
            buckets[bucket] = tensors if owned else {n: t.clone() for n, t in tensors.items()}
            return None
        buckets[bucket] = tensors
        for older in [v for v in self.staged if v <= version]:
            del self.staged[older]  # this one, and older ones that can no longer complete
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(received[name])
        return len(buckets)


__all__ = ["HeadStaging"]
