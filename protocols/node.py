"""Node channel: the head's supervisor ↔ the node agent of every other node of a run (runtime/agent.py).

An agent starts and stops the actor processes placed on its node and reports their exits; it does not relay
their messages (each actor connects to the head itself, over CURVE). `Launch` is structured, not a command
line: the agent builds the command from its own interpreter and paths, so a head never runs text on a node.
Liveness both ways is the control channel's `Heartbeat`.
"""

from enum import StrEnum

from slipstream.protocols.base import Message, NonNeg, NonNegF


class NodeKind(StrEnum):
    HELLO = "node.hello"
    LAUNCH = "node.launch"
    LAUNCHED = "node.launched"
    EXITED = "node.exited"
    KILL = "node.kill"
    STOP = "node.stop"


class AgentHello(Message, frozen=True, kw_only=True):
    """Agent → head, on connecting (and again until the head answers): which node it serves, and what it has."""

    kind = NodeKind.HELLO
    node: NonNeg
    host: str  # hostname, for people
    address: str  # where this node's actors bind their data sockets (routable from the other nodes)
    pid: int
    cores: NonNeg
    gpus: NonNeg
    protocol_version: int


class Launch(Message, frozen=True, kw_only=True):
    """Head → agent: start actor `name` (`actor` "pkg.mod:Class", `rank`) on this node."""

    kind = NodeKind.LAUNCH
    name: str
    actor: str
    rank: NonNeg
    env: dict[str, str]  # set on top of the node's own environment (threads, caches, the spec's env)
    cpus: list[NonNeg]
    data_port: NonNeg
    handshake_timeout_s: NonNegF


class Launched(Message, frozen=True, kw_only=True):
    """Agent → head: `name` started as `pid` (pid 0: it could not start, `error` says why)."""

    kind = NodeKind.LAUNCHED
    name: str
    pid: NonNeg
    error: str = ""


class Exited(Message, frozen=True, kw_only=True):
    """Agent → head: the process of `name` ended (`code` negative: killed by that signal)."""

    kind = NodeKind.EXITED
    name: str
    pid: NonNeg
    code: int


class Kill(Message, frozen=True, kw_only=True):
    """Head → agent: send `signal` to the process of `name`."""

    kind = NodeKind.KILL
    name: str
    signal: NonNeg


class StopAgent(Message, frozen=True, kw_only=True):
    """Head → agent: the run is over; stop every actor of this node (SIGTERM, then SIGKILL) and exit."""

    kind = NodeKind.STOP
    reason: str


MESSAGES: tuple[type[Message], ...] = (AgentHello, Launch, Launched, Exited, Kill, StopAgent)

__all__ = [m.__name__ for m in MESSAGES] + ["MESSAGES", "NodeKind"]
