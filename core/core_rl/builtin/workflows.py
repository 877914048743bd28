"""The built-in rollout workflow ``single_turn`` (see :mod:`core_rl.rollout.workflows`)."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl
from core_rl.rollout.workflows import SingleTurnWorkflow


def make_single_turn(config: None) -> SingleTurnWorkflow:
    return SingleTurnWorkflow()


@hookimpl
def core_rl_register_workflows(register: Register) -> None:
    register(
        "single_turn",
        make_single_turn,
        description="RLVR: one generation call for the n samples of each prompt",
    )
