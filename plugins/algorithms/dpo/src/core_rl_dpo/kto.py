"""The ``kto`` loop: Kahneman-Tversky optimisation on unpaired (prompt, completion, label) rows.

Each step's ``data.batch_size = B`` rows become ``2 * B`` rows: the rows themselves, then the
*mismatched* ones, prompt ``i`` with the completion of row ``(i + 1) mod B`` (:func:`mismatched_order`).
With the log-ratios ``r = log pi(y|x) - log pi_ref(y|x)`` (sequence log-probs summed over the
completion tokens, EOS included):

- the KL baseline ``z = max(0, mean of r over the B mismatched rows)`` (the sum and the count are
  summed over the ranks, so it is the whole step's; no gradient: :func:`core_rl.ops.kto_kl_baseline`);
- the step's loss ``L = (1 / B) * sum_i loss_i`` over the ``B`` rows with
  :func:`core_rl.ops.kto_loss`: ``w_D * (1 - sigmoid(beta * (r_i - z)))`` for a desirable row,
  ``w_U * (1 - sigmoid(beta * (z - r_i)))`` for an undesirable one.

It trains through the engine's per-token ``train_step`` on a surrogate whose gradient is ``L``'s
exactly, whatever the split into micro-batches or ranks (:mod:`core_rl_dpo.sequence`); only the
``B`` rows train, the mismatched ones are read without gradient. Under ``torchrun`` rank ``r``
holds rows ``r, r + W, ...`` and their mismatched rows (the layout of
:class:`core_rl.loops.supervised.pairwise.PairwiseLoop`).
"""

from __future__ import annotations

import attrs
import torch
from core_rl.data import PromptItem
from core_rl.errors import DataError, warn
from core_rl.loops.supervised import fit_to_length, global_sum, sequence_batch
from core_rl.ops import kto_kl_baseline, kto_loss
from core_rl.protocol import TensorBatch

from core_rl_dpo.config import KTOConfig, kto_balance_warning, kto_label
from core_rl_dpo.sequence import SequenceLossLoop


def mismatched_order(n: int) -> list[int]:
    """The row whose completion each of ``n`` prompts is paired with for the KL baseline: row
    ``(i + 1) mod n`` for prompt ``i`` (for ``n >= 2``, never its own)."""
    return [(i + 1) % n for i in range(n)]


def row_label(item: PromptItem, key: str) -> bool:
    """The label of ``item``'s row (:func:`~core_rl_dpo.config.kto_label`); a
    :class:`~core_rl.errors.DataError` naming the column when it holds none."""
    label = kto_label(item.row.get(key))
    if label is None:
        raise DataError(
            [
                f"data row {item.text[:40]!r}: column {key!r} holds {item.row.get(key)!r}, not a label: true or 1 "
                "(desirable), false or 0 (undesirable)"
            ]
        )
    return label


def kto_sums(
    losses: torch.Tensor, desirable: torch.Tensor, logratio: torch.Tensor, policy: torch.Tensor, beta: float
) -> torch.Tensor:
    """``[7]`` sums over this rank's rows, to be summed over the ranks: the losses, the desirable
    and undesirable counts, the rewards ``beta * r`` and the policy's sequence log-probs of each
    class (:func:`kto_metrics` turns them into means)."""
    d = desirable.float()
    u = 1.0 - d
    reward = beta * logratio.detach()
    policy = policy.detach()
    parts = [losses.detach().sum(), d.sum(), u.sum(), (reward * d).sum(), (reward * u).sum()]
    return torch.stack([*parts, (policy * d).sum(), (policy * u).sum()]).float()


def kto_metrics(sums: torch.Tensor, rows: int, kl_baseline: float) -> dict[str, float]:
    """The step's metrics from the global :func:`kto_sums` of its ``rows`` rows: ``kto/loss`` (the
    mean over the rows), ``kto/kl`` (the baseline ``z``), the counts, and each present class's mean
    reward and log-prob (``kto/rewards/margin`` when both are)."""
    loss, n_d, n_u, reward_d, reward_u, logp_d, logp_u = (float(v) for v in sums)
    out = {"kto/loss": loss / rows, "kto/kl": kl_baseline, "kto/count/desirable": n_d, "kto/count/undesirable": n_u}
    if n_d:
        out.update({"kto/rewards/desirable": reward_d / n_d, "kto/logps/desirable": logp_d / n_d})
    if n_u:
        out.update({"kto/rewards/undesirable": reward_u / n_u, "kto/logps/undesirable": logp_u / n_u})
    if n_d and n_u:
        out["kto/rewards/margin"] = out["kto/rewards/desirable"] - out["kto/rewards/undesirable"]
    return out


class KTOLoop(SequenceLossLoop):
    loop_config: KTOConfig

    def _build(self) -> None:
        super()._build()
        cfg = self.loop_config
        labels = [kto_label(item.row.get(cfg.label_key)) for item in self.data.items]
        desirable, undesirable = labels.count(True), labels.count(False)
        message = kto_balance_warning(desirable, undesirable, cfg.desirable_weight, cfg.undesirable_weight)
        if message is not None and self.is_main:
            warn(message)

    def make_batch(self, items: list[PromptItem]) -> TensorBatch:
        cfg = self.loop_config
        own = [self.sequences(item)[0] for item in items]
        limit = self.cfg.data.max_length
        mismatched = [
            fit_to_length(attrs.evolve(s, response=own[j].response), limit)
            for s, j in zip(own, mismatched_order(len(items)))
        ]
        batch = sequence_batch(own + mismatched, self.pad_token_id)
        batch["loss_mask"] = batch["response_mask"]
        batch["loss_weight"] = batch["response_mask"].clone()
        batch["desirable"] = torch.tensor([row_label(item, cfg.label_key) for item in items] * 2)
        return batch

    def train_batch(self, batch: TensorBatch, step: int) -> dict[str, float]:
        cfg = self.loop_config
        rows = batch.batch_size // 2
        shard = self.shard_rows(batch)
        mine = shard.batch_size // 2
        ref = self.reference_model_logprobs(shard, step)
        policy = self.policy_logprobs(shard, step).detach()
        kl = global_sum(torch.stack([(policy[mine:] - ref[mine:]).sum(), torch.tensor(float(mine))]).float())
        z = kto_kl_baseline(kl[0], kl[1])
        own = policy[:mine].clone().requires_grad_(True)
        logratio, desirable = own - ref[:mine], shard["desirable"][:mine]
        weights = {"desirable_weight": cfg.desirable_weight, "undesirable_weight": cfg.undesirable_weight}
        losses = kto_loss(logratio, desirable, z, beta=cfg.beta, **weights)
        metrics = self.train_on_loss(shard.rows(list(range(mine))), losses.sum() / rows, own, step)
        sums = global_sum(kto_sums(losses, desirable, logratio, own, cfg.beta))
        metrics.update(kto_metrics(sums, rows, float(z)))
        metrics["actor/loss"] = metrics["kto/loss"]  # the engine's is the surrogate's value
        return metrics
