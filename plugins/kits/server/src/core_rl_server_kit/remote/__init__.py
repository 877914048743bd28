"""Rollout engines backed by inference servers spoken to over HTTP (the base of ``vllm`` and
``sglang``): :class:`ServerRolloutEngine` and the ``server`` config section, :class:`ServerOptions`.

The parts: :mod:`~core_rl_server_kit.remote.engine` (the engine: servers, its loop, pause and resume),
:mod:`~core_rl_server_kit.remote.generation` (requests, retries, batching), :mod:`~core_rl_server_kit.remote.weights`
(weight updates by disk or collective), :mod:`~core_rl_server_kit.remote.recovery` (a server that dies),
:mod:`~core_rl_server_kit.remote.options` and :mod:`~core_rl_server_kit.remote.wire` (what travels over HTTP).
"""

from core_rl_server_kit.remote.engine import ServerRolloutEngine
from core_rl_server_kit.remote.options import ServerOptions
from core_rl_server_kit.remote.recovery import Endpoint
from core_rl_server_kit.remote.wire import (
    Completion,
    ServerReplyError,
    check_prompt_and_sampling,
    json_post,
    versions_from_spans,
)

__all__ = [
    "Completion",
    "Endpoint",
    "ServerOptions",
    "ServerReplyError",
    "ServerRolloutEngine",
    "check_prompt_and_sampling",
    "json_post",
    "versions_from_spans",
]
