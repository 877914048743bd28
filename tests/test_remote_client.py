"""The HTTP client server-backed rollout engines talk through (``core_rl_server_kit.remote.wire``): JSON
round trips with many requests in flight over real sockets, error statuses, and each transport
failure (refused, hung up, silent) named as what happened to the connection."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from core_rl_server_kit.remote.wire import ServerReplyError, async_client, describe, is_transport_error, json_post


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A keep-alive HTTP/1.1 server: echoes the JSON body of each POST with its path; ``/fail``
    answers 503; ``/close`` hangs up without answering; ``/hang`` never answers."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            path = lines[0].split()[1]
            length = next(
                (int(v) for k, _, v in (x.partition(":") for x in lines[1:]) if k.lower() == "content-length"), 0
            )
            body = json.loads(await reader.readexactly(length)) if length else None
            if path == "/close":
                break
            if path == "/hang":
                await asyncio.sleep(60)
            await asyncio.sleep(0.01)  # requests overlap
            status, out = (503, b'{"error": "busy"}') if path == "/fail" else (200, json.dumps([path, body]).encode())
            writer.write(
                f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(out)}\r\n\r\n".encode()
                + out
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _with_server(test) -> object:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    # 200 requests queue for 16 connections: the pool wait counts against the timeout (generous on a loaded machine)
    client = async_client(timeout=30.0, max_connections=16)
    try:
        return await test(client, url)
    finally:
        await client.aclose()
        server.close()


def test_many_requests_in_flight_each_get_their_own_answer() -> None:
    async def run(client, url):
        return await asyncio.gather(*(json_post(client, f"{url}/generate", {"i": i}) for i in range(200)))

    answers = asyncio.run(_with_server(run))
    assert answers == [["/generate", {"i": i}] for i in range(200)]


def test_an_error_status_is_a_reply_error_quoting_the_body() -> None:
    async def run(client, url):
        with pytest.raises(ServerReplyError, match=r"answered 503: \{\"error\": \"busy\"\}") as caught:
            await json_post(client, f"{url}/fail", {})
        return caught.value

    error = asyncio.run(_with_server(run))
    assert error.status == 503 and error.retryable and not is_transport_error(error)


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("refused", "connection refused"),
        ("/close", "the connection closed mid-answer"),
        ("/hang", "no answer in time"),
    ],
)
def test_a_transport_failure_is_named_as_what_happened_to_the_connection(path: str, said: str) -> None:
    async def run(client, url):
        target = f"http://127.0.0.1:{_free_port()}/x" if path == "refused" else url + path
        with pytest.raises(Exception) as caught:
            await json_post(client, target, {}, timeout=0.5)
        return caught.value

    error = asyncio.run(_with_server(run))
    assert is_transport_error(error), repr(error)
    assert describe(error) == said, repr(error)
