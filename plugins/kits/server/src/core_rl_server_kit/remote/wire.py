"""What travels between a server-backed rollout engine and its servers: a sample as a server
returned it (:class:`Completion`), a server's unexpected answer (:class:`ServerReplyError`), a JSON
POST, per-token weight versions from a server's spans, and the request checks every engine shares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from core_rl.errors import CoreRLError
from core_rl.interfaces import SamplingParams
from core_rl.reliability import PROGRESS


@attrs.define
class Completion:
    """One sample as a server returned it; ``finish_reason`` is ``stop``, ``length`` or ``abort``
    (interrupted by a pause). ``versions``: the weight version that generated each token, where
    the server reports it (a weight update that keeps running requests in place changes it
    mid-sample); ``None``: every token has the version the request started under.
    ``routes``: a mixture-of-experts model's routed experts, where the server returns them
    (routing replay): int ``[positions, layers, top_k]`` for the request's prompt and its tokens but
    the last (never fed to the model), as :attr:`core_rl.protocol.Sample.routed_experts` holds them
    without its last row."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int] | None = None
    routes: Any = None


class ServerReplyError(CoreRLError):
    """A server answered, but not as expected (an error status or a malformed body).

    ``status`` is the HTTP status (0 for a malformed body). A 4xx other than 408 and 429 means the
    request itself is wrong: it is not retried. It fails the run (exit status 1)."""

    exit_code = 1

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        return not (400 <= self.status < 500 and self.status not in (408, 429))


def versions_from_spans(spans: Any, count: int) -> list[int] | None:
    """Per-token weight versions of a sample of ``count`` tokens from a server's version spans
    (``[{"version": label, "start": i, "end": j}, ...]`` over output-token indices, as vLLM and
    SGLang report them). ``None`` (every token then carries the version its request started
    under) where the server gave none or a label that is not one of ours (an integer), e.g. its
    initial ``default``. Raises :class:`ValueError` for spans that leave a token uncovered."""
    if not count:
        return []
    if not spans:
        return None
    versions: list[int | None] = [None] * count
    for span in spans:
        label = str(span["version"])
        if not label.lstrip("-").isdigit():
            return None
        for i in range(int(span["start"]), min(int(span["end"]), count)):
            versions[i] = int(label)
    missing = [i for i, v in enumerate(versions) if v is None]
    if missing:
        raise ValueError(f"weight version spans {spans} leave tokens {missing[:5]} of {count} uncovered")
    return [v for v in versions if v is not None]


def check_prompt_and_sampling(prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
    """Raise :class:`ValueError` for an empty prompt or sampling settings no engine can honour."""
    problems = []
    if len(prompt_ids) == 0:
        problems.append("the prompt is empty")
    if sampling.n < 1:
        problems.append(f"n must be >= 1, got {sampling.n}")
    if sampling.max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    if not sampling.greedy and not sampling.temperature > 0:
        problems.append(f"temperature must be > 0 unless greedy, got {sampling.temperature}")
    if problems:
        raise ValueError("invalid generation request: " + "; ".join(problems))


async def json_post(
    client: Any, url: str, payload: Mapping[str, Any] | None = None, *, timeout: float | None = None
) -> Any:
    """POST ``payload`` as JSON; return the decoded body. A non-2xx status is a
    :class:`ServerReplyError` quoting the body. The request is a call in flight for the progress
    watchdog (:mod:`core_rl.reliability.progress`) until its answer arrives."""
    kwargs: dict[str, Any] = {"json": payload} if payload is not None else {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    with PROGRESS.call(f"POST {url}"):
        response = await client.post(url, **kwargs)
    if response.status_code >= 300:
        raise ServerReplyError(
            f"POST {url} answered {response.status_code}: {response.text[:500]}", response.status_code
        )
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


def async_client(timeout: float, max_connections: int) -> Any:
    """The ``httpx.AsyncClient`` an engine talks to its servers with: httpx's interface over
    aiohttp's connection pool (``httpx-aiohttp``), ``timeout`` seconds for each connect and each read,
    at most ``max_connections`` open.

    httpx's own pool walks every open connection (a socket poll each) whenever a request starts or
    ends, so its CPU per request grows with the requests in flight: 13.4 ms against aiohttp's
    1.7 ms for 512 requests with 64 in flight (``python benchmarks/rollout.py --engines sglang
    --prompts 512`` prints both), CPU the trainer's process then lacks. Failures still arrive as
    ``httpx`` errors; :func:`describe` reads the cause they carry."""
    import httpx
    from httpx_aiohttp import HttpxAiohttpClient

    return HttpxAiohttpClient(timeout=httpx.Timeout(timeout), limits=httpx.Limits(max_connections=max_connections))


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an HTTP transport failure (refused, reset, timed out: ``httpx.HTTPError``)
    rather than an answer."""
    import httpx

    return isinstance(exc, httpx.HTTPError)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from, outermost first."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 10:
        chain.append(chain[-1].__cause__)
    return chain


def describe(exc: BaseException) -> str:
    """``exc`` in a few words for a message: a transport failure as what happened to the
    connection (``connection refused``, ``the connection closed mid-answer``, ``no answer in
    time``), anything else as ``Type: message``. The transport error's cause decides where it has
    one: ``httpx-aiohttp`` raises a refused connection and a server that hung up alike as
    ``httpx.ConnectTimeout``."""
    import aiohttp
    import httpx

    text = str(exc).strip()
    causes = _causes(exc)
    if any(isinstance(c, ConnectionRefusedError) for c in causes):
        return "connection refused"
    if any(isinstance(c, (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError)) for c in causes):
        return "the connection closed mid-answer"
    if isinstance(exc, httpx.ConnectError):
        return "connection refused" if "refused" in text.lower() or "all connection attempts" in text.lower() else text
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
