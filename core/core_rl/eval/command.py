"""``core-rl eval CONFIG [KEY=VALUE ...]``: a run's evaluation (its ``eval:`` section) of one model,
with no training: the model at ``actor.model_path`` (the starting model, or a run's exported
``final_hf``, given as an override) generates through the run's rollout engine and a workflow of its
own, the run's reward scores the answers, and the ``eval/*`` metrics a training run logs come back,
computed by the same :class:`~core_rl.eval.evaluator.Evaluator`. The answers go to
``<run>/eval/step_<N>.jsonl`` (``step`` labels them; 0 by default).

The same checks as ``core-rl train`` run first (:func:`core_rl.loops.preflight.preflight`), so a mistake
in the configuration, the data or the model is one message and exit status 2. The random streams
are seeded from ``experiment.seed`` as a training run seeds them, so a greedy evaluation (the
default) gives exactly the figures of a training run's evaluation before its first step.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from core_rl.config.schema import RunConfig
from core_rl.errors import ConfigError
from core_rl.eval.evaluator import build_evaluator
from core_rl.loops.building import build, quiet_library_progress_bars, seed_process
from core_rl.loops.preflight import preflight
from core_rl.loops.rl.reward_runner import RewardRunner
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import REWARD
from core_rl.rollout.colocation import build_rollout_engine


@attrs.frozen
class EvalResult:
    """What :func:`evaluate_model` measured: the ``eval/*`` metrics (and ``timing/eval_s``) and the
    summary line a training run prints (which says where the answers went)."""

    metrics: Mapping[str, float]
    summary: str


def evaluate_model(cfg: RunConfig, *, host: PluginHost, step: int = 0) -> EvalResult:
    """Evaluate ``actor.model_path`` as ``cfg.eval`` says, labelled ``step`` (see the module docstring)."""
    if cfg.eval is None:
        raise ConfigError(["eval: the configuration has no eval section; add eval.files (the prompts to evaluate)"])
    assert cfg.reward is not None  # an eval: section without a reward is refused when the config loads
    checked = preflight(cfg)
    seed_process(cfg)
    quiet_library_progress_bars()
    run_dir = cfg.experiment.run_dir
    rollout, _ = build_rollout_engine(cfg, host, run_dir)
    reward = runner = None
    try:
        reward = build(host, REWARD, cfg.reward)
        runner = RewardRunner(reward, cfg.reward.name, cfg.reward_runner)
        evaluator = build_evaluator(
            cfg, host, engine=rollout, tokenizer=checked.tokenizer, reward_runner=runner, run_dir=run_dir
        )
        assert evaluator is not None
        metrics = evaluator.evaluate(step)
        summary = evaluator.summary()
        assert summary is not None
    finally:
        if runner is not None:
            runner.close()
        for component in (rollout, reward):
            if component is not None:
                component.close()
    return EvalResult(metrics=metrics, summary=summary)
