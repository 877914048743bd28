"""Throughput of the algorithm math: advantage estimation + policy-loss forward and backward, in
response tokens per second, for each recipe's loss and the off-policy options, over about 1M
response tokens; and, in the same run, the same for the reference formulation each was checked
against (``core_rl.testing.reference``: a loop per group and per sample on unpadded tokens), with
the largest difference between the two in loss and gradient.

    python benchmarks/algorithms.py [--tokens 1048576] [--response-len 256] [--group-size 8]
                                    [--repeats 3] [--threads 1] [--skip-reference]

The components are built through the plugin registry exactly as a run builds them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch
from core_rl.config.loader import structure
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ADVANTAGE, POLICY_LOSS, REJECTION_SAMPLER
from core_rl.protocol import TensorBatch
from core_rl.testing import reference


@attrs.define
class Case:
    """One benchmark row: an advantage estimator and a loss (YAML-like options) and their reference."""

    name: str
    advantage: dict[str, Any]
    loss: dict[str, Any]
    rejection: dict[str, Any] | None = None

    @property
    def spec(self) -> reference.LossSpec:
        return reference.spec_from_options(self.loss, self.rejection)


def cases(response_len: int) -> list[Case]:
    """Each recipe's loss, the off-policy corrections and the options against entropy collapse."""
    return [
        Case("grpo", {"name": "grpo"}, {}),
        Case(
            "dr_grpo",
            {"name": "grpo", "norm_std": False},
            {"aggregation": "seq-mean-token-sum-norm", "norm_length": response_len},
        ),
        Case("rloo", {"name": "rloo"}, {}),
        Case("reinforce_pp", {"name": "reinforce_pp", "group_baseline": True}, {}),
        Case(
            "gspo",
            {"name": "grpo"},
            {
                "importance_sampling_level": "sequence",
                "eps_clip": 3e-4,
                "eps_clip_higher": 4e-4,
                "aggregation": "seq-mean-token-mean",
            },
        ),
        Case("dapo", {"name": "grpo"}, {"eps_clip_higher": 0.28, "c_clip": 3.0}),
        Case(
            "grpo+kl+entropy",
            {"name": "grpo"},
            {"kl_coef": 0.04, "kl_estimator": "k3", "entropy_coef": 0.01, "aggregation": "seq-mean-token-mean"},
        ),
        Case("grpo+kl-in-reward", {"name": "grpo", "kl_ctl": 0.05, "kl_estimator": "k3"}, {}),
        Case("reinforce_pp+kl-in-reward", {"name": "reinforce_pp", "kl_ctl": 0.05, "group_baseline": True}, {}),
        Case("sapo", {"name": "grpo"}, {"use_sapo_loss": True}),
        Case("cispo", {"name": "grpo"}, {"use_cispo_loss": True, "cispo_eps_high": 0.28}),
        Case("gmpo", {"name": "grpo"}, {"use_gmpo_loss": True, "aggregation": "seq-mean-token-mean"}),
        Case(
            "decoupled+ratio-mask",
            {"name": "grpo"},
            {"use_decoupled_loss": True},
            rejection={"name": "ratio", "upper": 1.2, "lower": 0.8},
        ),
        Case(
            "decoupled+tis-seq",
            {"name": "grpo"},
            {"use_decoupled_loss": True},
            rejection={"name": "tis", "level": "sequence", "agg": "sum", "upper": 1.5},
        ),
        Case(
            "loglinear+kl_k3-seq+opsm",
            {"name": "grpo"},
            {"use_decoupled_loss": True, "prox_logp_method": "loglinear", "off_policy_mask_threshold": 0.01},
            rejection={"name": "kl_k3", "level": "sequence", "agg": "max", "upper": 0.05},
        ),
        Case("clip_cov", {"name": "grpo"}, {"loss_mode": "clip_cov", "clip_cov_ratio": 0.002}),
        Case("kl_cov", {"name": "grpo"}, {"loss_mode": "kl_cov", "kl_cov_ratio": 0.002, "ppo_kl_coef": 1.0}),
        Case("adv_clip", {"name": "grpo"}, {"adv_clip_low": -1.0, "adv_clip_high": 1.0}),
        Case("top_entropy_quantile", {"name": "grpo"}, {"top_entropy_quantile": 0.2, "kl_coef": 0.04}),
    ]


def make_batch(tokens: int, response_len: int, group_size: int, seed: int = 0) -> tuple[TensorBatch, torch.Tensor]:
    """Responses of ``response_len/2 .. response_len`` tokens (right-padded, no prompt columns: the
    math never looks at them) adding up to about ``tokens``; returns the batch and the entropy."""
    g = torch.Generator().manual_seed(seed)
    mean_len = 0.75 * response_len
    rows = max(group_size, int(tokens / mean_len) // group_size * group_size)
    lengths = torch.randint(response_len // 2, response_len + 1, (rows,), generator=g)
    mask = (torch.arange(response_len)[None, :] < lengths[:, None]).float()
    old = -torch.rand(rows, response_len, generator=g) * 3 * mask
    batch = TensorBatch(
        {
            "response_mask": mask,
            "loss_mask": mask.clone(),
            "old_logprobs": old,
            "behave_logprobs": (old + torch.randn(rows, response_len, generator=g) * 0.05) * mask,
            "ref_logprobs": (old + torch.randn(rows, response_len, generator=g) * 0.1) * mask,
            "rewards": torch.randint(0, 5, (rows,), generator=g).float() / 4,
            "group_index": torch.arange(rows) // group_size,
            "versions": torch.where(mask != 0, torch.randint(0, 3, (rows, 1), generator=g), -1),
            "train_version": torch.full((rows,), 3, dtype=torch.long),
        }
    )
    batch["current"] = (old + torch.randn(rows, response_len, generator=g) * 0.1) * mask
    return batch, torch.rand(rows, response_len, generator=g) * mask


def build(host: PluginHost, case: Case) -> tuple[Any, Any]:
    adv_options = dict(case.advantage)
    adv_entry = host.get(ADVANTAGE, adv_options.pop("name"))
    advantage = adv_entry.factory(structure(adv_options, adv_entry.config_cls))
    loss_entry = host.get(POLICY_LOSS, "ppo_clip")
    loss = loss_entry.factory(structure(case.loss, loss_entry.config_cls))
    if case.rejection is not None:
        options = dict(case.rejection)
        entry = host.get(REJECTION_SAMPLER, options.pop("name"))
        loss.set_rejection_sampler(entry.factory(structure(options, entry.config_cls)))
    return advantage, loss


def vectorised(case: Case, host: PluginHost, batch: TensorBatch, entropy: torch.Tensor):
    advantage, loss = build(host, case)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        batch["advantages"] = advantage(batch)
        loss.prepare(batch)  # once per step on the global batch, as the trainer does
        weights = loss.loss_weights(batch["loss_mask"])
        lp = batch["current"].clone().requires_grad_(True)
        total = (loss(batch, lp, entropy).per_token_loss * weights).sum()
        total.backward()
        return total.detach(), lp.grad

    return run


def reference_run(case: Case, batch: TensorBatch, entropy: torch.Tensor):
    mask = batch["response_mask"]
    lengths = mask.sum(1).long().tolist()
    rewards, groups = batch["rewards"].tolist(), batch["group_index"].tolist()
    columns = {k: batch[k].unbind(0) for k in ("old_logprobs", "behave_logprobs", "ref_logprobs", "versions")}
    entropies = entropy.unbind(0)

    def advantages() -> list[torch.Tensor]:
        adv = case.advantage
        kl_coef = adv.get("kl_ctl", 0.0)
        kl = None
        if kl_coef:
            kl = reference.token_kl(
                batch["old_logprobs"], batch["ref_logprobs"], lengths, adv.get("kl_estimator", "k1")
            )
        if adv["name"] == "reinforce_pp":
            per_token = reference.reinforce_pp_advantages(
                rewards,
                groups,
                lengths,
                group_baseline=adv.get("group_baseline", False),
                gamma=1.0,
                eps=1e-5,
                token_kl=kl,
                kl_coef=kl_coef,
            )
            return [torch.tensor(a) for a in per_token]
        loo = adv["name"] == "rloo"
        norm_std = adv.get("norm_std", not loo)
        scores = reference.group_advantages(
            rewards, groups, norm_std=norm_std, eps=1e-6, leave_one_out=loo, token_kl=kl, kl_coef=kl_coef
        )
        return [torch.full((n,), s) for s, n in zip(scores, lengths)]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        lp = batch["current"].clone().requires_grad_(True)
        seqs = [
            {
                "logprobs": row[:n],
                "old": columns["old_logprobs"][i][:n],
                "behave": columns["behave_logprobs"][i][:n],
                "ref": columns["ref_logprobs"][i][:n],
                "adv": a,
                "entropy": entropies[i][:n],
                "versions": columns["versions"][i][:n],
                "train_version": batch["train_version"][i],
                "cov_selected": batch["cov_selected"][i][:n] != 0 if "cov_selected" in batch else None,
            }
            for i, (row, n, a) in enumerate(zip(lp.unbind(0), lengths, advantages()))
        ]
        total = reference.policy_loss(seqs, case.spec)
        total.backward()
        return total.detach(), lp.grad

    return run


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls (after one warm-up call) and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1 << 20, help="response tokens per batch (about)")
    parser.add_argument("--response-len", type=int, default=256, help="the longest response")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--skip-reference", action="store_true", help="time only the vectorised math")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    host = PluginHost()
    batch, entropy = make_batch(args.tokens, args.response_len, args.group_size)
    n_tokens = int(batch["response_mask"].sum())
    print(
        f"{n_tokens} response tokens ({batch.batch_size} responses of {args.response_len // 2}-{args.response_len} "
        f"tokens, groups of {args.group_size}); torch {torch.__version__}, {args.threads} thread(s); "
        f"median of {args.repeats}"
    )
    header = (
        f"{'loss':<26}{'vectorised tok/s':>18}{'reference tok/s':>17}{'speed-up':>10}{'|d loss|':>11}{'|d grad|':>11}"
    )
    print(header)
    print("-" * len(header))
    worst = 0.0
    for case in cases(args.response_len):
        seconds, (loss, grad) = timed(vectorised(case, host, batch, entropy), args.repeats)
        row = f"{case.name:<26}{n_tokens / seconds:>18,.0f}"
        if args.skip_reference:
            print(row)
            continue
        ref_seconds, (ref_loss, ref_grad) = timed(reference_run(case, batch, entropy), max(1, args.repeats // 3))
        d_loss = abs(float(loss - ref_loss))
        d_grad = float((grad - ref_grad).abs().max())
        worst = max(worst, d_grad)
        row += f"{n_tokens / ref_seconds:>17,.0f}{ref_seconds / seconds:>9,.0f}x{d_loss:>11.1e}{d_grad:>11.1e}"
        print(row, flush=True)
    if not args.skip_reference:
        print(f"largest gradient difference to the reference: {worst:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
