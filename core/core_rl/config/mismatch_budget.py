"""``algorithm.mismatch_budget``: what a run does when the train/rollout mismatch (the trainer's
log-probs of the sampled tokens against the rollout engine's behaviour log-probs,
:mod:`core_rl.ops.mismatch`) stays too large. Importable without torch; the budget at run time:
:mod:`core_rl.loops.rl.mismatch_budget`."""

from __future__ import annotations

import attrs

from core_rl.config.plugin_spec import PluginSpec
from core_rl.config.validators import MAX_STEPS, in_range, one_of

#: what the run does once the budget is exceeded ``patience`` steps in a row
MISMATCH_ACTIONS = ("warn", "correct", "stop")
#: the metrics a budget can watch (each logged as ``mismatch/<name>``)
MISMATCH_BUDGET_METRICS = ("abs_logprob_diff", "kl_behave_trainer", "ratio_out_of_bounds")


@attrs.define
class MismatchBudgetConfig:
    """The mismatch metrics are logged every step whatever this section says
    (``mismatch/abs_logprob_diff``, ``mismatch/kl_behave_trainer``, ``mismatch/ratio_out_of_bounds``:
    the share of loss tokens whose ratio ``exp(log pi_train - log pi_behave)`` is outside
    ``[1 / ratio_bound, ratio_bound]``).

    ``threshold`` (null: no budget, the metrics only): a step whose ``metric`` exceeds it is over
    budget; after ``patience`` such steps in a row the run takes ``action``:

    - ``warn``: one line naming the metric, its value, the threshold and the step (again after
      each further ``patience`` steps over budget);
    - ``correct``: from the next step on, the policy loss applies the importance-sampling
      correction ``correction`` (a ``core_rl.rejection_samplers`` plugin section: ``tis``,
      truncated importance sampling, by default; ``mis`` masks instead) to its behaviour weight,
      and one line says so. It needs a loss that applies a correction (``ppo_clip``: the decoupled
      loss's ``pi_prox / pi_behave``, or the plain loss's ``pi_old / pi_behave`` with ``old_logprobs``
      recomputed from then on) and no ``algorithm.rejection_sampling`` already on;
    - ``stop``: the run ends with exit status 1 and one line naming the metric, its value, the
      threshold and the step, after logging that step's metrics and saving nothing of it.
    """

    metric: str = attrs.field(default="abs_logprob_diff", validator=one_of(MISMATCH_BUDGET_METRICS))
    threshold: float | None = attrs.field(default=None, validator=in_range(0.0, 1e6, low_open=True))
    action: str = attrs.field(default="warn", validator=one_of(MISMATCH_ACTIONS))
    patience: int = attrs.field(default=1, validator=in_range(1, MAX_STEPS))
    ratio_bound: float = attrs.field(default=2.0, validator=in_range(1.0, 1e6, low_open=True))
    correction: PluginSpec = attrs.field(factory=lambda: PluginSpec(name="tis"))


def mismatch_budget_problems(budget: MismatchBudgetConfig, *, rejection_sampling: PluginSpec | None) -> list[str]:
    """Problems of ``algorithm.mismatch_budget`` with the rest of ``algorithm``: an action other
    than ``warn`` without a threshold, and ``correct`` while ``algorithm.rejection_sampling``
    already applies a correction from the start (whether the loss applies one is the loss's
    ``set_rejection_sampler`` to say, before training)."""
    problems = []
    if budget.threshold is None and budget.action != "warn":
        problems.append(
            f"algorithm.mismatch_budget.action: {budget.action!r} acts when the mismatch exceeds "
            "algorithm.mismatch_budget.threshold, which is null; set a threshold"
        )
    if budget.threshold is not None and budget.action == "correct" and rejection_sampling is not None:
        problems.append(
            "algorithm.mismatch_budget.action: 'correct' turns on algorithm.mismatch_budget.correction when the "
            f"budget is exceeded, but algorithm.rejection_sampling ({rejection_sampling.name!r}) is on from the "
            "start; remove one of them"
        )
    return problems
