"""The ``eval:`` section: the policy evaluated on held-out prompts while it trains
(:mod:`core_rl.eval.evaluator` runs it, :mod:`core_rl.eval.metrics` sums it up)."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from core_rl.config.sampling import SamplingConfig
from core_rl.config.validators import MAX_COUNT, MAX_STEPS, MAX_TOKENS, auto_or, each, finite, in_range, not_empty


@attrs.define
class EvalSamplingConfig:
    """How evaluation samples: ``rollout.sampling`` with these keys replaced (a key left ``null``
    keeps the run's value). By default one greedy answer per prompt; for pass@k set
    ``greedy: false``, a ``temperature`` and ``n`` (at least k). ``extra`` replaces the run's
    ``rollout.sampling.extra`` as a whole (``{}``: no server parameters while evaluating)."""

    n: int = attrs.field(default=1, validator=in_range(1, MAX_COUNT))
    greedy: bool = True
    temperature: float | None = attrs.field(default=None, validator=in_range(0.0, 100.0, low_open=True))
    top_p: float | None = attrs.field(default=None, validator=in_range(0.0, 1.0, low_open=True))
    top_k: int | None = attrs.field(default=None, validator=in_range(0, MAX_TOKENS))
    min_p: float | None = attrs.field(default=None, validator=in_range(0.0, 1.0, high_open=True))
    repetition_penalty: float | None = attrs.field(default=None, validator=in_range(0.0, 2.0, low_open=True))
    frequency_penalty: float | None = attrs.field(default=None, validator=in_range(-2.0, 2.0))
    presence_penalty: float | None = attrs.field(default=None, validator=in_range(-2.0, 2.0))
    max_new_tokens: int | None = attrs.field(default=None, validator=in_range(1, MAX_TOKENS))
    extra: dict[str, Any] | None = None

    def __attrs_post_init__(self) -> None:
        if self.extra:  # keys of the sampling section itself are refused, as in rollout.sampling.extra
            SamplingConfig(extra=self.extra)

    def resolve(self, run: SamplingConfig) -> SamplingConfig:
        """``run`` with the keys this section sets (raises the sampling section's own
        ``FieldValueError`` where the result is inconsistent, e.g. ``min_new_tokens`` above
        ``max_new_tokens``)."""
        return attrs.evolve(run, **{k: v for k, v in attrs.asdict(self).items() if v is not None})


@attrs.define
class EvalConfig:
    """Evaluation: every prompt of ``files`` (files, saved datasets or ``hf:`` datasets, like
    ``data.train_files``; the first ``max_prompts`` of them when that is above 0) answered by the
    current policy through the run's rollout engine and workflow, scored by the run's ``reward``,
    without training on them.

    When: every ``every_n_steps`` steps (0: not on a schedule), ``before_train`` (the starting
    policy, before step 1 of a fresh run; logged at step 0) and ``at_end`` (after the last step,
    unless the schedule just evaluated it). The metrics (``eval/*``, :mod:`core_rl.eval.metrics`)
    go to every logger with that step's; ``save_samples`` writes every answer with its reward to
    ``<run>/eval/step_<N>.jsonl``.

    ``prompt_key``: the prompt column (null: ``data.prompt_key``); the data section's
    ``max_prompt_tokens``, ``apply_chat_template`` and ``filter_overlong_prompts`` apply. ``batch_size``: prompts per
    generation batch: ``auto`` (the default) sends every prompt at once (up to :data:`MAX_COUNT` samples a
    batch) and leaves the batching to the rollout engine, which bounds its own (the ``hf`` engine generates
    ``max_batch_size`` sequences at a time, a server schedules the requests it is sent); a number: that many
    prompts a batch (0: ``data.batch_size``). ``pass_reward``: a sample with at least this reward
    counts as correct (pass@k). ``group_by``: a column (e.g. ``data_source``) whose values get
    metrics of their own (``eval/<column>=<value>/...``). ``sampling``: :class:`EvalSamplingConfig`.
    """

    files: list[str] = attrs.field(factory=list, validator=each(not_empty()))
    prompt_key: str | None = attrs.field(default=None, validator=not_empty())
    every_n_steps: int = attrs.field(default=0, validator=in_range(0, MAX_STEPS))
    before_train: bool = False
    at_end: bool = True
    batch_size: int | Literal["auto"] = attrs.field(default="auto", validator=auto_or(in_range(0, MAX_COUNT)))
    max_prompts: int = attrs.field(default=0, validator=in_range(0, MAX_COUNT))
    pass_reward: float = attrs.field(default=1.0, validator=finite())
    group_by: str | None = attrs.field(default=None, validator=not_empty())
    save_samples: bool = True
    sampling: EvalSamplingConfig = attrs.field(factory=EvalSamplingConfig)

    def prompts_per_batch(self, prompts: int, data_batch_size: int) -> int:
        """Prompts per generation batch of an evaluation of ``prompts`` prompts (``batch_size``):
        ``auto``: all of them, at most ``MAX_COUNT // sampling.n``; 0: ``data_batch_size``; at least 1."""
        if self.batch_size == "auto":
            return max(1, min(prompts, MAX_COUNT // self.sampling.n))
        return self.batch_size or data_batch_size

    def due(self, step: int, *, last_step: int, start_step: int) -> bool:
        """Whether an evaluation follows step ``step`` (1-based) of a run that starts after step
        ``start_step`` and ends with ``last_step``; step 0: before the first step, which
        ``before_train`` asks for in a fresh run (``start_step`` 0) only."""
        if step == 0:
            return self.before_train and start_step == 0
        scheduled = self.every_n_steps > 0 and step % self.every_n_steps == 0
        return scheduled or (self.at_end and step == last_step)
