"""The lease table (rl/leases.py): one drafter may hold several devices at once, as a CPU host's one
drafter does, and what it reclaims is its training device-seconds capped by its devices' idle windows."""

from __future__ import annotations

import pytest

from slipstream.rl.leases import LeaseTable


def test_one_drafter_holds_the_idle_devices_of_several_rollouts() -> None:
    table = LeaseTable(
        drafter_of={"rollout:0": "drafter:0", "rollout:1": "drafter:0", "rollout:2": "drafter:0"},
        cpus_of={"rollout:0": [0], "rollout:1": [1], "rollout:2": [0]},
    )
    table.begin_step()
    first = table.idle("rollout:0", 10.0, grant=True)
    second = table.idle("rollout:1", 12.0, grant=True)
    assert first is not None and second is not None
    assert [first[0], second[0]] == ["drafter:0", "drafter:0"]
    assert (first[1].device, first[1].cpus, second[1].device, second[1].cpus) == (
        "rollout:0",
        [0],
        "rollout:1",
        [1],
    )
    assert table.idle("rollout:0", 13.0, grant=True) is None  # once per step
    assert table.leased("drafter:0") == [first[1].lease_id, second[1].lease_id]
    assert table.unsettled(["rollout:0", "rollout:1", "rollout:2"]) == ["drafter:0", "rollout:2"]
    # The last completion preempts both leases, each by its id.
    assert [(d, p.lease_id) for d, p in table.preempts("rollout done")] == [
        ("drafter:0", first[1].lease_id),
        ("drafter:0", second[1].lease_id),
    ]
    table.released("drafter:0", first[1].lease_id, 5.0)
    assert table.leased("drafter:0") == [second[1].lease_id]  # the other lease holds on
    table.stats("drafter:0", 3.0)
    table.released("drafter:0", second[1].lease_id, 7.0)
    assert table.unsettled(["rollout:0", "rollout:1"]) == ["drafter:0"]  # its stats after the last release
    table.stats("drafter:0", 6.0)
    assert table.unsettled(["rollout:0", "rollout:1"]) == []
    account = table.account(ended=14.0)
    # Idle windows 4 s + 2 s; 6 device-seconds trained since its first lease: all of it reclaimed.
    assert account.idle_device_s == pytest.approx(6.0) and account.reclaimed_s == pytest.approx(6.0)
    assert account.preempt_ms == [5.0, 7.0]


def test_reclaimed_time_is_capped_by_the_idle_windows_and_a_dead_drafter_counts_nothing() -> None:
    table = LeaseTable(drafter_of={"rollout:0": "drafter:0", "rollout:1": "drafter:0"})
    table.stats("drafter:0", 100.0)  # trained in earlier steps: not this step's
    table.begin_step()
    granted = table.idle("rollout:0", 10.0, grant=True)
    assert granted is not None and granted[1].cpus == []  # no cores known: no pinning asked
    table.released("drafter:0", granted[1].lease_id, 1.0)
    table.stats("drafter:0", 109.0)  # 9 device-seconds, but rollout:0 idled only 3 s
    assert table.account(ended=13.0).reclaimed_s == pytest.approx(3.0)
    table.begin_step()
    granted = table.idle("rollout:1", 20.0, grant=True)
    assert granted is not None
    table.void("drafter:0")  # it died holding the lease
    assert table.leased("drafter:0") == [] and table.unsettled(["rollout:1"]) == []
    assert table.account(ended=25.0).reclaimed_s == 0.0
    # No lease while nothing else decodes, or for a dead drafter.
    table.begin_step()
    assert table.idle("rollout:0", 30.0, grant=False) is None
    assert table.idle("rollout:1", 30.0, grant=True, dead={"drafter:0"}) is None
