"""Unit tests of the runtime pieces that need no processes: config, inbox, actor dispatch, sockets."""

import re
import threading
import time
import weakref
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from slipstream.protocols.control import Ping, Preempt, Shutdown, Status
from slipstream.protocols.learner import WeightUpdate
from slipstream.runtime.actor import Actor, Fatal, handler
from slipstream.runtime.config import ConfigError, load
from slipstream.runtime.host import actor_path, import_actor
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.transport import (
    CurveKeys,
    actor_name,
    ipc_endpoint,
    make_socket,
    parse_actor_name,
    start_authenticator,
)

# -- config -----------------------------------------------------------------------------------------


class Learner(msgspec.Struct, forbid_unknown_fields=True):
    lr: float = 1e-6  # step size
    steps: int = 3  # optimiser steps


class Run(msgspec.Struct, forbid_unknown_fields=True):
    name: str = "run"
    learner: Learner = msgspec.field(default_factory=Learner)


def test_config_yaml_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: a\nlearner:\n  lr: 0.5\n")
    cfg = load(path, Run, ["learner.steps=7", "name=b"])
    assert cfg == Run(name="b", learner=Learner(lr=0.5, steps=7))


def test_a_runs_config_json_takes_overrides_and_keeps_its_numbers(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(msgspec.json.encode(Run(learner=Learner(lr=1e-06))).decode())  # JSON writes 1e-06
    cfg = load(path, Run, ["learner.steps=20"])  # what `train --resume RUN steps=20` does
    assert cfg == Run(learner=Learner(lr=1e-06, steps=20))


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "message"),
    [
        ("learner:\n  lrr: 0.5\n", [], r"^learner\.lrr: unknown field$"),
        ("learner:\n  steps: many\n", [], r"^learner\.steps: expected `int`, got `str`$"),
        ("", ["learner.steps=1.5"], r"^learner\.steps: expected `int`, got `float`$"),
        ("nmae: x\n", [], r"^nmae: unknown field$"),
        ("- 1\n", [], r"top level must be a mapping"),
        ("learner: [\n", [], r"invalid YAML"),
        ("", ["learner"], r"must look like key\.sub=value"),
        ("name: a\n", ["name.sub=1"], r"^name: is a value"),
    ],
)
def test_config_errors_name_the_field(
    tmp_path: Path, yaml_text: str, overrides: list[str], message: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message):
        load(path, Run, overrides)


# -- inbox ------------------------------------------------------------------------------------------


def test_inbox_serves_control_first_and_bounds_data() -> None:
    box = Inbox(capacity=2)
    assert box.put_data("d1") and box.put_data("d2")
    assert not box.put_data("d3")  # full: the IO thread must stop reading
    box.put_control("c1")
    assert box.control_event.is_set()
    assert box.get(0) == (True, "c1")
    assert not box.control_event.is_set()
    assert box.get(0) == (False, "d1")
    assert box.get(0) == (False, "d2")
    assert box.get(0) is None


def test_inbox_wakes_a_blocked_reader() -> None:
    box = Inbox(capacity=1)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(box.get(5.0)))
    t.start()
    box.put_control("wake")
    t.join(2.0)
    assert got == [(True, "wake")]


def test_a_wake_before_the_wait_is_not_lost() -> None:
    """An environment's answer handed over while the compute loop was in `step`: the loop's next wait
    returns at once instead of sleeping its idle wait; the wake counts once."""
    box = Inbox(capacity=1)
    box.wake()
    started = time.monotonic()
    assert box.get(5.0) is None
    assert time.monotonic() - started < 2.0  # not the 5 s wait: lost, the wake left it to run out
    started = time.monotonic()
    assert box.get(0.3) is None
    assert time.monotonic() - started >= 0.25  # consumed: this one waits


# -- actor dispatch ---------------------------------------------------------------------------------


class FakeOutbox:
    """Isolates the actor from sockets in these unit tests."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[object]]] = []

    def send(self, dest: str, frames: list[object]) -> None:
        self.sent.append((dest, frames))


class Echo(Actor):
    role = "echo"

    @handler
    def on_ping(self, msg: Ping, sender: str) -> None:
        if msg.seq == 13:
            raise ValueError("unlucky")
        if msg.seq == 666:
            raise Fatal("asked to die")
        self.send(sender, Status(topic="pong", fields={"seq": msg.seq}))

    @handler
    def on_preempt(self, msg: Preempt, sender: str) -> None:
        self.preempted = msg.lease_id


def make_echo() -> tuple[Echo, FakeOutbox]:
    out = FakeOutbox()
    return Echo(Echo.Config(), rank=0, outbox=out, inbox=Inbox(8)), out


def test_an_actor_class_and_its_import_path_round_trip() -> None:
    assert actor_path(Echo) == "tests.runtime.test_units:Echo"
    assert import_actor(actor_path(Echo)) is Echo

    class Local(Actor):
        role = "local"

    with pytest.raises(ValueError, match="must be importable by path"):
        actor_path(Local)
    with pytest.raises(ValueError, match="is not an Actor subclass"):
        import_actor("tests.runtime.test_units:Run")


def test_handlers_are_found_by_annotation() -> None:
    assert Echo._handlers == {Ping: "on_ping", Preempt: "on_preempt"}


def test_handler_without_annotation_is_rejected() -> None:
    with pytest.raises(TypeError, match="needs a type annotation"):

        class Bad(Actor):
            @handler
            def on_x(self, msg, sender):  # type: ignore[no-untyped-def]
                pass


def test_control_is_served_before_data_and_shutdown_stops() -> None:
    echo, out = make_echo()
    for seq in (1, 2):
        echo.inbox.put_data(("peer:0", Ping(seq=seq, sent_ns=0)))
    echo.inbox.put_control(("coordinator", Preempt(lease_id=4, reason="x", sent_ns=0)))
    echo.inbox.put_control(("coordinator", Shutdown(reason="done")))
    order: list[str] = []
    dispatch = echo.dispatch
    echo.dispatch = lambda msg, sender: order.append(type(msg).__name__) or dispatch(msg, sender)  # type: ignore[method-assign]
    echo.serve(idle_wait_s=0.01)
    assert echo.preempted == 4
    # Both control messages came first; the data delivered before Shutdown is still handed over (answered).
    assert order == ["Preempt", "Shutdown", "Ping", "Ping"]
    assert [dest for dest, _ in out.sent] == ["peer:0", "peer:0"]  # both pings answered


def test_failing_handler_is_logged_and_serving_continues() -> None:
    echo, out = make_echo()
    for seq in (1, 13, 2):
        echo.inbox.put_data(("peer:0", Ping(seq=seq, sent_ns=0)))
    echo.step = lambda: echo.stop() or False  # type: ignore[method-assign]  # stop once the inbox drained
    echo.serve(idle_wait_s=0.01)
    assert [dest for dest, _ in out.sent] == ["peer:0", "peer:0"]  # 1 and 2 answered; 13 raised
    assert echo.handled == 3


def test_step_runs_right_after_a_message_and_a_wake_ends_an_idle_wait() -> None:
    echo, _ = make_echo()
    calls: list[float] = []

    def step() -> bool:
        calls.append(time.monotonic())
        if len(calls) == 2:
            echo.stop()
        return False

    echo.step = step  # type: ignore[method-assign]

    def feed() -> None:
        time.sleep(0.2)
        echo.inbox.put_data(("peer:0", Ping(seq=1, sent_ns=0)))  # a message: step runs after it at once
        time.sleep(0.2)
        echo.inbox.wake()  # no message: step runs at once too

    thread = threading.Thread(target=feed)
    started = time.monotonic()
    thread.start()
    echo.serve(idle_wait_s=30.0)  # idle waits far longer than the test: only the two events end them
    thread.join()
    assert len(calls) == 2 and 0.15 < calls[0] - started < 1.0 and 0.35 < calls[1] - started < 1.5
    assert echo.handled == 1


class Sink(Actor):
    role = "sink"

    @handler
    def on_weights(self, msg: WeightUpdate, sender: str) -> None:
        pass  # keeps nothing


def test_an_actor_holds_no_reference_to_a_message_once_it_is_handled() -> None:
    # A received tensor may alias its sender's shared-memory slot: the slot stays claimed while it lives.
    sink = Sink(Sink.Config(), rank=0, outbox=FakeOutbox(), inbox=Inbox(8))
    tensor = torch.ones(4)
    probe = weakref.ref(tensor)
    update = WeightUpdate(version=1, bucket=0, num_buckets=1, names=["w"], tensors=[tensor], checksum="0")
    sink.inbox.put_data(("learner:0", update))
    del tensor, update
    alive: list[bool] = []
    sink.step = lambda: alive.append(probe() is not None) or sink.stop() or False  # type: ignore[method-assign]
    sink.serve(idle_wait_s=0.01)
    assert alive == [False]


def test_a_broadcast_writes_one_shared_memory_slot_for_every_destination_on_the_host() -> None:
    """A weight bucket for the host's rollouts is one copy each claims, not one copy per rollout; a peer on
    another host gets its own plain encoding (no descriptor could reach it)."""
    import uuid

    from slipstream.runtime.codec import Codec
    from slipstream.runtime.shm import ShmArena, ShmReader, cleanup

    tag = f"test{uuid.uuid4().hex[:8]}"
    try:
        with ShmArena(tag, slot_bytes_max=8 << 20, capacity_bytes=64 << 20) as arena:
            out = FakeOutbox()
            peers = {"rollout:0": "ipc:///a", "rollout:1": "ipc:///b", "rollout:2": "tcp://10.0.0.2:5000"}
            sink = Sink(Sink.Config(), rank=0, outbox=out, inbox=Inbox(8), peers=peers,
                        local_codec=Codec(shm=arena))  # fmt: skip
            weights = torch.randn(1 << 19)  # [512K] float32 = 2 MiB: over the lane's threshold
            update = WeightUpdate(
                version=1, bucket=0, num_buckets=1, names=["w"], tensors=[weights], checksum="0"
            )
            sink.broadcast(["rollout:0", "rollout:1", "rollout:2"], update)
            sent = dict(out.sent)
            assert sent["rollout:0"] is sent["rollout:1"] and arena.busy_slots() == 1  # one copy, one slot
            assert len(sent["rollout:2"]) == 3  # kind, body, and the tensor's own frame
            decoded = [Codec(shm_reader=ShmReader()).decode(sent[d]) for d in ("rollout:0", "rollout:1")]
            assert all(torch.equal(m.tensors[0], weights) for m in decoded)  # type: ignore[attr-defined]
            assert arena.busy_slots() == 1
            del decoded
            assert arena.busy_slots() == 0  # both rollouts released it
    finally:
        cleanup(tag)


def test_fatal_ends_the_actor() -> None:
    echo, _ = make_echo()
    echo.inbox.put_data(("peer:0", Ping(seq=666, sent_ns=0)))
    with pytest.raises(Fatal, match="asked to die"):
        echo.serve(idle_wait_s=0.01)


# -- sockets ----------------------------------------------------------------------------------------


def test_curve_refuses_a_peer_without_the_run_key() -> None:
    ctx = zmq.Context()
    keys = CurveKeys.generate()
    auth = start_authenticator(ctx, keys)
    try:
        server = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", curve=keys)
        endpoint = server.getsockopt(zmq.LAST_ENDPOINT).decode()
        good = make_socket(ctx, zmq.DEALER, identity="good:0", connect=endpoint, curve=keys)
        intruder = make_socket(ctx, zmq.DEALER, identity="evil:0", connect=endpoint, curve=CurveKeys(
            keys.public, CurveKeys.generate().secret))  # fmt: skip  # right server key, wrong own key
        plain = make_socket(ctx, zmq.DEALER, identity="plain:0", connect=endpoint)
        for s in (intruder, plain, good):
            s.send(s.getsockopt(zmq.IDENTITY))
        server.setsockopt(zmq.RCVTIMEO, 1500)
        assert server.recv_multipart() == [b"good:0", b"good:0"]
        with pytest.raises(zmq.Again):
            server.recv_multipart()
        for s in (server, good, intruder, plain):
            s.close(0)
    finally:
        auth.stop()
        ctx.term()


def test_curve_key_file_round_trip_and_errors(tmp_path: Path) -> None:
    keys = CurveKeys.generate()
    path = keys.save(tmp_path / "keys")
    assert (path.stat().st_mode & 0o777) == 0o600
    assert CurveKeys.load(path) == keys
    path.write_text("nonsense")
    with pytest.raises(ValueError, match="not a Slipstream CURVE key file"):
        CurveKeys.load(path)


def test_ipc_endpoint_stays_short_for_deep_run_dirs(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    endpoint = ipc_endpoint(deep, "data-rollout-0")
    assert len(endpoint) - len("ipc://") < 107
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind=endpoint)
    sock.close(0)
    ctx.term()


def test_make_socket_needs_exactly_one_of_bind_or_connect() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        make_socket(zmq.Context.instance(), zmq.PUSH)


# -- actor names ------------------------------------------------------------------------------------


def test_actor_names_round_trip() -> None:
    assert actor_name("drafter", 0) == "drafter:0"
    assert parse_actor_name("drafter:12") == ("drafter", 12)
    for role, rank in (("rollout", 3), ("sink", 0), ("a-b_c", 7)):
        assert parse_actor_name(actor_name(role, rank)) == (role, rank)


@pytest.mark.parametrize(
    "name", ["coordinator", "drafter:", ":0", "drafter:x", "drafter:-1", "drafter:01", "a:b:1", "drafter:1 "]
)
def test_a_malformed_actor_name_is_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(repr(name))} is not an actor name"):
        parse_actor_name(name)


@pytest.mark.parametrize(("role", "rank"), [("", 0), ("a:b", 0), ("drafter", -1), ("drafter", True)])
def test_actor_name_refuses_what_would_not_parse_back(role: str, rank: int) -> None:
    with pytest.raises(ValueError, match="actor r"):
        actor_name(role, rank)
