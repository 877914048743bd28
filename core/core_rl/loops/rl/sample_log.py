"""What the rewards see of a step's samples, and the few samples loggers show
(``sample_log.every_n_steps``, ``sample_log.num_samples``), with each prompt both as the data holds
it and as the model was given it (:func:`rendered_prompt`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core_rl.config.schema import SampleLogConfig
from core_rl.data.prompts import PromptItem
from core_rl.interfaces import SampleRecord
from core_rl.loops.rl.reward_runner import RewardRunner, ScoreResult
from core_rl.protocol import RewardInput, Sample


def reward_inputs(samples: Sequence[Sample], owners: Sequence[PromptItem], texts: Sequence[str]) -> list[RewardInput]:
    """One :class:`RewardInput` per sample: its prompt (``owners``, the prompt each answers), its
    decoded response (``texts``) and what the rollout workflow attached to it."""
    return [
        RewardInput(
            prompt_text=owner.text,
            response_text=text,
            prompt_ids=s.prompt_ids,
            response_ids=s.response_ids,
            row=owner.row,
            finish_reason=s.finish_reason,
            workflow_reward=s.reward,
            info=s.info,
        )
        for s, text, owner in zip(samples, texts, owners)
    ]


def score_samples(
    runner: RewardRunner, tokenizer: Any, samples: Sequence[Sample], owners: Sequence[PromptItem], step: int
) -> tuple[list[RewardInput], ScoreResult]:
    """Decode each sample's response and score them all through ``runner`` (``owners``: the prompt
    each answers); the reward inputs, with the decoded text, and the result."""
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    inputs = reward_inputs(samples, owners, texts)
    return inputs, runner.score(inputs, step=step)


def rendered_prompt(tokenizer: Any, prompt_ids: Sequence[int]) -> str:
    """The prompt as the model was given it: its token ids decoded with every special token, so
    the chat template's rendering under ``data.apply_chat_template`` (system prompt, turn markers,
    generation prompt), or the text with the tokens the tokenizer adds (a BOS token)."""
    return str(tokenizer.decode(list(prompt_ids), skip_special_tokens=False))


def sample_records(
    inputs: Sequence[RewardInput],
    result: ScoreResult,
    config: SampleLogConfig,
    step: int,
    model_scores: dict[int, float] | None = None,
    model_coef: float = 0.0,
    *,
    tokenizer: Any,
) -> list[SampleRecord]:
    """Every ``config.every_n_steps`` steps, ``config.num_samples`` records spread over ``inputs``
    (a step's first generation batch, scored as ``result``); none at other steps. Each record holds
    its prompt as rendered for the model (:func:`rendered_prompt`, by ``tokenizer``).
    ``model_scores``: item index -> the ``reward_model:`` role's score of the kept items; a sample's
    reward is then ``rule + model_coef * score``, with the score as the part ``reward_model``."""
    every, k = config.every_n_steps, min(config.num_samples, len(inputs))
    if not every or step % every or not k:
        return []
    scored = model_scores or {}
    records = []
    for i in sorted({j * len(inputs) // k for j in range(k)}):
        score: Any = result.scores[i]
        reward = float("nan") if score is None else float(score)
        parts = {name: float(values[i]) for name, values in result.parts.items() if values[i] is not None}
        if i in scored:
            parts["reward_model"] = scored[i]
            reward += model_coef * scored[i]
        records.append(
            SampleRecord(
                prompt=inputs[i].prompt_text,
                rendered_prompt=rendered_prompt(tokenizer, inputs[i].prompt_ids),
                response=inputs[i].response_text,
                reward=reward,
                finish_reason=inputs[i].finish_reason,
                parts=parts,
                info=dict(inputs[i].info),
            )
        )
    return records
