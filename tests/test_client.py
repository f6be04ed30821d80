"""The worker's request/response client on real loopback sockets."""

import asyncio

import pytest
import zmq
import zmq.asyncio

from echo_rl.core import wire
from echo_rl.core.client import Client, ConnectionLost, RequestTimeout

pytestmark = pytest.mark.timeout(30)


def with_client(scenario):
    """Run ``scenario(server ROUTER, client)`` with the client receiving, then clean up."""

    async def go():
        ctx = zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)
        server.bind("tcp://127.0.0.1:*")
        client = Client(ctx, server.getsockopt_string(zmq.LAST_ENDPOINT), 1 << 20)
        try:
            async with asyncio.TaskGroup() as tg:
                receiving = tg.create_task(client.receive_forever())
                result = await scenario(server, client, tg)
                receiving.cancel()
            return result
        finally:
            server.close(linger=0)
            client.close()
            ctx.destroy(linger=0)

    return asyncio.run(go())


def test_a_dropped_connection_fails_waiting_requests_at_once():
    """The learner's end goes away while a request waits: the request fails with
    ConnectionLost right then, not after its (here 20 s) timeout."""

    async def scenario(server, client, tg):
        async def vanish_after_the_request() -> None:
            await server.recv_multipart()  # the request arrived; no reply will come
            server.close(linger=0)

        tg.create_task(vanish_after_the_request())
        with pytest.raises(ConnectionLost):
            await client.request(wire.WorkRequest(worker_id="w", max_groups=1), timeout=20)
        return client.disconnects

    assert with_client(scenario) == 1


def test_silence_is_a_timeout_not_a_lost_connection():
    async def scenario(server, client, tg):
        with pytest.raises(RequestTimeout) as err:
            await client.request(wire.WorkRequest(worker_id="w", max_groups=1), timeout=0.3)
        return err.type

    assert with_client(scenario) is RequestTimeout
