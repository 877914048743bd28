"""Reference formulations of the algorithm math, written from the papers' formulas independently of
:mod:`core_rl.ops`: every group and every sample handled on its own, in a plain loop, on the sample's
unpadded response tokens. Slow by design; the parity tests and ``benchmarks/algorithms.py`` check
the vectorised implementation against them (a third-party algorithm can do the same).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import attrs
import torch

LOG_RATIO_BOUND = 20.0


def kl_penalised_scores(
    rewards: Sequence[float], token_kl: Sequence[Sequence[float]] | None, kl_coef: float
) -> list[float]:
    """A KL penalty in a scalar reward: ``r_i - kl_coef * sum_t kl_{i,t}`` over the sample's response
    tokens (``token_kl[i]``, one float per token; ``None``: the rewards as they are)."""
    if token_kl is None:
        return list(map(float, rewards))
    return [float(r) - kl_coef * sum(map(float, k)) for r, k in zip(rewards, token_kl)]


def token_kl(old: torch.Tensor, ref: torch.Tensor, lengths: Sequence[int], estimator: str) -> list[list[float]]:
    """Per-sample lists of the KL estimate of each response token (rows of ``[B, T]`` log-probs,
    the first ``lengths[i]`` positions of row ``i``; capped at 10 like the policy loss's)."""
    return [_kl(o[:n] - r[:n], estimator).tolist() for o, r, n in zip(old, ref, lengths)]


def group_advantages(
    rewards: Sequence[float],
    groups: Sequence[int],
    *,
    norm_std: bool,
    eps: float,
    leave_one_out: bool,
    token_kl: Sequence[Sequence[float]] | None = None,
    kl_coef: float = 0.0,
) -> list[float]:
    """GRPO / RLOO per-sample advantages, group by group, in Python floats (of the
    :func:`kl_penalised_scores` with ``token_kl``)."""
    rewards = kl_penalised_scores(rewards, token_kl, kl_coef)
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        r = [float(rewards[i]) for i in idx]
        n = len(r)
        if n == 1 or max(r) == min(r):
            continue
        mean = sum(r) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (n - 1))
        for i, x in zip(idx, r):
            baseline = (sum(r) - x) / (n - 1) if leave_one_out else mean
            out[i] = (x - baseline) / (std + eps) if norm_std else x - baseline
    return out


def reinforce_pp_advantages(
    rewards: Sequence[float],
    groups: Sequence[int],
    lengths: Sequence[int],
    *,
    group_baseline: bool,
    gamma: float,
    eps: float,
    token_kl: Sequence[Sequence[float]] | None = None,
    kl_coef: float = 0.0,
) -> list[list[float]]:
    """REINFORCE++ token advantages per sample (a list of ``lengths[i]`` floats each). With
    ``token_kl``, every token also earns ``-kl_coef * kl_t``, and the returns are the discounted sums
    ``G_t = r_t + gamma * G_{t+1}`` of the per-token rewards, taken backwards token by token."""
    scores = list(map(float, rewards))
    if group_baseline:
        sums: dict[int, list[float]] = defaultdict(list)
        for g, r in zip(groups, scores):
            sums[g].append(r)
        means = {g: sum(v) / len(v) for g, v in sums.items()}
        scores = [0.0 if max(sums[g]) == min(sums[g]) else r - means[g] for g, r in zip(groups, scores)]
    if token_kl is None:
        returns = [[s * gamma ** (n - 1 - t) for t in range(n)] for s, n in zip(scores, lengths)]
    else:
        returns = []
        for s, n, kl in zip(scores, lengths, token_kl):
            seq, g = [0.0] * n, 0.0
            for t in reversed(range(n)):
                g = (s if t == n - 1 else 0.0) - kl_coef * float(kl[t]) + gamma * g
                seq[t] = g
            returns.append(seq)
    flat = [x for seq in returns for x in seq]
    if max(flat) == min(flat):
        return [[0.0] * n for n in lengths]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    return [[(x - mean) / (std + eps) for x in seq] for seq in returns]


@attrs.define
class LossSpec:
    """The options of the reference policy loss (the meaning of ``ppo_clip``'s)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    c_clip: float | None = None
    level: str = "token"
    aggregation: str = "token-mean"
    norm_length: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    decoupled: bool = False
    loglinear: bool = False
    rejection: dict | None = None  # metric, level, action, agg, upper, lower
    off_policy_mask_threshold: float | None = None
    sapo: tuple[float, float] | None = None  # (tau_pos, tau_neg)
    cispo: tuple[float, float] | None = None  # (eps_low, eps_high)
    gmpo: tuple[float, float] | None = None  # (eps_low, eps_high), log-space bounds
    loss_mode: str = "clip"  # clip | clip_cov | kl_cov (their tokens: seq["cov_selected"])
    ppo_kl_coef: float = 0.1
    top_entropy_quantile: float = 1.0  # the population: every token of the sequences given
    adv_clip: tuple[float | None, float | None] = (None, None)  # (low, high)


#: the default upper bound of each built-in rejection sampler (core_rl.ops.rejection)
_DEFAULT_UPPER = {"ratio": 5.0, "tis": 2.0, "mis": 2.0}


def spec_from_options(loss: dict, rejection: dict | None = None) -> LossSpec:
    """The :class:`LossSpec` of ``ppo_clip`` options (``algorithm.loss`` without ``name``) and of an
    ``algorithm.rejection_sampling`` section of a built-in sampler (with ``name``)."""
    rejection_spec = None
    if rejection is not None:
        name = rejection["name"]
        rejection_spec = {
            "metric": "ratio" if name in ("tis", "mis") else name,
            "level": rejection.get("level", "token"),
            "agg": rejection.get("agg", "mean"),
            "action": {"tis": "clamp", "mis": "mask"}.get(name, rejection.get("action", "mask")),
            "upper": rejection.get("upper", _DEFAULT_UPPER.get(name, 2.0)),
            "lower": rejection.get("lower"),
        }
    eps = loss.get("eps_clip", 0.2)
    sapo = (loss.get("sapo_tau_pos", 1.0), loss.get("sapo_tau_neg", 1.05)) if loss.get("use_sapo_loss") else None
    cispo = (loss.get("cispo_eps_low", 1.0), loss.get("cispo_eps_high", 0.28)) if loss.get("use_cispo_loss") else None
    gmpo = (loss.get("gmpo_eps_low", 0.4), loss.get("gmpo_eps_high", 0.4)) if loss.get("use_gmpo_loss") else None
    return LossSpec(
        eps_low=eps,
        eps_high=loss.get("eps_clip_higher", eps),
        c_clip=loss.get("c_clip"),
        level=loss.get("importance_sampling_level", "token"),
        aggregation=loss.get("aggregation", "token-mean"),
        norm_length=loss.get("norm_length"),
        kl_coef=loss.get("kl_coef", 0.0),
        kl_estimator=loss.get("kl_estimator", "k3"),
        entropy_coef=loss.get("entropy_coef", 0.0),
        decoupled=loss.get("use_decoupled_loss", False),
        loglinear=loss.get("prox_logp_method") == "loglinear",
        rejection=rejection_spec,
        off_policy_mask_threshold=loss.get("off_policy_mask_threshold"),
        sapo=sapo,
        cispo=cispo,
        gmpo=gmpo,
        loss_mode=loss.get("loss_mode", "clip"),
        ppo_kl_coef=loss.get("ppo_kl_coef", 0.1),
        top_entropy_quantile=loss.get("top_entropy_quantile", 1.0),
        adv_clip=(loss.get("adv_clip_low"), loss.get("adv_clip_high")),
    )


def _kl(d: torch.Tensor, estimator: str, cap: float = 10.0) -> torch.Tensor:
    """k1 / k2 / k3 of ``d = log pi - log pi_ref``, held within +-cap (no gradient beyond); ``exp``
    only sees ``d`` down to -20, where k3 (~5e8) is far past the cap anyway."""
    if estimator == "k1":
        value = d
    elif estimator == "k2":
        value = d * d / 2
    else:
        value = torch.exp(-d.clamp(min=-20.0)) - 1 + d
    return value.clamp(-cap, cap)


def _judged(metric: str, log_r: torch.Tensor) -> torch.Tensor:
    return {
        "ratio": log_r,
        "kl_k1": log_r,
        "kl_k2": log_r * log_r / 2,
        "kl_k3": torch.exp(log_r) - log_r - 1,
    }[metric]


def _rejection(spec: dict, log_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, keep) of one sequence's tokens under a rejection-sampling spec."""
    in_log = spec["metric"] == "ratio"
    values = _judged(spec["metric"], log_r)
    lower = -math.inf if spec.get("lower") is None else spec["lower"]
    if spec["level"] == "token":
        judged = torch.exp(values) if in_log else values
        weight = torch.exp(log_r)
    else:
        agg = {"sum": torch.sum, "mean": torch.mean, "max": torch.max}[spec["agg"]](values)
        judged = (torch.exp(agg) if in_log else agg).expand_as(values)
        weight = judged if in_log else torch.exp(log_r)
    if spec["action"] == "clamp":
        return weight.clamp(min=max(lower, 0.0), max=spec["upper"]), torch.ones_like(values, dtype=torch.bool)
    return weight, (judged >= lower) & (judged <= spec["upper"])


def sequence_losses(
    seqs: Sequence[dict[str, torch.Tensor]], spec: LossSpec
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sequence token losses (and keep masks) of the policy loss. Each ``seq`` holds 1-D tensors over
    its response tokens: ``logprobs`` (may require grad), ``old``, ``behave``, ``ref``, ``adv``,
    ``entropy``, and for ``loglinear`` ``versions`` and a 0-D ``train_version``."""
    losses, keeps = [], []
    tau = entropy_threshold([float(h) for seq in seqs for h in seq["entropy"]], spec.top_entropy_quantile)
    for seq in seqs:
        lp, old, behave, adv = seq["logprobs"], seq["old"], seq["behave"], seq["adv"]
        if spec.adv_clip != (None, None):  # each advantage held within [low, high], one by one
            low = -math.inf if spec.adv_clip[0] is None else spec.adv_clip[0]
            high = math.inf if spec.adv_clip[1] is None else spec.adv_clip[1]
            adv = torch.tensor([min(max(float(a), low), high) for a in adv], dtype=adv.dtype)
        anchor = old
        if spec.decoupled and spec.loglinear:
            v_theta, v_b = float(seq["train_version"]), seq["versions"].float()
            alpha = torch.where(v_theta > v_b, (v_theta - 1 - v_b) / (v_theta - v_b).clamp(min=1), 0.0).clamp(0, 1)
            anchor = behave + alpha * (lp.detach() - behave)
        if spec.level == "token":
            log_ratio = lp - anchor
        else:
            log_ratio = (lp.detach() - anchor).mean() + lp - lp.detach()
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        if spec.sapo is not None:
            tau = torch.where(adv > 0, spec.sapo[0], spec.sapo[1])
            loss = -adv * 4 / tau * torch.sigmoid(tau * (ratio - 1))
        elif spec.cispo is not None:  # the clipped weight times exp(x - sg(x)): value 1, gradient grad x
            weight = ratio.detach().clamp(1 - spec.cispo[0], 1 + spec.cispo[1])
            loss = -adv * weight * torch.exp(log_ratio - log_ratio.detach())
        elif spec.gmpo is not None:  # in ratio space: the |y|-th root of the product of pessimistic ratios
            a = adv.mean()
            bounded = ratio.clamp(math.exp(-spec.gmpo[0]), math.exp(spec.gmpo[1]))
            kept = torch.min(ratio, bounded) if a > 0 else torch.max(ratio, bounded)
            loss = (-a * torch.prod(kept) ** (1.0 / len(kept))).expand_as(lp)
        elif spec.loss_mode == "kl_cov":  # unclipped, |log ratio| on the selected tokens
            loss = -adv * ratio + torch.where(seq["cov_selected"], spec.ppo_kl_coef * log_ratio.abs(), 0.0)
        else:
            clipped_loss = -adv * ratio.clamp(1 - spec.eps_low, 1 + spec.eps_high)
            loss = torch.max(-adv * ratio, clipped_loss)
            if spec.c_clip is not None:
                loss = torch.where(adv < 0, torch.min(loss, -spec.c_clip * adv), loss)
            if spec.loss_mode == "clip_cov":  # selected tokens leave, unless the clip already acts
                loss = torch.where(seq["cov_selected"] & ~(clipped_loss > -adv * ratio), 0.0, loss)
        keep = torch.ones_like(lp, dtype=torch.bool)
        if spec.decoupled:
            log_r = (anchor - behave).detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
            weight = torch.exp(log_r)
            if spec.rejection is not None:
                weight, keep = _rejection(spec.rejection, log_r)
            loss = loss * weight
        if spec.top_entropy_quantile < 1.0:  # the policy-gradient term of low-entropy tokens leaves
            loss = torch.where(seq["entropy"] >= tau, loss, 0.0)
        if spec.off_policy_mask_threshold is not None:
            drift = (behave - lp.detach()).mean()
            if adv.mean() < 0 and drift > spec.off_policy_mask_threshold:
                keep = torch.zeros_like(keep)
        if spec.kl_coef > 0:
            loss = loss + spec.kl_coef * _kl(lp - seq["ref"], spec.kl_estimator)
        if spec.entropy_coef > 0:
            loss = loss - spec.entropy_coef * seq["entropy"]
        losses.append(torch.where(keep, loss, torch.zeros_like(loss)))
        keeps.append(keep)
    return losses, keeps


def policy_loss(seqs: Sequence[dict[str, torch.Tensor]], spec: LossSpec) -> torch.Tensor:
    """The aggregated loss of a batch of sequences (see :func:`sequence_losses`)."""
    losses, _ = sequence_losses(seqs, spec)
    n = len(seqs)
    total_tokens = sum(len(x) for x in losses)
    out = torch.zeros(())
    for x in losses:
        if spec.aggregation == "token-mean":
            out = out + x.sum() / max(total_tokens, 1)
        elif spec.aggregation == "seq-mean-token-mean":
            out = out + x.sum() / max(len(x), 1) / n
        elif spec.aggregation == "seq-mean-token-sum":
            out = out + x.sum() / n
        else:
            assert spec.norm_length is not None
            out = out + x.sum() / (n * spec.norm_length)
    return out


def entropy_threshold(entropies: Sequence[float], quantile: float) -> float:
    """The ``1 - quantile`` quantile of the entropies, linearly interpolated between sorted neighbours."""
    values = sorted(entropies)
    if not values:
        return math.inf
    pos = (1.0 - quantile) * (len(values) - 1)
    j = min(math.floor(pos), len(values) - 1)
    return values[j] + (pos - j) * (values[min(j + 1, len(values) - 1)] - values[j])


def token_covariances(logprobs: Sequence[Sequence[float]], advantages: Sequence[Sequence[float]]) -> list[list[float]]:
    """Per-sample lists of ``(A_t - mean A) * (lp_t - mean lp)``, the means over every token of every sample."""
    flat_lp = [float(x) for row in logprobs for x in row]
    flat_a = [float(x) for row in advantages for x in row]
    mean_lp = sum(flat_lp) / max(len(flat_lp), 1)
    mean_a = sum(flat_a) / max(len(flat_a), 1)
    return [[(float(a) - mean_a) * (float(lp) - mean_lp) for lp, a in zip(r, q)] for r, q in zip(logprobs, advantages)]


def cov_count(ratio: float, n: int) -> int:
    """Tokens a covariance selection takes: ``max(1, floor(ratio * n))`` capped at ``n``; none for ratio 0."""
    return 0 if ratio <= 0 or n == 0 else min(n, max(1, math.floor(ratio * n)))


def kl_cov_selected(covs: Sequence[Sequence[float]], ratio: float) -> list[list[bool]]:
    """KL-Cov: the ``cov_count`` tokens of largest covariance (earlier position first on ties)."""
    flat = [(-c, i, t) for i, row in enumerate(covs) for t, c in enumerate(row)]
    chosen = {(i, t) for _, i, t in sorted(flat)[: cov_count(ratio, len(flat))]}
    return [[(i, t) in chosen for t in range(len(row))] for i, row in enumerate(covs)]


def m2po_keep(m2: Sequence[float], threshold: float) -> list[bool]:
    """M2PO: drop the largest second moments one by one until the mean of the rest is below the
    threshold (keeping at least one)."""
    order = sorted(range(len(m2)), key=lambda i: (-m2[i], i))
    keep = [True] * len(m2)
    remaining = list(order)
    while len(remaining) > 1 and sum(m2[i] for i in remaining) / len(remaining) >= threshold:
        keep[remaining.pop(0)] = False
    return keep


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`core_rl_train_kit.logprobs.token_logprobs` as autograd composes it from whole-tensor
    operations (``log_softmax`` of the float32 logits, ``gather``, ``-sum(p log p)``; gradients by
    autograd): ``[b, t]`` float32, position 0 and padding 0."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    real = attention_mask[:, 1:] != 0
    zero = logp.new_zeros(logp.shape[0], 1)

    def place(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([zero, torch.where(real, values, torch.zeros_like(values))], dim=1)

    picked = place(logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1))
    return picked, (place(-(logp.exp() * logp).sum(-1)) if with_entropy else None)
