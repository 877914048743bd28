"""The Responses API (``POST /v1/responses``) as chat calls, and streaming as server-sent events.

A Responses request becomes the messages of a chat call, so it joins the session's trajectory
exactly as a chat completion does (:mod:`core_rl_openai_proxy.chat`): ``instructions`` is a
``system`` message first; the ``input`` (a string: one user message; or a list of items) follows
the history of ``previous_response_id`` (the messages and reply of that response, kept per session)
or stands alone when the client sends the whole conversation. Items: messages (``role`` and
``content``, a string or ``input_text``/``output_text`` parts, with or without ``type:
"message"``), ``function_call`` (an assistant message's tool call; consecutive ones, and the
assistant message before them, make one assistant message, as the reply the proxy returned) and
``function_call_output`` (a ``tool`` message); ``reasoning`` items are skipped (the reasoning is
in the sampled tokens already). ``tools`` are function tools (``{"type": "function", "name",
"parameters"}``); other tool types (web search, file search, computer use...) are a 400.

The reply: a ``reasoning`` item (with ``rollout.workflow.reasoning_tags``), a ``message`` item with
one ``output_text`` part (its ``logprobs`` with ``include: ["message.output_text.logprobs"]``), then
a ``function_call`` item per parsed tool call; ``status`` ``incomplete`` (``max_output_tokens``)
when the turn ran out of tokens.

Streaming (``stream: true``, chat completions and responses): the whole reply is generated first,
then sent as the events the ``openai`` client parses (chat: ``chat.completion.chunk`` deltas and
``data: [DONE]``; responses: ``response.created`` ... ``response.completed``); what is recorded is
the same as without streaming.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from core_rl.interfaces.sampling import required_json_schema

from core_rl_openai_proxy.chat import IMAGE_PARTS
from core_rl_openai_proxy.errors import RequestError
from core_rl_openai_proxy.tools import Reply

#: ``include`` asking for the output text's log-probs
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def requested_response_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The structured output a request asks for, in the chat form the rollout engine takes
    (:attr:`core_rl.interfaces.SamplingParams.response_format`): ``response_format`` (chat and
    completions) or ``text.format`` (responses, whose ``json_schema`` keeps ``name``, ``schema`` and
    ``strict`` beside ``type``); ``None`` for none or ``{"type": "text"}``. A malformed one is a 400.
    The engine then samples under the constraint (guided decoding), the whole reply included: with
    ``tools``, a turn so constrained cannot call a tool, as on vLLM's own server."""
    text = body.get("text")
    asked = {"response_format": body.get("response_format")}
    asked["text.format"] = text.get("format") if isinstance(text, Mapping) else None
    for param, value in asked.items():
        kind = value.get("type") if isinstance(value, Mapping) else None
        if value is None or kind == "text":
            continue
        if kind == "json_schema" and param == "text.format":  # the Responses form: the schema's fields beside type
            value = {"type": "json_schema", "json_schema": {k: v for k, v in value.items() if k != "type"}}
        try:
            required_json_schema(value)
        except ValueError:
            form = "'schema': {...}" if param == "text.format" else "'json_schema': {'schema': {...}}"
            raise RequestError(
                f"'{param}' must be {{'type': 'text'}}, {{'type': 'json_object'}} or "
                f"{{'type': 'json_schema', {form}}}; got {value!r:.200}",
                param=param,
                code="invalid_value",
            ) from None
        return dict(value)
    return None


def refuse_serial_tool_calls(body: Mapping[str, Any]) -> None:
    """400 for ``parallel_tool_calls: false``: the proxy returns the calls the model sampled and
    cannot make it sample at most one (true or unset: every parsed call is returned)."""
    if body.get("parallel_tool_calls") is False and body.get("tools"):
        raise RequestError(
            "'parallel_tool_calls': false cannot be honoured: the proxy returns every tool call the model sampled "
            "(the tool parser and chat template decide how many; the trajectory must keep them all); leave it "
            "unset or true (openai-agents: ModelSettings(parallel_tool_calls=None))",
            param="parallel_tool_calls",
            code="unsupported_parameter",
        )


# -- requests ------------------------------------------------------------------------------


def response_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The request's Responses-style function tools in chat form (``None``: none)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of function tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not tool.get("name"):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(
                f"tools[{i}] is a {kind!r} tool; the proxy serves function tools only "
                "({'type': 'function', 'name': ..., 'parameters': ...}): hosted tools run at OpenAI, not here",
                param=f"tools[{i}]",
            )
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """A Responses ``tool_choice`` in chat form (``{"type": "function", "name": n}`` becomes
    ``{"type": "function", "function": {"name": n}}``)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}.content[{k}] is {kind!r}; only text parts are supported", param=where)
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string or a list of text parts", param=where)


def input_messages(body: Mapping[str, Any], history: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The chat messages of a Responses request (module docstring): ``instructions``, then
    ``history`` (that of ``previous_response_id``), then the ``input`` items."""
    value = body.get("input")
    items = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a non-empty string or list of input items", param="input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    messages += [dict(m) for m in history or []]
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an input item object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role must be user, system, developer or assistant", param=where)
            content = item.get("content", "")
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in content):
                messages.append({"role": role, "content": list(content)})  # images: normalize_messages takes the parts
            else:
                messages.append({"role": role, "content": _text(content, where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
                raise RequestError(
                    f"{where}: a function_call needs 'name' and 'arguments' (a JSON string)", param=where
                )
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(output, where)})
        elif kind == "reasoning":
            continue
        else:
            raise RequestError(
                f"{where} is a {kind!r} item; the proxy takes message, function_call, function_call_output "
                "and reasoning items",
                param=where,
            )
    return messages


# -- replies -------------------------------------------------------------------------------


def response_body(
    model: str,
    body: Mapping[str, Any],
    response_id: str,
    prompt_ids: Sequence[int],
    turn: Any,
    reply: Reply,
    logprobs: list[dict[str, Any]] | None,
    *,
    status: str = "completed",
) -> dict[str, Any]:
    """A ``response`` object for ``reply`` (``status`` ``in_progress`` for the first stream event,
    with no output yet)."""
    output: list[dict[str, Any]] = []
    if status != "in_progress":
        if reply.reasoning_content is not None:
            output.append(
                {
                    "type": "reasoning",
                    "id": f"rs_{uuid.uuid4().hex}",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": reply.reasoning_content}],
                }
            )
        if reply.content or not reply.tool_calls:
            part: dict[str, Any] = {"type": "output_text", "text": reply.content or "", "annotations": []}
            if logprobs is not None:
                part["logprobs"] = logprobs
            output.append(
                {
                    "type": "message",
                    "id": f"msg_{uuid.uuid4().hex}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [part],
                }
            )
        for call in reply.tool_calls:
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                    "status": "completed",
                }
            )
    incomplete = status != "in_progress" and turn.finish_reason == "length"
    n, m = len(prompt_ids), len(turn.response_ids)
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "output": output,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": list(body.get("tools") or []),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "usage": {
            "input_tokens": n,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": m,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n + m,
        },
    }


def reply_message(reply: Reply) -> dict[str, Any]:
    """The assistant message a later call's history holds for ``reply`` (chat form)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or ""}
    if reply.tool_calls:
        message["tool_calls"] = [dict(c) for c in reply.tool_calls]
    return message


def response_events(response: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The stream of a finished ``response``: created, in progress, each output item added,
    its text or arguments as one delta and done, then completed (or incomplete)."""
    seq = iter(range(10**9))
    head = {**response, "status": "in_progress", "output": [], "incomplete_details": None}
    yield {"type": "response.created", "sequence_number": next(seq), "response": head}
    yield {"type": "response.in_progress", "sequence_number": next(seq), "response": head}
    for index, item in enumerate(response["output"]):
        base = {"output_index": index}
        if item["type"] == "message":
            yield {
                **base,
                "type": "response.output_item.added",
                "sequence_number": next(seq),
                "item": {**item, "status": "in_progress", "content": []},
            }
            for k, part in enumerate(item["content"]):
                ids = {**base, "item_id": item["id"], "content_index": k}
                empty = {**part, "text": ""}
                empty.pop("logprobs", None)
                yield {**ids, "type": "response.content_part.added", "sequence_number": next(seq), "part": empty}
                lps = part.get("logprobs") or []
                yield {
                    **ids,
                    "type": "response.output_text.delta",
                    "sequence_number": next(seq),
                    "delta": part["text"],
                    "logprobs": lps,
                }
                yield {
                    **ids,
                    "type": "response.output_text.done",
                    "sequence_number": next(seq),
                    "text": part["text"],
                    "logprobs": lps,
                }
                yield {**ids, "type": "response.content_part.done", "sequence_number": next(seq), "part": part}
        elif item["type"] == "function_call":
            yield {
                **base,
                "type": "response.output_item.added",
                "sequence_number": next(seq),
                "item": {**item, "arguments": "", "status": "in_progress"},
            }
            ids = {**base, "item_id": item["id"]}
            yield {
                **ids,
                "type": "response.function_call_arguments.delta",
                "sequence_number": next(seq),
                "delta": item["arguments"],
            }
            yield {
                **ids,
                "type": "response.function_call_arguments.done",
                "sequence_number": next(seq),
                "arguments": item["arguments"],
                "name": item["name"],
            }
        else:
            yield {**base, "type": "response.output_item.added", "sequence_number": next(seq), "item": item}
        yield {**base, "type": "response.output_item.done", "sequence_number": next(seq), "item": item}
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield {"type": done, "sequence_number": next(seq), "response": response}


def chat_chunks(completion: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` stream of a finished ``chat.completion``: the role, the
    content (with its log-probs), the tool calls, then the finish reason (and a usage chunk)."""
    choice = completion["choices"][0]
    message = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}]}

    yield chunk({"role": "assistant", "content": ""})
    if message.get("reasoning_content") is not None:
        yield chunk({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        yield chunk({"content": message["content"]}, logprobs=choice.get("logprobs"))
    for k, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function", "function": call["function"]}]})
    extra = {key: choice[key] for key in ("stop_reason", "token_ids", "prompt_token_ids") if key in choice}
    yield chunk({}, finish_reason=choice["finish_reason"], **extra)
    if include_usage:
        yield {**head, "choices": [], "usage": completion["usage"]}


def sse(events: Iterator[dict[str, Any]], *, named: bool, done: bool) -> Iterator[bytes]:
    """``events`` as server-sent events (``named``: each with an ``event:`` line of its type;
    ``done``: a closing ``data: [DONE]``)."""
    for event in events:
        head = f"event: {event['type']}\n" if named else ""
        yield f"{head}data: {json.dumps(event)}\n\n".encode()
    if done:
        yield b"data: [DONE]\n\n"
