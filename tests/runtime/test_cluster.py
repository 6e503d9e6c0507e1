"""runtime/cluster.py: a node's place in a run from flags and the torchrun/SLURM environment, the ports
derived from the head's, the run's key file, the interface gloo must bind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slipstream.runtime.cluster import (
    AGENTS,
    CONTROL,
    RENDEZVOUS,
    Cluster,
    first_host,
    interface_of,
    node_env,
    resolve_cluster,
    run_keys,
)


def test_first_host_of_a_slurm_node_list() -> None:
    assert first_host("gpu[03-05,9],cpu1") == "gpu03"
    assert first_host("node7") == "node7"
    assert first_host("a[1-2]-b[07-09]") == "a1-b07"
    assert first_host("10.0.0.1,10.0.0.2") == "10.0.0.1"
    with pytest.raises(ValueError, match="not a node list"):
        first_host("[")


def test_flags_first_then_torchrun_then_slurm_names() -> None:
    assert resolve_cluster(env={}) == Cluster()  # one node: nothing else to know
    c = resolve_cluster(nnodes=2, node_rank=0, head="10.1.2.3:31000", env={})
    assert (c.nnodes, c.node_rank, c.head_host, c.head_port, c.address) == (
        2,
        0,
        "10.1.2.3",
        31000,
        "10.1.2.3",
    )
    assert c.head_endpoint(CONTROL) == "tcp://10.1.2.3:31000" and c.port(AGENTS) == 31001
    assert c.head_endpoint(RENDEZVOUS) == "tcp://10.1.2.3:31003" and c.data_port(2) == 31018
    torchrun = resolve_cluster(
        env={"NNODES": "3", "NODE_RANK": "0", "MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "4000"}
    )
    assert (torchrun.nnodes, torchrun.node_rank, torchrun.head_host, torchrun.head_port) == (
        3,
        0,
        "10.9.9.9",
        4000,
    )
    slurm = resolve_cluster(
        env={"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "10.5.5.[1-2]"}
    )
    assert (slurm.nnodes, slurm.head_host, slurm.head_port) == (2, "10.5.5.1", 29500)


def test_bad_clusters_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--node-rank: 2 is not in"):
        resolve_cluster(nnodes=2, node_rank=2, head="10.0.0.1:29500", env={})
    with pytest.raises(ValueError, match="--head: a run on 2 nodes needs"):
        resolve_cluster(nnodes=2, node_rank=0, env={})
    with pytest.raises(ValueError, match="loopback"):
        resolve_cluster(nnodes=2, node_rank=0, head="127.0.0.1:29500", env={})
    with pytest.raises(ValueError, match="NNODES: 'two' is not an integer"):
        resolve_cluster(env={"NNODES": "two"})


def test_node_0_makes_a_fresh_private_key_each_start_and_others_read_it(tmp_path: Path) -> None:
    first, path = run_keys(tmp_path, keys_dir=None, create=True)
    assert path == tmp_path / "keys" / "run.key" and (path.stat().st_mode & 0o777) == 0o600
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    assert run_keys(tmp_path, keys_dir=None, create=False)[0] == first
    second, _ = run_keys(tmp_path, keys_dir=None, create=True)
    assert second != first  # a crashed attempt's key is not reused
    assert run_keys(tmp_path / "elsewhere", keys_dir=tmp_path / "keys", create=False)[0] == second
    with pytest.raises(ValueError, match=r"--keys: no run\.key"):
        run_keys(tmp_path, keys_dir=tmp_path / "nothing", create=False)


def test_gloo_is_told_the_interface_of_the_nodes_address(monkeypatch: pytest.MonkeyPatch) -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: no interface here holds it
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert node_env("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo"}
    assert node_env("") == {} and node_env("192.0.2.77") == {}
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    assert node_env("127.0.0.1") == {} and os.environ["GLOO_SOCKET_IFNAME"] == "eth9"  # the node's own wins
