"""The ledger: who holds each (group, sample), results taken exactly once."""

from __future__ import annotations

import pytest

from slipstream.rl.ledger import Ledger


def test_results_are_taken_once_and_what_a_dead_actor_owed_is_known() -> None:
    ledger = Ledger()
    ledger.deal("rollout:0", [(0, 0), (0, 1), (1, 0)])
    ledger.deal("rollout:1", [(2, 0)])
    assert ledger.take((0, 1)) and not ledger.take((0, 1))  # the second copy is a duplicate
    assert not ledger.take((7, 0))  # never dealt: a stray from another step
    assert ledger.duplicates == 2
    assert ledger.held_by("rollout:0") == [(0, 0), (1, 0)] and ledger.outstanding == 3
    ledger.deal("rollout:0", ledger.held_by("rollout:0"), requeue=True)
    assert ledger.requeued == 2
    with pytest.raises(ValueError, match="back already"):
        ledger.deal("rollout:1", [(0, 1)])
