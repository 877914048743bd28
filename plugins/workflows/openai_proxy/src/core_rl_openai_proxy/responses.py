"""Request fields the proxy reads and the OpenAI-schema bodies it answers with.

Sampling: the run's ``rollout.sampling`` (temperature, top-p, top-k, min-p, the penalties) is
always what samples, so the behaviour log-probs are those the trainer's importance ratio expects; a
request's ``temperature``, ``top_p``, ``min_p`` (vLLM's and SGLang's extension), ``seed``,
``frequency_penalty``, ``presence_penalty``, ``repetition_penalty`` (vLLM's and SGLang's)... are
accepted and ignored (set the run's ``rollout.sampling`` penalties instead). ``max_tokens`` (or
``max_completion_tokens``) lowers the run's ``max_new_tokens``, never raises it. ``stop`` (a
string or up to :data:`MAX_STOP_STRINGS` of them) joins the run's ``rollout.sampling.stop``: the
turn ends at the token that completes one (it stays in the trajectory, :mod:`core_rl.rollout.stop_strings`)
and the returned text ends before it, as OpenAI's does. ``n > 1`` is refused (400): one call is
one sampled turn of one trajectory; so is ``stream`` on legacy completions (chat completions and
responses stream: :mod:`core_rl_openai_proxy.responses_api`).
Tool calls in a chat reply: :mod:`core_rl_openai_proxy.tools`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from core_rl.protocol import Sample
from core_rl.rollout import stop_cut

from core_rl_openai_proxy.errors import RequestError
from core_rl_openai_proxy.tools import Reply

#: the most ``top_logprobs`` OpenAI accepts
MAX_TOP_LOGPROBS = 20
#: the most ``stop`` strings OpenAI accepts in one request
MAX_STOP_STRINGS = 4


def requested_max_tokens(body: Mapping[str, Any]) -> int | None:
    """``max_completion_tokens`` or ``max_tokens`` (a positive integer), or ``None``."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(f"'{key}' must be a positive integer, got {value!r}", param=key)
        return value
    return None


def refuse_unsupported(body: Mapping[str, Any], *, stream: bool = False) -> None:
    """400 for what one sampled turn of one trajectory cannot do: ``n > 1``; streaming where the
    route does not stream (``stream``: it does)."""
    if body.get("n") not in (None, 1):
        raise RequestError("the proxy samples one choice per call: 'n' must be 1", param="n")
    if body.get("stream") and not stream:
        raise RequestError(
            "this route does not stream: leave 'stream' unset (chat completions and responses stream)", param="stream"
        )
    requested_stops(body)


def requested_stops(body: Mapping[str, Any]) -> list[str]:
    """The request's ``stop``: a string, or a list of at most :data:`MAX_STOP_STRINGS` non-empty
    strings (null or absent: none)."""
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or not 0 < len(stops) <= MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise RequestError(
            f"'stop' must be a non-empty string or a list of 1 to {MAX_STOP_STRINGS} non-empty strings", param="stop"
        )
    return list(stops)


def wants_logprobs(body: Mapping[str, Any], chat: bool) -> bool:
    """Whether the response carries log-probs (chat: ``logprobs: true``; completions: ``logprobs: k``)."""
    value = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise RequestError(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        return bool(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 5):
        raise RequestError("'logprobs' must be an integer in [0, 5]", param="logprobs")
    return value is not None


def content_ids(turn: Sample, *, by_string: bool = False) -> list[int]:
    """The sampled ids without the stop token that ended the turn (it is not part of the reply);
    all of them when a stop string ended it (``by_string``: its text is cut instead)."""
    ids = list(turn.response_ids)
    return ids[:-1] if turn.finish_reason == "stop" and ids and not by_string else ids


def stopped_by_string(turn: Sample, stops: Sequence[str], decode: Any, min_tokens: int) -> bool:
    """Whether a stop string, not a stop token, ended ``turn``: its last token completes one."""
    ids = turn.response_ids
    return turn.finish_reason == "stop" and stop_cut(ids, decode, stops, min_tokens=min_tokens) == len(ids)


def _usage(prompt_ids: Sequence[int], turn: Sample) -> dict[str, int]:
    n, m = len(prompt_ids), len(turn.response_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def _token_ids(prompt_ids: Sequence[int], turn: Sample) -> dict[str, Any]:
    return {"prompt_token_ids": list(prompt_ids), "token_ids": list(turn.response_ids)}


def chat_body(
    model: str,
    prompt_ids: Sequence[int],
    turn: Sample,
    reply: Reply,
    tokenizer: Any,
    logprobs: bool,
    token_ids: bool,
    *,
    stop_reason: str | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` body: the ``reply``'s content and tool calls (``finish_reason``
    ``tool_calls`` when it has some); ``token_ids`` adds the prompt's and the sampled ids to the
    choice (``return_token_ids`` in the request, as vLLM does); ``stop_reason``: the stop string
    that ended the turn (as vLLM reports it; its sampled tokens are all in ``token_ids``)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning_content is not None:
        message["reasoning_content"] = reply.reasoning_content
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": reply.finish_reason(turn.finish_reason),
        "stop_reason": stop_reason,
        "logprobs": None,
    }
    if logprobs:
        ids = content_ids(turn, by_string=stop_reason is not None)
        choice["logprobs"] = {
            "content": [
                {"token": (t := tokenizer.decode([i])), "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for i, lp in zip(ids, turn.logprobs)
            ]
        }
    if token_ids:
        choice.update(_token_ids(prompt_ids, turn))
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt_ids, turn),
    }


def completion_body(
    model: str,
    prompt_ids: Sequence[int],
    turn: Sample,
    text: str,
    tokenizer: Any,
    logprobs: bool,
    token_ids: bool,
    *,
    stop_reason: str | None = None,
) -> dict[str, Any]:
    """A ``text_completion`` body (legacy log-probs: tokens, token_logprobs, text_offset);
    ``stop_reason`` as in :func:`chat_body`."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "finish_reason": turn.finish_reason,
        "stop_reason": stop_reason,
        "logprobs": None,
    }
    if logprobs:
        ids = content_ids(turn, by_string=stop_reason is not None)
        tokens = [tokenizer.decode([i]) for i in ids]
        offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": list(turn.logprobs[: len(ids)]),
            "top_logprobs": None,
            "text_offset": offsets,
        }
    if token_ids:
        choice.update(_token_ids(prompt_ids, turn))
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt_ids, turn),
    }


def models_body(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "core-rl"}]}
