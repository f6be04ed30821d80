"""The chaos proxy itself: bytes pass intact and in order, a reset is a reset, bad settings
are refused. (Its use against the real system is in test_integration.py.)"""

import asyncio

import pytest

from labs.chaos import ChaosConfig, ChaosProxy, main

pytestmark = pytest.mark.timeout(30)


async def _echo_server() -> tuple[asyncio.base_events.Server, int]:
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_bytes_pass_intact_and_in_order_both_ways():
    async def go():
        server, port = await _echo_server()
        proxy = ChaosProxy("127.0.0.1", port, ChaosConfig(latency_s=0.005))
        reader, writer = await asyncio.open_connection("127.0.0.1", await proxy.start())
        sent = bytes(range(256)) * 4096  # 1 MiB, more than one read and one queue slot
        writer.write(sent)
        await writer.drain()
        got = await reader.readexactly(len(sent))
        writer.close()
        await proxy.close()
        server.close()
        return sent, got, proxy.stats

    sent, got, stats = asyncio.run(go())
    assert got == sent
    assert stats.connections == 1 and stats.bytes["up"] == stats.bytes["down"] == len(sent)


def test_a_reset_aborts_the_connection_and_new_ones_still_pass():
    async def go():
        server, port = await _echo_server()
        proxy = ChaosProxy("127.0.0.1", port, ChaosConfig())
        listen = await proxy.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"  # the link is up and registered
        assert proxy.reset_one()
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await reader.readexactly(1)
        writer.close()
        reader2, writer2 = await asyncio.open_connection("127.0.0.1", listen)
        writer2.write(b"again")
        again = await reader2.readexactly(5)
        writer2.close()
        await proxy.close()
        server.close()
        return again, proxy.stats

    again, stats = asyncio.run(go())
    assert again == b"again"
    assert stats.resets == 1 and stats.connections == 2


def test_resetting_a_link_that_just_ended_does_not_end_the_proxy():
    """A link whose connections closed is still listed until its handler runs on: a reset
    drawn in that moment must not raise (it did: EBADF, and the proxy exited 1)."""

    async def go():
        server, port = await _echo_server()
        proxy = ChaosProxy("127.0.0.1", port, ChaosConfig())
        reader, writer = await asyncio.open_connection("127.0.0.1", await proxy.start())
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        (link,) = proxy.links
        for w in link.writers:
            w.transport.abort()
        await asyncio.sleep(0)  # the sockets close; the handler has not taken the link off yet
        proxy.links.add(link)  # (whatever it did meanwhile: the race's state)
        reset = proxy.reset_one()
        writer.close()
        await proxy.close()
        server.close()
        return reset, proxy.stats

    reset, stats = asyncio.run(go())
    assert reset and stats.resets == 1


def test_bad_settings_are_refused_with_the_name_of_the_setting(capsys):
    with pytest.raises(ValueError, match="latency_s"):
        ChaosConfig(latency_s=-1)
    with pytest.raises(SystemExit):
        main(["--target", "nowhere"])
    assert "is not HOST:PORT" in capsys.readouterr().err
