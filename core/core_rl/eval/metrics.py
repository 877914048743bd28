"""What an evaluation reports, from each prompt's scored answers (``eval/*`` metrics).

An answer is correct when its reward is at least ``eval.pass_reward``. For a prompt with ``n``
answers of which ``c`` are correct, the unbiased estimate of pass@k (the chance that at least one
of ``k`` answers drawn without replacement from the ``n`` is correct) is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

reported for k = 1, 2, 4, ... below ``n`` and for k = ``n``, averaged over the prompts that have at
least k answers (pass@1 is the fraction of correct answers, averaged per prompt). Metrics:

- ``eval/prompts``, ``eval/samples`` (answers scored), ``eval/dropped`` (answers a failing reward
  dropped under ``reward_runner.on_error: drop``);
- ``eval/reward/{mean,std,max,min}`` over the answers, ``eval/best_reward/mean`` (each prompt's best
  answer, averaged over prompts; with several answers per prompt), ``eval/pass@k``;
- ``eval/response_length/mean`` (tokens) and ``eval/truncated`` (the fraction of answers that
  reached ``max_new_tokens``);
- ``eval/maj@n`` (with ``n > 1``, a reward that reads answers: ``RewardScores.answers``): the
  fraction of prompts whose majority answer is correct. Each prompt's answers that were found vote
  (exact strings after stripping spaces); the most frequent wins, a tie going to the one given
  first; it is correct when the first answer giving it scored at least ``eval.pass_reward``. A
  prompt where no answer was found counts as wrong;
- ``eval/parts/<name>/mean`` for each named part of the reward;
- with ``eval.group_by``: ``eval/<column>=<value>/{prompts,reward/mean,pass@1,pass@n}`` per value.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence

import attrs

from core_rl.loops.rl.batching import value_stats

_UNSAFE = re.compile(r"[^\w.\-]+")


@attrs.frozen
class ScoredPrompt:
    """One evaluation prompt's answers that were scored: their rewards, reward parts (name ->
    one value per answer), response lengths and whether each reached ``max_new_tokens``; the
    prompt's ``group`` (its ``eval.group_by`` value); how many answers a failing reward dropped."""

    rewards: list[float]
    lengths: list[int]
    truncated: list[bool]
    parts: Mapping[str, list[float | None]] = attrs.field(factory=dict)
    answers: list[str | None] | None = None
    group: str | None = None
    dropped: int = 0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with ``n`` answers, ``c`` of them correct (``k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def k_values(n: int) -> list[int]:
    """The k of the pass@k reported for ``n`` answers per prompt: powers of two below ``n``, and ``n``."""
    ks = [1 << j for j in range(n.bit_length()) if (1 << j) < n]
    return [*ks, n]


def _correct(prompt: ScoredPrompt, pass_reward: float) -> int:
    return sum(r >= pass_reward for r in prompt.rewards)


def majority_correct(prompt: ScoredPrompt, pass_reward: float) -> bool:
    """Whether the prompt's majority answer (see the module docstring) is correct."""
    votes: dict[str, list[int]] = {}
    for i, answer in enumerate(prompt.answers or ()):
        if answer is not None:
            votes.setdefault("".join(answer.split()), []).append(i)
    if not votes:
        return False
    winner = max(votes.values(), key=len)  # the first of the most frequent: dicts keep insertion order
    return prompt.rewards[winner[0]] >= pass_reward


def _pass_metrics(prompts: Sequence[ScoredPrompt], pass_reward: float, ks: Sequence[int], prefix: str) -> dict:
    out = {}
    for k in ks:
        values = [pass_at_k(len(p.rewards), _correct(p, pass_reward), k) for p in prompts if len(p.rewards) >= k]
        if values:
            out[f"{prefix}/pass@{k}"] = statistics.fmean(values)
    return out


def eval_metrics(prompts: Sequence[ScoredPrompt], *, n: int, pass_reward: float, group_by: str | None = None) -> dict:
    """The ``eval/*`` metrics of the module docstring; ``n``: answers asked for per prompt."""
    rewards = [r for p in prompts for r in p.rewards]
    lengths = [x for p in prompts for x in p.lengths]
    out: dict[str, float] = {
        "eval/prompts": float(len(prompts)),
        "eval/samples": float(len(rewards)),
        "eval/dropped": float(sum(p.dropped for p in prompts)),
        **value_stats("eval/reward", rewards),
        **_pass_metrics(prompts, pass_reward, k_values(n), "eval"),
    }
    if lengths:
        out["eval/response_length/mean"] = statistics.fmean(lengths)
        out["eval/truncated"] = statistics.fmean(float(t) for p in prompts for t in p.truncated)
    best = [max(p.rewards) for p in prompts if p.rewards]
    if n > 1 and best:
        out["eval/best_reward/mean"] = statistics.fmean(best)
    voted = [p for p in prompts if p.answers is not None and p.rewards]
    if n > 1 and voted:
        out["eval/maj@n"] = statistics.fmean(float(majority_correct(p, pass_reward)) for p in voted)
    for name in sorted({name for p in prompts for name in p.parts}):
        values = [v for p in prompts for v in p.parts.get(name, ()) if v is not None and math.isfinite(v)]
        if values:
            out[f"eval/parts/{name}/mean"] = statistics.fmean(values)
    if group_by is not None:
        for group in sorted({p.group for p in prompts if p.group is not None}):
            members = [p for p in prompts if p.group == group]
            prefix = f"eval/{group_by}={_UNSAFE.sub('_', group)}"
            scored = [r for p in members for r in p.rewards if math.isfinite(r)]
            out[f"{prefix}/prompts"] = float(len(members))
            if scored:
                out[f"{prefix}/reward/mean"] = statistics.fmean(scored)
            out.update(_pass_metrics(members, pass_reward, sorted({1, n}), prefix))
    return out
