"""Control channel: lifecycle, liveness, device leases and preemption, checkpoints.

Control has no socket of its own: it shares each actor's DEALER ↔ the coordinator's ROUTER with the work
the coordinator deals and the results it collects (runtime/transport.py); only bulk data between peers
(weights, hidden states) has sockets apart. At the actor it still never queues behind work: the IO thread
puts every `control.*` message in the inbox's control lane, which the compute loop serves first
(runtime/inbox.py), so a preemption is honoured between steps, not after a backlog of data. At the
coordinator the supervisor handles Hello, Ready, Dead and heartbeats as they arrive; the rest, leases'
answers included, queue with the results in arrival order.
"""

from enum import StrEnum

import msgspec

from slipstream.protocols.base import Message, NonNeg, NonNegF


class ControlKind(StrEnum):
    HELLO = "control.hello"
    INIT = "control.init"
    READY = "control.ready"
    HEARTBEAT = "control.heartbeat"
    PING = "control.ping"
    PONG = "control.pong"
    STATUS = "control.status"
    IDLE = "control.idle"
    LEASE = "control.lease"
    PREEMPT = "control.preempt"
    RELEASED = "control.released"
    SHUTDOWN = "control.shutdown"
    DEAD = "control.dead"
    CHECKPOINT = "control.checkpoint"
    PEERS = "control.peers"
    CHECKPOINT_SAVED = "control.checkpoint_saved"
    FAILED = "control.failed"


class Hello(Message, frozen=True, kw_only=True):
    """Actor → supervisor, first message after connecting: who it is and where its data socket is."""

    kind = ControlKind.HELLO
    role: str
    rank: NonNeg
    pid: int
    host: str
    data_endpoint: str
    protocol_version: int
    clock_ns: int = 0  # the actor's time.monotonic_ns() when it sent this (clock alignment of spans)
    # Multi-node runs: the same data socket's ipc:// endpoint, for peers on its own node (`data_endpoint` is
    # then its tcp:// one); "" on one host, where `data_endpoint` is ipc:// already.
    local_endpoint: str = ""


class Init(Message, frozen=True, kw_only=True):
    """Supervisor → actor: the actor's config (validated against its Config type) and its peers."""

    kind = ControlKind.INIT
    config: msgspec.Raw  # MessagePack of the typed config's plain values; converted back strictly
    run_dir: str
    peers: dict[str, str]  # "role:rank" -> data endpoint
    heartbeat_s: NonNegF
    threads: NonNeg
    trace: bool = False  # record spans into RUN/spans/ (runtime/spans.py)
    # The supervisor's monotonic clock when the Hello arrived and when this left: with the actor's own two
    # readings, an NTP-style estimate of the offset between the two clocks (error <= half the round trip).
    hello_recv_ns: int = 0
    sent_ns: int = 0


class Ready(Message, frozen=True, kw_only=True):
    """Actor → supervisor: on_start finished; the actor serves messages from now on."""

    kind = ControlKind.READY
    role: str
    rank: NonNeg


class Heartbeat(Message, frozen=True, kw_only=True):
    """Both directions, every heartbeat interval. `handled` and `queued` let an owner see a stuck loop;
    `ticks` counts the compute loop's turns (and long handlers' progress marks): frozen ticks under live
    heartbeats are a hang."""

    kind = ControlKind.HEARTBEAT
    seq: NonNeg
    sent_ns: int
    handled: NonNeg = 0
    queued: NonNeg = 0
    ticks: NonNeg = 0


class Ping(Message, frozen=True, kw_only=True):
    """Round-trip probe (latency benchmark, liveness checks)."""

    kind = ControlKind.PING
    seq: NonNeg
    sent_ns: int


class Pong(Message, frozen=True, kw_only=True):
    kind = ControlKind.PONG
    seq: NonNeg
    sent_ns: int


class Status(Message, frozen=True, kw_only=True):
    """Actor → coordinator: a named report with scalar fields (progress, metrics, results)."""

    kind = ControlKind.STATUS
    topic: str
    fields: dict[str, int | float | str | bool | None]


class Idle(Message, frozen=True, kw_only=True):
    """Rollout → coordinator: my queue drained; my device can be leased."""

    kind = ControlKind.IDLE
    role: str
    rank: NonNeg
    policy_version: NonNeg


class Lease(Message, frozen=True, kw_only=True):
    """Coordinator → actor: you may use `device` with `threads` threads until preempted."""

    kind = ControlKind.LEASE
    lease_id: NonNeg
    device: str
    threads: NonNeg
    cpus: list[NonNeg] = []


class Preempt(Message, frozen=True, kw_only=True):
    """Coordinator → actor: release lease `lease_id` now (honoured within one step)."""

    kind = ControlKind.PREEMPT
    lease_id: NonNeg
    reason: str
    sent_ns: int


class Released(Message, frozen=True, kw_only=True):
    """Actor → coordinator: lease released; `latency_ns` is preempt-receipt to release."""

    kind = ControlKind.RELEASED
    lease_id: NonNeg
    latency_ns: NonNeg


class Shutdown(Message, frozen=True, kw_only=True):
    kind = ControlKind.SHUTDOWN
    reason: str


class Dead(Message, frozen=True, kw_only=True):
    """An actor that is dying says so (failure is a message); the supervisor also reports deaths it sees."""

    kind = ControlKind.DEAD
    role: str
    rank: NonNeg
    reason: str
    exit_code: int | None = None


class SaveCheckpoint(Message, frozen=True, kw_only=True):
    """Coordinator → learner rank 0 and the drafter owner, after step `step` is trained and synced: save a
    checkpoint (the learner to `path`, atomically, then `CheckpointSaved`; the drafter to its own directory,
    in the background). Handled between steps, so it sees whole weights."""

    kind = ControlKind.CHECKPOINT
    step: NonNeg
    path: str = ""


class CheckpointSaved(Message, frozen=True, kw_only=True):
    """Learner rank 0 → coordinator: the answer to `SaveCheckpoint`: on disk at `path`, or not (`error`: why,
    a full disk)."""

    kind = ControlKind.CHECKPOINT_SAVED
    step: NonNeg
    path: str
    version: NonNeg
    error: str = ""


class Failed(Message, frozen=True, kw_only=True):
    """Actor → the sender of a request whose handler raised: the request's kind and the error, so that
    whoever waits for an answer hears one (the actor serves on)."""

    kind = ControlKind.FAILED
    request: str
    error: str


class Peers(Message, frozen=True, kw_only=True):
    """Supervisor → actor: these peers are now reached here (an actor restarted on another node, after its
    node was lost). The actor's IO thread reconnects to each, dropping what was queued for the old address."""

    kind = ControlKind.PEERS
    peers: dict[str, str]  # "role:rank" -> data endpoint, as this actor reaches it


MESSAGES: tuple[type[Message], ...] = (
    Hello,
    Init,
    Ready,
    Heartbeat,
    Ping,
    Pong,
    Status,
    Idle,
    Lease,
    Preempt,
    Released,
    Shutdown,
    SaveCheckpoint,
    CheckpointSaved,
    Failed,
    Dead,
    Peers,
)

__all__ = [m.__name__ for m in MESSAGES] + ["MESSAGES", "ControlKind"]
