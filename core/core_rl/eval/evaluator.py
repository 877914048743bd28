"""Evaluation on held-out prompts while training (the ``eval:`` section,
:class:`~core_rl.config.eval_config.EvalConfig`), on rank 0.

Every prompt of ``eval.files`` goes, in file order, through the run's rollout engine and workflow
(a workflow instance of its own) with ``eval.sampling`` merged into ``rollout.sampling``; the answers
are scored by the run's reward runner and summed up by
:func:`core_rl.eval.metrics.eval_metrics`. Nothing is trained on them. The prompts go to the
engine ``eval.batch_size`` at a time (:meth:`~core_rl.config.eval_config.EvalConfig.prompts_per_batch`):
by default (``auto``) all at once, as one ``generate`` call (or every request in flight) that the
engine cuts into the batches its memory allows.

Evaluating does not change what the run trains on: in a synchronous run (nothing generates for
training meanwhile) the random streams training draws from are restored afterwards: the global ones
a checkpoint keeps (:func:`core_rl.checkpoint.files.capture_rng`: Python's, NumPy's, torch's CPU and
CUDA generators) and the rollout engine's own state, such as the ``hf`` engine's seeded generator.
So a run with evaluation trains exactly as one without (for engines whose sampling randomness lives
in this process: a server's own generator moves on). In an asynchronous run they are left alone,
since training's rollout draws from them at the same time.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from core_rl.checkpoint.atomic import write_text_atomic
from core_rl.checkpoint.files import capture_rng, restore_rng
from core_rl.config.schema import RunConfig
from core_rl.data.prompts import PromptItem, check_eval_data, eval_data_config, tokenise_rows
from core_rl.errors import DataError
from core_rl.eval.metrics import ScoredPrompt, eval_metrics
from core_rl.interfaces import RolloutEngine
from core_rl.loops.building import build
from core_rl.loops.rl.reward_runner import RewardRunner
from core_rl.loops.rl.sample_log import rendered_prompt, score_samples
from core_rl.loops.run_progress import RunProgress
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import WORKFLOW
from core_rl.reliability.progress import PROGRESS
from core_rl.rollout.colocation import RolloutSleep
from core_rl.rollout.controller import RolloutController
from core_rl.rollout.workflows import RolloutWorkflow
from core_rl.sync.background_load import BackgroundWeightLoad


class EvalPrompts:
    """The evaluation prompts in order, ``batch_size`` per batch (the last one may be smaller): the
    data source of the evaluation's rollout controller."""

    def __init__(self, items: Sequence[PromptItem], batch_size: int) -> None:
        self.items, self.batch_size, self.position = list(items), batch_size, 0

    @property
    def batches(self) -> int:
        return -(-len(self.items) // self.batch_size)

    def next_batch(self) -> list[PromptItem]:
        batch = self.items[self.position : self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.position = int(state["position"])


@contextlib.contextmanager
def training_randomness_kept(engine: RolloutEngine, *, keep: bool) -> Iterator[None]:
    """With ``keep``, the random streams training draws from are as they were when the body began
    (see the module docstring); without it, nothing is restored."""
    if not keep:
        yield
        return
    global_states, engine_state = capture_rng(), engine.state_dict()
    try:
        yield
    finally:
        restore_rng(global_states)
        engine.load_state_dict(engine_state)


def build_evaluator(cfg: RunConfig, host: PluginHost, **parts: Any) -> Evaluator | None:
    """Rank 0's :class:`Evaluator` of ``cfg`` (``None`` without an ``eval:`` section), with a rollout
    workflow of its own; ``parts``: the rest of its keyword arguments."""
    if cfg.eval is None:
        return None
    return Evaluator(cfg, workflow=build(host, WORKFLOW, cfg.rollout.workflow), **parts)


class Evaluator:
    """Rank 0's evaluation of a run (see the module docstring). ``workflow``: an instance of the
    run's rollout workflow for evaluation alone."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        engine: RolloutEngine,
        workflow: RolloutWorkflow,
        tokenizer: Any,
        reward_runner: RewardRunner,
        run_dir: Path,
    ) -> None:
        assert cfg.eval is not None
        self.config = cfg.eval
        self.engine, self.workflow, self.tokenizer, self.reward_runner = engine, workflow, tokenizer, reward_runner
        self.run_dir = run_dir
        data = eval_data_config(cfg)
        rows, problems = check_eval_data(cfg, {})  # the reward's columns: preflight checked them
        if not problems:
            self.items, problems = tokenise_rows(rows, data, tokenizer, files_key="eval.files")
        if problems:
            raise DataError(problems)
        self.batch_size = cfg.eval.prompts_per_batch(len(self.items), cfg.data.batch_size)
        self.sampling = cfg.eval.sampling.resolve(cfg.rollout.sampling).to_params()
        run = cfg.rollout.controller
        synchronous = run.max_head_offpolicyness == 0
        batches = EvalPrompts(self.items, self.batch_size).batches
        # a controller of its own: the weights do not change while it runs, so any batch may start
        # (the bound is counted in weight versions), two batches in flight unless the run sets its
        # own limit, sent to the engine as the run sends them
        self.controller_config = attrs.evolve(
            run,
            max_head_offpolicyness=batches - 1,
            max_concurrent_rollouts=run.max_concurrent_rollouts or 2 * self.batch_size,
            queue_size=0,
            batching="wave" if run.batching == "wave" or (run.batching == "auto" and synchronous) else "request",
        )
        self.keeps_randomness = synchronous
        self.latest: tuple[int, dict[str, float]] | None = None  # the last evaluation's step and metrics

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the rollout engine's current weights (those of step ``step``; 0: before
        training); the ``eval/*`` metrics and ``timing/eval_s``."""
        start = time.perf_counter()
        with training_randomness_kept(self.engine, keep=self.keeps_randomness):
            prompts, groups = self._generate()
        scored, records = self._score(prompts, groups, step)
        metrics = eval_metrics(
            scored, n=self.sampling.n, pass_reward=self.config.pass_reward, group_by=self.config.group_by
        )
        if self.config.save_samples:
            lines = "".join(json.dumps(r, ensure_ascii=False, allow_nan=True) + "\n" for r in records)
            (self.run_dir / "eval").mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.run_dir / "eval" / f"step_{step:06d}.jsonl", lines)
        metrics["timing/eval_s"] = time.perf_counter() - start
        self.latest = (step, metrics)
        return metrics

    def summary(self) -> str | None:
        """The run summary's line of the last evaluation (``None`` before the first)."""
        if self.latest is None:
            return None
        step, m = self.latest
        where = f" ({self.run_dir / 'eval'})" if self.config.save_samples else ""
        return (
            f"eval:       step {step}: reward {m.get('eval/reward/mean', float('nan')):.4g}, pass@1 "
            f"{m.get('eval/pass@1', float('nan')):.4g} over {int(m['eval/prompts'])} prompts{where}"
        )

    def _generate(self) -> tuple[list[PromptItem], list[list[Any]]]:
        """Every prompt's group of answers, in order."""
        source = EvalPrompts(self.items, self.batch_size)
        controller = RolloutController(
            self.engine,
            self.workflow,
            source,
            self.sampling,
            self.controller_config,
            batch_size=self.batch_size,
            tokenizer=self.tokenizer,
            generate_threads=torch.get_num_threads(),
        )
        prompts: list[PromptItem] = []
        groups: list[list[Any]] = []
        try:
            controller.start()
            for _ in range(source.batches):
                wave = controller.take(new_step=True)
                prompts.extend(wave.prompts)
                groups.extend(wave.groups)
        finally:
            controller.close()
        return prompts, groups

    def _score(
        self, prompts: list[PromptItem], groups: list[list[Any]], step: int
    ) -> tuple[list[ScoredPrompt], list[dict[str, Any]]]:
        """Score every answer; each prompt's scored answers and one record per answer."""
        samples = [s for group in groups for s in group]
        owners = [p for p, group in zip(prompts, groups) for _ in group]
        inputs, result = score_samples(self.reward_runner, self.tokenizer, samples, owners, step)
        column = self.config.group_by
        scored, records, i = [], [], 0
        for index, (prompt, group) in enumerate(zip(prompts, groups)):
            rendered = rendered_prompt(self.tokenizer, prompt.prompt_ids)
            kept = [j for j in range(i, i + len(group)) if result.scores[j] is not None]
            label = None if column is None else str(prompt.row.get(column))
            scored.append(
                ScoredPrompt(
                    rewards=[float(result.scores[j]) for j in kept],  # type: ignore[arg-type]
                    lengths=[len(samples[j].response_ids) for j in kept],
                    truncated=[samples[j].finish_reason == "length" for j in kept],
                    parts={name: [values[j] for j in kept] for name, values in result.parts.items()},
                    answers=None if result.answers is None else [result.answers[j] for j in kept],
                    group=label,
                    dropped=len(group) - len(kept),
                )
            )
            for j in range(i, i + len(group)):
                score = result.scores[j]
                records.append(
                    {
                        "step": step,
                        "prompt_index": index,
                        "prompt": prompt.text,
                        "rendered_prompt": rendered,
                        "response": inputs[j].response_text,
                        "reward": None if score is None else float(score),
                        "correct": score is not None and score >= self.config.pass_reward,
                        "parts": {name: values[j] for name, values in result.parts.items()},
                        **({"answer": result.answers[j]} if result.answers is not None else {}),
                        "finish_reason": samples[j].finish_reason,
                        **({column: label} if column is not None else {}),
                    }
                )
            i += len(group)
        return scored, records


class EvaluationStage:
    """The evaluation stage of the RL loop: when an evaluation is due (every rank knows) and, on
    rank 0 (which alone holds the ``evaluator``; ``None`` elsewhere and without an ``eval:``
    section), running it once the rollout engine holds the step's weights (``weight_load`` waited
    for) and its memory (``rollout_sleep``)."""

    def __init__(
        self,
        cfg: RunConfig,
        progress: RunProgress,
        *,
        evaluator: Evaluator | None,
        weight_load: BackgroundWeightLoad,
        rollout_sleep: RolloutSleep,
    ) -> None:
        self.cfg, self.progress, self.evaluator = cfg, progress, evaluator
        self.weight_load, self.rollout_sleep = weight_load, rollout_sleep

    def due(self, step: int) -> bool:
        """Whether an evaluation follows step ``step`` (0: before the first; every rank knows)."""
        last = self.cfg.trainer.total_steps
        start = self.progress.start_step
        return self.cfg.eval is not None and self.cfg.eval.due(step, last_step=last, start_step=start)

    def after(self, step: int) -> dict[str, float]:
        """Rank 0: the ``eval/*`` metrics when an evaluation follows step ``step``, else none."""
        if self.evaluator is None or not self.due(step):
            return {}
        with PROGRESS.phase("evaluation"):
            self.weight_load.wait()
            self.rollout_sleep.before_generation()
            return self.evaluator.evaluate(step)

    def summary(self) -> str | None:
        """The run summary's line of the last evaluation (``None``: none ran here)."""
        return self.evaluator.summary() if self.evaluator is not None else None
