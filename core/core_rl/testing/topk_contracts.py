"""The top-k part of the train-engine contract (``teacher.loss: topk_forward_kl``), for an engine
whose config class sets ``topk_logprobs = True`` (skipped otherwise): its teacher side
(:meth:`~core_rl.interfaces.TrainEngine.compute_topk_logprobs`) and its policy side (a loss with
``logprobs_at_key`` reads :data:`~core_rl.interfaces.LOGPROBS_AT` in every micro-batch, with
gradient), both against a plain transformers forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from core_rl.interfaces import LOGPROBS_AT, LossOutput
from core_rl.protocol import TensorBatch
from core_rl.testing.helpers import hf_next_token_logprobs, make_rl_batch

TEMPERATURE = 0.7
K = 3


class TopkLogprobsContract:
    """See the module docstring. Needs the contract's ``make(model_path, *, trainable=...)``,
    ``entry()``, ``name`` and ``logprob_atol``."""

    make: Any
    entry: Any
    name: str
    logprob_atol: float

    def test_topk_logprobs_and_logprobs_at_given_ids_match_transformers(self, model_path: Path) -> None:
        if not getattr(self.entry().config_cls, "topk_logprobs", False):
            pytest.skip(f"{self.name} does not declare topk_logprobs (config_cls.topk_logprobs)")
        batch = make_rl_batch(max_response_len=5)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        engine = self.make(model_path, max_tokens_per_mb=24)  # several micro-batches
        top_ids, top_lp = engine.compute_topk_logprobs(batch, K, temperature=TEMPERATURE)
        dist = hf_next_token_logprobs(model_path, ids, mask, TEMPERATURE)  # [B, T, V]: position t predicts t + 1
        want = torch.zeros(*ids.shape, K)
        want[:, 1:] = dist[:, :-1].gather(-1, top_ids[:, 1:])
        real = mask.bool()
        real[:, 0] = False
        assert top_ids.shape == top_lp.shape == (*ids.shape, K) and top_ids.dtype == torch.long
        assert (top_lp[~real] == 0).all() and (top_ids[~real] == 0).all()
        torch.testing.assert_close(top_lp, want * real[..., None], atol=self.logprob_atol, rtol=0)
        best = dist[:, :-1].topk(K, dim=-1).values
        torch.testing.assert_close(top_lp[:, 1:][real[:, 1:]], best[real[:, 1:]], atol=self.logprob_atol, rtol=0)
        # among the first `shared` tokens only (a student's smaller vocabulary): the softmax over those
        shared = dist.shape[-1] - 2
        cut_ids, cut_lp = engine.compute_topk_logprobs(batch, K, temperature=TEMPERATURE, vocab_size=shared)
        over_shared = torch.log_softmax(dist[:, :-1, :shared], dim=-1).topk(K, dim=-1)
        assert int(cut_ids.max()) < shared
        assert (cut_ids[:, 1:][real[:, 1:]] == over_shared.indices[real[:, 1:]]).all()
        torch.testing.assert_close(
            cut_lp[:, 1:][real[:, 1:]], over_shared.values[real[:, 1:]], atol=self.logprob_atol, rtol=0
        )

        batch["topk_ids"], batch["want_at"] = top_ids, want * real[..., None]
        sums: list[float] = []
        stepped: list[bool] = []

        def raise_them(mb: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
            at = mb[LOGPROBS_AT]
            if not stepped:  # the first step: before any update
                torch.testing.assert_close(at.detach(), mb["want_at"], atol=self.logprob_atol, rtol=0)
            per_token = at.sum(-1) * mb["response_mask"]
            sums.append(float(per_token.detach().sum()))
            return LossOutput(per_token_loss=-per_token)

        raise_them.logprobs_at_key = "topk_ids"  # type: ignore[attr-defined]
        micro_batches = int(engine.train_step(batch, raise_them, temperature=TEMPERATURE)["num_micro_batches"])
        assert micro_batches > 1 and len(sums) == micro_batches
        stepped.append(True)
        engine.train_step(batch, raise_them, temperature=TEMPERATURE)
        # the step raised the log-probs of those ids (the gradient reached the model through them)
        assert sum(sums[micro_batches:]) > sum(sums[:micro_batches]), sums
        engine.close()
