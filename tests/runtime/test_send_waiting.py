"""The head's sends wait for a full peer instead of dropping (`transport.send_waiting`), over real sockets.

A ROUTER never blocks: a peer at its high-water mark is EAGAIN. The coordinator dealt 8192 score requests
to one verifier at once in `bench scale` and lost 91 that way; the step then waited for their rewards
forever. Here a DEALER that does not read yet is sent far more than both sides' queues hold: every message
arrives, in order, once it reads; a peer that is gone ends the wait with a reason instead of a hang."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from slipstream.runtime.transport import PEER_FULL, SocketOptions, make_socket, send_waiting

COUNT = 3000


def pair(ctx: zmq.asyncio.Context, endpoint: str) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    small = SocketOptions(sndhwm=10, rcvhwm=10, sndbuf=4096, rcvbuf=4096)
    router = make_socket(ctx, zmq.ROUTER, bind=endpoint, options=small)
    dealer = make_socket(ctx, zmq.DEALER, identity="verifier:0", connect=endpoint, options=small)
    return router, dealer


async def _everything_arrives_in_order(endpoint: str) -> tuple[list[int], int]:
    ctx = zmq.asyncio.Context()
    router, dealer = pair(ctx, endpoint)
    try:
        await dealer.send(b"hello")  # the ROUTER learns the peer's identity
        await router.recv_multipart()
        waited = 0

        async def sender() -> None:
            nonlocal waited
            for i in range(COUNT):
                started = asyncio.get_running_loop().time()
                error = await send_waiting(router, [b"verifier:0", i.to_bytes(4, "big")], lambda: False)
                assert error is None
                waited += asyncio.get_running_loop().time() - started > 0.0005

        task = asyncio.create_task(sender())
        await asyncio.sleep(0.3)  # the peer reads nothing yet: its queues fill and the sender waits
        assert not task.done()
        got = [int.from_bytes(await dealer.recv(), "big") for _ in range(COUNT)]
        await task
        return got, waited
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def test_a_full_peer_is_waited_for_and_gets_every_message_in_order(tmp_path) -> None:
    got, waited = asyncio.run(_everything_arrives_in_order(f"ipc://{tmp_path}/s"))
    assert got == list(range(COUNT))
    assert waited > 0  # the queues did fill: sends waited


async def _gone_peer(endpoint: str) -> str | None:
    ctx = zmq.asyncio.Context()
    router, dealer = pair(ctx, endpoint)
    try:
        await dealer.send(b"hello")
        await router.recv_multipart()
        error, gone = None, False
        for i in range(COUNT):  # fills the queues; then the peer is gone
            gone = i > 100
            frames = [b"verifier:0", i.to_bytes(4, "big")]
            error = await asyncio.wait_for(send_waiting(router, frames, lambda g=gone: g), 5.0)
            if error is not None:
                break
        return error
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def test_a_full_peer_that_is_gone_ends_the_wait_with_a_reason(tmp_path) -> None:
    assert asyncio.run(_gone_peer(f"ipc://{tmp_path}/s")) == PEER_FULL
