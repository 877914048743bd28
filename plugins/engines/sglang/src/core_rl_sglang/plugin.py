"""Registration of the ``sglang`` rollout engine and server environment (entry points in
``core_rl.rollout_engines`` and ``core_rl.server_envs``). Importing it imports neither SGLang nor torch."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl

from core_rl_sglang.config import SGLangConfig
from core_rl_sglang.env import sglang_env_spec


def _make_engine(*args, **kwargs):
    from core_rl_sglang.engine import make_engine

    return make_engine(*args, **kwargs)


@hookimpl
def core_rl_register_rollout_engines(register: Register) -> None:
    register(
        "sglang",
        _make_engine,
        description="SGLang servers over HTTP, run from their own environment (weight sync: disk, collective)",
        config_cls=SGLangConfig,
    )


@hookimpl
def core_rl_register_server_envs(register: Register) -> None:
    register("sglang", sglang_env_spec, description="SGLang inference server 0.5.23")
