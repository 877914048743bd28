"""Repetition, frequency and presence penalties on a real rollout engine, for the rollout contract
(:class:`~core_rl.testing.rollout_contracts.RolloutEngineContract` runs them): the engine's tokens
and log-probs against :func:`penalised`, a second formulation of the penalties computed from a
plain transformers forward over the engine's own tokens.

What engines may differ in is said by class attributes (the defaults are vLLM's definitions, which
the hf engine follows): whether the repetition penalty covers the prompt's tokens (SGLang's covers
the response's only), whether the additive penalties come before it (SGLang's order), and whether
the reported log-probs are those of the penalised logits (vLLM, SGLang) or of the model's own
(hf: a penalty is a sampling device, like top-k/top-p)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import attrs
import pytest
import torch

from core_rl.interfaces import RolloutEngine, SamplingParams
from core_rl.testing.helpers import hf_next_token_logits


def penalised(
    logits: torch.Tensor,
    prompt: list[int],
    response: list[int],
    sampling: SamplingParams,
    *,
    prompt_counts: bool = True,
    additive_first: bool = False,
) -> torch.Tensor:
    """The penalised logits of each response token's step: ``logits`` [R, V] (row ``t``: the
    model's next-token logits after ``prompt + response[:t]``), one row at a time with plain
    Python sets and counts: repetition (``z / r`` if ``z > 0`` else ``z * r``) on every token of
    ``prompt`` (when ``prompt_counts``) and ``response[:t]``; frequency (``f * count``) and
    presence (``p`` once) on those of ``response[:t]``; in that order, or the additive two first
    (``additive_first``)."""
    rows = []
    for t, row in enumerate(logits.tolist()):
        seen = set(response[:t]) | (set(prompt) if prompt_counts else set())
        counts = {j: response[:t].count(j) for j in set(response[:t])}

        out = []
        for j, z in enumerate(row):
            c = counts.get(j, 0)
            additive = sampling.frequency_penalty * c + (sampling.presence_penalty if c else 0.0)
            if additive_first:
                out.append(_repeated(z - additive, j in seen, sampling.repetition_penalty))
            else:
                out.append(_repeated(z, j in seen, sampling.repetition_penalty) - additive)
        rows.append(out)
    return torch.tensor(rows, dtype=logits.dtype)


def _repeated(z: float, seen: bool, penalty: float) -> float:
    """The repetition penalty on one logit ``z`` of a token ``seen`` or not."""
    if not seen:
        return z
    return z / penalty if z > 0 else z * penalty


#: the greedy cases: each penalty alone, and all three, where the order shows (a negative
#: presence penalty brings repeated tokens back among the likeliest, where the repetition
#: penalty's sign rule acts differently on ``z - 0.8`` than on ``z``)
GREEDY_CASES = {
    "repetition": {"repetition_penalty": 1.6},
    "frequency": {"frequency_penalty": 0.3},
    "presence": {"presence_penalty": 0.3},
    "all": {"repetition_penalty": 2.0, "frequency_penalty": 0.2, "presence_penalty": -0.8},
}


class PenaltyEngineTests:
    """The penalties' part of the rollout contract (fixtures ``engine``, ``model_path`` and the
    attributes ``prompts`` and ``logprob_atol`` come from the contract class)."""

    prompts: ClassVar[list[list[int]]]
    logprob_atol: ClassVar[float]
    #: the repetition penalty covers the prompt's tokens too (vLLM, hf), not the response's only
    repetition_penalty_covers_prompt: ClassVar[bool] = True
    #: frequency and presence penalties are applied before the repetition penalty (SGLang)
    penalties_additive_first: ClassVar[bool] = False
    #: the reported log-probs are ``log_softmax(penalised logits / T)`` (vLLM, SGLang), not
    #: ``log_softmax(logits / T)``
    penalty_logprobs_penalised: ClassVar[bool] = False
    #: greedy cases (:data:`GREEDY_CASES`) the engine is known to depart from, with why: skipped
    #: with that reason
    penalty_cases_unmatched: ClassVar[dict[str, str]] = {}

    def _reference(
        self, model_path: Path, prompt: list[int], response: list[int], sampling: SamplingParams, flip: bool = False
    ):
        """``(logits, penalised logits)`` [R, V] of each response token's step (float32, a plain
        transformers forward at temperature 1); ``flip``: penalised in the other order."""
        ids = torch.tensor([prompt + response])
        logits = hf_next_token_logits(model_path, ids, torch.ones_like(ids))[0, len(prompt) - 1 : -1]
        additive_first = self.penalties_additive_first != flip
        options = dict(prompt_counts=self.repetition_penalty_covers_prompt, additive_first=additive_first)
        return logits, penalised(logits, prompt, response, sampling, **options)

    @pytest.mark.parametrize("penalty", ["repetition_penalty", "frequency_penalty", "presence_penalty"])
    def test_large_penalties_keep_greedy_from_repeating(self, engine: RolloutEngine, penalty: str) -> None:
        """At the largest value every engine accepts (2), greedy decoding never repeats a token
        of the response so far, nor, with the repetition penalty where the engine applies it to
        the prompt, one of the prompt; without the penalty the same decoding does repeat."""
        base = SamplingParams(n=1, max_new_tokens=10, min_new_tokens=10, greedy=True)
        sampling = attrs.evolve(base, **{penalty: 2.0})
        with_prompt = penalty == "repetition_penalty" and self.repetition_penalty_covers_prompt
        repeats = 0
        for plain, penal, prompt in zip(
            engine.generate(self.prompts, base), engine.generate(self.prompts, sampling), self.prompts
        ):
            for response, count in ((penal[0].response_ids, False), (plain[0].response_ids, True)):
                for t, token in enumerate(response):
                    banned = set(response[:t]) | (set(prompt) if with_prompt else set())
                    if count:
                        repeats += token in banned
                    else:
                        assert token not in banned, (penalty, prompt, response)
        assert repeats > 0, "greedy decoding without the penalty repeats nothing here: nothing tested"

    @pytest.mark.parametrize("case", list(GREEDY_CASES))
    def test_penalised_greedy_follows_the_reference(self, engine: RolloutEngine, model_path: Path, case: str) -> None:
        """Every greedy token is the argmax of the reference's penalised logits (to ``2 *
        logprob_atol``: a near tie may go either way in an engine's arithmetic), at some step not
        that of the unpenalised ones (with all three: nor that of the other order); each log-prob
        is ``log_softmax`` of the penalised logits or of the model's own, as the contract class
        says."""
        if case in self.penalty_cases_unmatched:
            pytest.skip(self.penalty_cases_unmatched[case])
        sampling = SamplingParams(n=1, max_new_tokens=8, greedy=True, **GREEDY_CASES[case])
        tol, changed, order_shown = 2 * self.logprob_atol, 0, case != "all"
        for prompt, (sample,) in zip(self.prompts, engine.generate(self.prompts, sampling)):
            response = sample.response_ids
            logits, pen = self._reference(model_path, prompt, response, sampling)
            chosen = pen.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
            assert (chosen >= pen.amax(-1) - tol).all(), (case, response, (pen.amax(-1) - chosen).tolist())
            plain_best = logits.argmax(-1, keepdim=True)
            changed += int((pen.gather(-1, plain_best).squeeze(-1) < pen.amax(-1) - tol).sum())
            if not order_shown:
                other = self._reference(model_path, prompt, response, sampling, flip=True)[1]
                picked = other.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
                order_shown = bool((picked < other.amax(-1) - tol).any())
            want = torch.log_softmax(pen if self.penalty_logprobs_penalised else logits, -1)
            want = want.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(sample.logprobs), want, atol=self.logprob_atol, rtol=0)
        assert changed > 0, f"{case}: the penalty never changed greedy's choice here: nothing tested"
        assert order_shown, "greedy in the other order would have chosen the same tokens: the order is not tested"

    def test_penalised_sampling_logprobs(self, engine: RolloutEngine, model_path: Path) -> None:
        """Sampling at temperature 0.6 with frequency and presence penalties: the log-probs are
        ``log_softmax(z / T)`` of the model's logits, or, where the contract class says so, of the
        penalised ones (penalties before temperature: ``(z - f c - p) / T``)."""
        temperature = 0.6
        sampling = SamplingParams(
            n=3, max_new_tokens=6, temperature=temperature, frequency_penalty=1.5, presence_penalty=0.5
        )
        for prompt, samples in zip(self.prompts, engine.generate(self.prompts, sampling)):
            for s in samples:
                logits, pen = self._reference(model_path, prompt, s.response_ids, sampling)
                source = pen if self.penalty_logprobs_penalised else logits
                want = torch.log_softmax(source / temperature, -1)
                want = want.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
                torch.testing.assert_close(torch.tensor(s.logprobs), want, atol=self.logprob_atol, rtol=0)
