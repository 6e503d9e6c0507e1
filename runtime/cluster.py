"""A run across nodes: which node this is, where the head is, the ports derived from it, the run's keys.

The torchrun convention, which SLURM and ssh users know: the same command on every node,

    slipstream train CONFIG --nnodes 2 --node-rank R --head HOST:PORT

Node 0 (the head) runs the coordinator and its own actors; every other node runs a node agent
(runtime/agent.py). Every port is derived from the head's PORT, so nothing but HOST:PORT has to be passed
around: control PORT, agents PORT+1, live events PORT+2, the learner ranks' rendezvous PORT+3, and actor
data sockets PORT+16+k (k: the actor's index in the run, so a restarted actor binds where its peers look).
Flags left out are read from the torchrun / SLURM environment (`MASTER_ADDR`, `MASTER_PORT`, `NNODES`,
`NODE_RANK`; under srun `SLURM_NNODES`, `SLURM_NODEID` and the first host of `SLURM_JOB_NODELIST`).

Security: TCP between nodes is CURVE with one key pair made per run (runtime/transport.py). Node 0 writes it
to RUN/keys/run.key (0600; a shared filesystem is the SLURM norm) or every node reads `--keys DIR`.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq

from slipstream.runtime.transport import CurveKeys

__all__ = [
    "Cluster",
    "first_host",
    "interface_of",
    "node_env",
    "resolve_cluster",
    "routable_address",
    "run_keys",
]

DEFAULT_PORT = 29500  # torchrun's MASTER_PORT default
CONTROL, AGENTS, EVENTS, RENDEZVOUS, DATA = 0, 1, 2, 3, 16  # offsets from the head's port
KEY_DIR = "keys"
SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


@dataclass(frozen=True)
class Cluster:
    """Where one node of a run stands. `nnodes == 1` is a run on this host alone (no TCP at all)."""

    nnodes: int = 1
    node_rank: int = 0
    head_host: str = ""
    head_port: int = DEFAULT_PORT
    address: str = ""  # this node's address as the others reach it (node 0: the head's)

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    def port(self, offset: int) -> int:
        return self.head_port + offset

    def head_endpoint(self, offset: int) -> str:
        """tcp:// endpoint of one of the head's services (CONTROL, AGENTS, EVENTS, RENDEZVOUS)."""
        return f"tcp://{self.head_host}:{self.port(offset)}"

    def data_port(self, index: int) -> int:
        """The data port of the run's `index`-th actor (deterministic: a restart binds the same one)."""
        return self.port(DATA + index)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[03-05,9],cpu1" -> "gpu03"."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # commas outside brackets separate entries
    host = re.sub(r"\[([^\]\-,]+)[^\]]*\]", r"\1", first)  # each range -> its first value, padding kept
    if not host or "[" in host or "]" in host:
        raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r}: not a node list")
    return host


def routable_address(head_host: str, head_port: int = DEFAULT_PORT) -> str:
    """This host's address on the route to `head_host` (no packet is sent: a UDP connect picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((head_host, head_port))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of this host's network interface holding IPv4 `address` (None if none does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def node_env(address: str) -> dict[str, str]:
    """What an actor process of a multi-node run needs in its environment on the node at `address`: gloo
    (the CPU learner ranks' all-reduce) otherwise binds the interface its hostname resolves to, often
    loopback, and the other nodes' ranks cannot reach it. A value the node's environment sets wins."""
    iface = interface_of(address) if address else None
    if iface is None or "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    return {"GLOO_SOCKET_IFNAME": iface}


def _int(value: str | None, what: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{what}: {value!r} is not an integer") from None


def resolve_cluster(
    *,
    nnodes: int | None = None,
    node_rank: int | None = None,
    head: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Cluster:
    """The cluster of this command line: flags first, then the torchrun and SLURM environment names."""
    env = os.environ if env is None else env
    if nnodes is None:
        nnodes = next(
            (n for k in ("NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") if (n := _int(env.get(k), k))),
            1,
        )
    if node_rank is None:
        node_rank = next(
            (n for k in ("NODE_RANK", "SLURM_NODEID") if (n := _int(env.get(k), k)) is not None), 0
        )
    if nnodes < 1:
        raise ValueError(f"--nnodes: {nnodes}, a run needs at least one node")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank: {node_rank} is not in [0, {nnodes}) for --nnodes {nnodes}")
    if nnodes == 1:
        return Cluster()
    host, port = "", _int(env.get("MASTER_PORT"), "MASTER_PORT") or DEFAULT_PORT
    if head:
        host, sep, tail = head.rpartition(":")
        if not sep:
            host, tail = head, str(port)
        port = _int(tail, "--head port") or 0
    elif env.get("MASTER_ADDR"):
        host = env["MASTER_ADDR"]
    elif env.get("SLURM_JOB_NODELIST"):
        host = first_host(env["SLURM_JOB_NODELIST"])
    if not host:
        raise ValueError(
            f"--head: a run on {nnodes} nodes needs the head's HOST:PORT (or MASTER_ADDR, or SLURM_JOB_NODELIST)"
        )
    if not 1024 <= port <= 65535 - DATA - 1024:
        raise ValueError(f"--head: port {port} out of range (1024..{65535 - DATA - 1024}, room for actors)")
    try:
        ip = socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"--head: cannot resolve {host!r}: {e}") from None
    if ipaddress.ip_address(ip).is_loopback:
        raise ValueError(f"--head: {host} is a loopback address ({ip}); the other nodes cannot reach it")
    address = ip if node_rank == 0 else routable_address(ip, port)
    return Cluster(nnodes=nnodes, node_rank=node_rank, head_host=ip, head_port=port, address=address)


def run_keys(run_dir: Path, *, keys_dir: Path | None, create: bool) -> tuple[CurveKeys, Path]:
    """The run's CURVE key pair and its file: `keys_dir/run.key` when given, else RUN/keys/run.key, which
    node 0 (`create`) makes afresh for every start of the run (a crashed attempt's key is not reused)."""
    if not zmq.has("curve"):
        raise ValueError(
            "transport.insecure: this pyzmq's libzmq has no CURVE, and plaintext TCP across hosts is refused "
            "unless the config says transport.insecure: true"
        )
    if keys_dir is not None:
        path = Path(keys_dir) / "run.key"
        if not path.is_file():
            raise ValueError(f"--keys: no run.key in {keys_dir}")
        return CurveKeys.load(path), path
    directory = Path(run_dir) / KEY_DIR
    if create:
        keys = CurveKeys.generate()
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        tmp = keys.save(directory / ".new")  # written whole, then renamed: a reader never sees half a key
        os.replace(tmp, directory / "run.key")
        tmp.parent.rmdir()
        return keys, directory / "run.key"
    path = directory / "run.key"
    return CurveKeys.load(path), path
