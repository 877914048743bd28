"""The OpenAI-compatible proxy: a Starlette app served by uvicorn on a thread and event loop of its
own, in front of the rollout engine.

Routes (``base_url`` is ``http://host:port/v1``): ``POST /v1/chat/completions``, ``POST
/v1/responses`` (:mod:`core_rl_openai_proxy.responses_api`), ``POST /v1/completions``, ``GET
/v1/models`` and ``POST /v1/sessions/{id}/reward`` (``{"reward": x}``). Chat completions and
responses stream (``stream: true``) as server-sent events once the whole reply is generated.
A call names its session by its API key (``Authorization: Bearer <session id>``), so plain OpenAI
client code only changes ``base_url`` and ``api_key``. Each call's generation is run by the
session's ``generate`` (the workflow's context, on the rollout loop: the controller still bounds
concurrency and records weight versions). Calls of one session run one at a time, in arrival order.

A client's mistake is a 4xx with an OpenAI error body; an engine failure is a 500 and is recorded
on the session, whose workflow then fails the run with it.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from core_rl.errors import CoreRLError
from core_rl.interfaces.sampling import GuidedDecodingUnsupported
from core_rl.rollout import template_text, text_before_stop
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from core_rl_openai_proxy import responses, responses_api
from core_rl_openai_proxy.chat import ChatTemplate, normalize_messages
from core_rl_openai_proxy.config import OpenAIAgentConfig
from core_rl_openai_proxy.errors import RequestError
from core_rl_openai_proxy.session import Generate, LastCall, Plan, Session
from core_rl_openai_proxy.tools import Reply, build_tool_parser, request_tools, split_reply

#: how long :meth:`ProxyServer.start` waits for uvicorn to listen
START_TIMEOUT_S = 30.0
#: how long the proxy keeps an idle connection open
KEEP_ALIVE_S = 600


class ProxyServer:
    """The proxy of one run (see the module docstring); ``tokenizer``: the run's."""

    def __init__(self, tokenizer: Any, config: OpenAIAgentConfig) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer, _template_text(config.chat_template))
        self.tool_parser = build_tool_parser(config.tool_parser)
        self.sessions: dict[str, Session] = {}
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._endpoint(self._chat), methods=["POST"]),
                Route("/v1/responses", self._endpoint(self._responses), methods=["POST"]),
                Route("/v1/completions", self._endpoint(self._completion), methods=["POST"]),
                Route("/v1/models", self._endpoint(self._models), methods=["GET"]),
                Route("/v1/sessions/{session}/reward", self._endpoint(self._reward), methods=["POST"]),
            ],
            exception_handlers={HTTPException: _http_error},
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}/v1"

    # -- lifetime ----------------------------------------------------------------------------

    def start(self) -> None:
        """Listen on ``config.host:config.port`` (port 0: a free one) on a daemon thread."""
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets of that protocol, and without
        # it Nagle's algorithm held each response's body behind the client's delayed ACK (~40 ms a call)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as exc:
            sock.close()
            raise CoreRLError(
                f"rollout.workflow: the OpenAI proxy cannot listen on {self.config.host}:{self.config.port}: {exc}; "
                "set rollout.workflow.port to a free port (0 picks one)"
            ) from exc
        sock.listen(1024)
        self.port = sock.getsockname()[1]
        # clients close idle connections first (openai's after 5 s): a server closing one as a
        # client reuses it would fail that call
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=KEEP_ALIVE_S
        )
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(
            target=lambda: asyncio.run(server.serve(sockets=[sock])), name="openai-proxy", daemon=True
        )
        self._thread.start()
        waited = 0.0
        while not server.started:
            if not self._thread.is_alive() or waited > START_TIMEOUT_S:
                raise CoreRLError(f"the OpenAI proxy did not listen on {self.base_url} within {START_TIMEOUT_S:g} s")
            threading.Event().wait(0.01)
            waited += 0.01

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving (joined within ``timeout``)."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout)

    # -- sessions ----------------------------------------------------------------------------

    def open(self, generate: Generate, sampling: Any, row: Any) -> Session:
        """A new session (its id is the agent's API key)."""
        session = Session(id=f"s-{uuid.uuid4().hex}", generate=generate, sampling=sampling, row=row)
        self.sessions[session.id] = session
        return session

    def end(self, session: Session) -> None:
        """Close ``session`` and forget it (later calls with its key are a 401)."""
        session.close()
        self.sessions.pop(session.id, None)

    def _session(self, request: Request) -> Session:
        auth = request.headers.get("authorization", "")
        key = auth[len("Bearer ") :].strip() if auth.startswith("Bearer ") else ""
        session = self.sessions.get(key)
        if session is None:
            raise RequestError(
                "unknown session: send the session id the workflow gave the agent as the API key "
                "(Authorization: Bearer <session>)",
                status=401,
                code="invalid_api_key",
                type="authentication_error",
            )
        return session

    # -- endpoints ---------------------------------------------------------------------------

    def _endpoint(self, handler: Callable[[Request], Awaitable[dict[str, Any] | Response]]) -> Callable:
        async def endpoint(request: Request) -> Response:
            try:
                result = await handler(request)
                return result if isinstance(result, Response) else JSONResponse(result)
            except RequestError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)

        return endpoint

    async def _body(self, request: Request, *, stream: bool = False) -> dict[str, Any]:
        """The request's JSON object, its model checked; ``stream``: the route may stream."""
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise RequestError(
                f"the model {model!r} does not exist; this proxy serves {self.config.model!r}",
                status=404,
                code="model_not_found",
                param="model",
            )
        responses.refuse_unsupported(body, stream=stream)
        return body

    async def _models(self, request: Request) -> dict[str, Any]:
        return responses.models_body(self.config.model)

    async def _reward(self, request: Request) -> dict[str, Any]:
        session = self.sessions.get(request.path_params["session"])
        if session is None:
            raise RequestError("unknown session", status=404, code="session_not_found")
        body = await self._body(request)
        value = body.get("reward")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise RequestError(f"'reward' must be a finite number, got {value!r}", param="reward")
        session.reward = float(value)
        return {"session": session.id, "reward": session.reward}

    async def _chat(self, request: Request) -> dict[str, Any] | Response:
        session = self._session(request)
        body = await self._body(request, stream=True)
        messages = normalize_messages(body.get("messages"))
        tools = request_tools(body)
        logprobs = responses.wants_logprobs(body, chat=True)
        responses_api.refuse_serial_tool_calls(body)
        plan, turn, reply, matched = await self._chat_turn(session, body, messages, tools, body.get("tool_choice"))
        ids = bool(body.get("return_token_ids"))
        completion = responses.chat_body(
            self.config.model, plan.prompt_ids, turn, reply, self.tokenizer, logprobs, ids, stop_reason=matched
        )
        if not body.get("stream"):
            return completion
        options = body.get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        chunks = responses_api.chat_chunks(completion, usage)
        return _event_stream(responses_api.sse(chunks, named=False, done=True))

    async def _responses(self, request: Request) -> dict[str, Any] | Response:
        session = self._session(request)
        body = await self._body(request, stream=True)
        responses_api.refuse_serial_tool_calls(body)
        previous = body.get("previous_response_id")
        history = None
        if previous is not None:
            history = session.responses.get(previous)
            if history is None:
                raise RequestError(
                    f"previous_response_id {previous!r} is not a response of this session; send the id of an earlier "
                    "response of the same episode, or the whole conversation as 'input'",
                    status=404,
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
        messages = normalize_messages(responses_api.input_messages(body, history))
        tools = responses_api.response_tools(body)
        choice = responses_api.chat_tool_choice(body.get("tool_choice"))
        include = body.get("include") or []
        logprobs = isinstance(include, list) and responses_api.LOGPROBS_INCLUDE in include
        chat_body = {**body, "max_tokens": body.get("max_output_tokens"), "max_completion_tokens": None}
        plan, turn, reply, matched = await self._chat_turn(session, chat_body, messages, tools, choice)
        lps = None
        if logprobs:
            completion = responses.chat_body(
                self.config.model, plan.prompt_ids, turn, reply, self.tokenizer, True, False, stop_reason=matched
            )
            lps = completion["choices"][0]["logprobs"]["content"]
        response_id = f"resp_{uuid.uuid4().hex}"
        start = 1 if body.get("instructions") else 0  # instructions do not carry over to a later response
        session.responses[response_id] = [*messages[start:], responses_api.reply_message(reply)]
        response = responses_api.response_body(self.config.model, body, response_id, plan.prompt_ids, turn, reply, lps)
        if not body.get("stream"):
            return response
        return _event_stream(responses_api.sse(responses_api.response_events(response), named=True, done=False))

    async def _chat_turn(
        self, session: Session, body: dict[str, Any], messages: list[dict[str, Any]], tools: Any, tool_choice: Any
    ) -> tuple[Plan, Any, Reply, str | None]:
        """One chat call of ``session``: its prompt planned, its turn sampled and recorded; the
        plan, the turn, the reply and the stop string that ended it (if one did)."""
        strict = self.config.on_history_mismatch == "error"
        async with session.lock:
            plan = session.plan_chat(self.template, messages, tools, strict)
            turn, stops = await self._generate(session, plan, body)
            by_string = self._stopped_by_string(turn, stops, session)
            sampled = self.tokenizer.decode(responses.content_ids(turn, by_string=by_string), skip_special_tokens=True)
            text, matched = self._reply_text(sampled, stops, turn, session) if by_string else (sampled, None)
            reply = split_reply(text, self.tool_parser, tools, tool_choice, self.config.reasoning_tags)
            stop = (
                self.tokenizer.decode(turn.response_ids[-1:]) if turn.finish_reason == "stop" and not by_string else ""
            )
            last = LastCall("chat", messages, tools, reply=sampled, stop_text=stop, message=reply.message())
            session.record(plan, turn, last)
        return plan, turn, reply, matched

    async def _completion(self, request: Request) -> dict[str, Any]:
        session = self._session(request)
        body = await self._body(request)
        prompt = body.get("prompt")
        ids_prompt = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids_prompt:
            raise RequestError("'prompt' must be one non-empty string or one list of token ids", param="prompt")
        logprobs = responses.wants_logprobs(body, chat=False)
        strict = self.config.on_history_mismatch == "error"
        async with session.lock:
            plan = session.plan_completion(self.template.encode, self.tokenizer.encode, prompt, strict)
            turn, stops = await self._generate(session, plan, body)
            by_string = self._stopped_by_string(turn, stops, session)
            sampled = self.tokenizer.decode(responses.content_ids(turn, by_string=by_string), skip_special_tokens=True)
            text, matched = self._reply_text(sampled, stops, turn, session) if by_string else (sampled, None)
            before = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=True)
            session.record(plan, turn, LastCall("completion", text=before + sampled, reply=sampled))
        ids = bool(body.get("return_token_ids"))
        return responses.completion_body(
            self.config.model, plan.prompt_ids, turn, text, self.tokenizer, logprobs, ids, stop_reason=matched
        )

    def _reply_text(self, sampled: str, stops: list[str], turn: Any, session: Session) -> tuple[str, str | None]:
        """The sampled text before the stop string that ended the turn (none may end in the text of
        the first ``min_new_tokens`` tokens), and that stop string."""
        floor = session.sampling.min_new_tokens
        before = self.tokenizer.decode(turn.response_ids[:floor], skip_special_tokens=True) if floor else ""
        return text_before_stop(sampled, stops, after=len(before))

    def _stopped_by_string(self, turn: Any, stops: list[str], session: Session) -> bool:
        def decode(ids: Any) -> str:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

        return bool(stops) and responses.stopped_by_string(turn, stops, decode, session.sampling.min_new_tokens)

    async def _generate(self, session: Session, plan: Plan, body: dict[str, Any]) -> tuple[Any, list[str]]:
        """One sampled turn of ``plan.prompt_ids`` at the run's sampling, ``max_new_tokens``
        lowered to the request's ``max_tokens`` and to what fits in ``max_context_tokens``, the
        request's ``stop`` strings added to the run's; returns the turn and the stop strings."""
        limit = self.config.max_context_tokens
        room = limit - len(plan.prompt_ids)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in plan.prompt_ids):
            raise RequestError(f"the prompt holds token ids outside the vocabulary [0, {vocab})", param="prompt")
        if room < 1:
            raise RequestError(
                f"the prompt is {len(plan.prompt_ids)} tokens; this proxy's context is {limit} tokens "
                "(rollout.workflow.max_context_tokens)",
                code="context_length_exceeded",
                param="messages",
            )
        wanted = responses.requested_max_tokens(body)
        max_new = min(session.sampling.max_new_tokens, room, wanted or room)
        stops = list(dict.fromkeys([*session.sampling.stop, *responses.requested_stops(body)]))
        response_format = responses_api.requested_response_format(body)  # a malformed one: a 400, nothing sampled
        sampling = _evolve(session.sampling, n=1, max_new_tokens=max_new, stop=stops, response_format=response_format)
        with session.guard:
            if session.closed:
                raise session.ended()
            future = asyncio.ensure_future(session.generate(plan.prompt_ids, sampling, plan.media))
            session.inflight = future
        try:
            (turn,) = await future
        except asyncio.CancelledError:
            raise session.ended() from None
        except GuidedDecodingUnsupported as exc:  # the request's, not the episode's, fault
            raise RequestError(str(exc), param="response_format", code="unsupported_parameter") from None
        except Exception as exc:
            session.error = session.error or exc
            raise RequestError(
                f"the rollout engine failed: {type(exc).__name__}: {exc}", status=500, type="server_error"
            ) from None
        finally:
            session.inflight = None
        if list(turn.prompt_ids) != list(plan.prompt_ids):
            session.error = session.error or CoreRLError("the rollout engine answered another prompt than was sent")
            raise RequestError("the rollout engine answered another prompt", status=500, type="server_error")
        return turn, stops


def _event_stream(chunks: Any) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _evolve(sampling: Any, **changes: Any) -> Any:
    import attrs

    return attrs.evolve(sampling, **changes)


def _template_text(value: str) -> str | None:
    """``rollout.workflow.chat_template``: a Jinja string, or a path to a file holding one."""
    if not value:
        return None
    text, problem = template_text(value, "rollout.workflow.chat_template")
    if problem is not None:
        raise CoreRLError(problem)
    return text


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    error = RequestError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code, code="not_found")
    return JSONResponse(error.body(), status_code=exc.status_code)
