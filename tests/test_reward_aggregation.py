"""``algorithm.reward_shaping.aggregation: normalize_then_sum`` (GDPO): each part of a ``combine``
reward normalised within its group, then the weighted sum; hand-computed advantages, parity with
TRL 1.16's ``multi_objective_aggregation: normalize_then_sum`` (its formula written out here with
NaN-aware statistics, not TRL imported), the default left as it was, and the configuration refused
where it cannot apply. Batch assembly and the grpo estimator are the real ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
import torch
from core_rl import ops
from core_rl.config.reward_aggregation import reward_part_weights, weighted_parts
from core_rl.config.schema import AlgorithmConfig, NormConfig, RewardShapingConfig
from core_rl.errors import ConfigError, CoreRLError
from core_rl.hookspecs import hookimpl
from core_rl.interfaces import Reward, RewardScores
from core_rl.loops.rl.batching import BatchAssembler, Generation
from core_rl.protocol import RewardInput, Sample
from hypothesis import example, given, settings
from hypothesis import strategies as st

grpo = pytest.importorskip("core_rl_grpo")

EPS = 1e-4  # part_eps's default, TRL's


def generation(parts: dict[str, list[list[float | None]]], weights: dict[str, float]) -> Generation:
    """A generation batch whose groups are the inner lists of each part; the rewards are the
    weighted sums of the parts (what ``combine`` scores, ``None`` adding nothing), and a nested
    part ``a/sub`` that no aggregation reads."""
    first = next(iter(parts.values()))
    samples, groups = [], []
    for g, group in enumerate(first):
        for _ in group:
            samples.append(Sample([1, 2], [5, 6, 7], [-0.5] * 3, 0, "stop"))
            groups.append(g)
    flat = {name: [v for group in values for v in group] for name, values in parts.items()}
    rewards = [sum(weights[n] * (flat[n][i] or 0.0) for n in flat) for i in range(len(samples))]
    flat["a/sub"] = [1.0] * len(samples)
    return Generation(samples=samples, group_index=groups, rewards=rewards, reward_parts=flat)


def assembled(
    gen: Generation, algorithm: AlgorithmConfig, weights: dict[str, float] | None, estimator=None
) -> tuple[torch.Tensor, dict]:
    """The per-sample advantages (the first response token's) of ``gen`` and the batch's keys."""
    batcher = BatchAssembler(
        algorithm,
        filters=[],
        advantage=estimator if estimator is not None else grpo.GroupRelativeAdvantage(),
        prompts_per_step=1,
        max_new_tokens=4,
        pad_token_id=0,
        part_weights=weights,
    )
    batch, _ = batcher.assemble(lambda: gen)
    assert batch is not None
    first = batch["response_mask"].argmax(dim=1)
    return batch["advantages"][torch.arange(batch.batch_size), first], batch


GDPO = AlgorithmConfig(reward_shaping=RewardShapingConfig(aggregation="normalize_then_sum"))
EQUAL = {"a": 1.0, "b": 1.0}


def test_equal_sums_of_different_parts_get_different_advantages_only_when_parts_are_normalised() -> None:
    # one group of 4, two binary parts: (1,0) (0,1) (1,0) (0,0); sums 1 1 1 0
    gen = generation({"a": [[1.0, 0.0, 1.0, 0.0]], "b": [[0.0, 1.0, 0.0, 0.0]]}, EQUAL)
    # sum, then grpo: mean 0.75, unbiased std sqrt(0.75 / 3) = 0.5, eps 1e-6
    summed, _ = assembled(gen, AlgorithmConfig(), None)
    assert summed.tolist() == pytest.approx([0.25 / (0.5 + 1e-6)] * 3 + [-0.75 / (0.5 + 1e-6)], abs=1e-6)
    assert summed[0] == summed[1]  # (1,0) and (0,1) cannot be told apart
    # normalise each part first: a has mean 0.5, std sqrt(1/3); b has mean 0.25, std 0.5
    za = 0.5 / (math.sqrt(1 / 3) + EPS)
    zb_hit, zb_miss = 0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS)
    expected = [za + zb_miss, -za + zb_hit, za + zb_miss, -za + zb_miss]  # about .366 .634 .366 -1.366
    # the sums are centred in their group already, so grpo without the std (dr_grpo) passes them on
    plain = grpo.GroupRelativeAdvantage(norm_std=False)
    gdpo, batch = assembled(gen, GDPO, EQUAL, plain)
    assert gdpo.tolist() == pytest.approx(expected, abs=1e-5)
    assert gdpo[1] - gdpo[0] == pytest.approx(zb_hit - zb_miss - 2 * za, abs=1e-5) and gdpo[1] > gdpo[0]  # b is rarer
    assert not any(key.startswith("reward_part/") for key in batch.keys())  # taken out before the update
    # grpo's default also divides by the group std of the GDPO sums
    std = torch.tensor(expected).std().item()
    scaled, _ = assembled(gen, GDPO, EQUAL)
    assert scaled.tolist() == pytest.approx([v / (std + 1e-6) for v in expected], abs=1e-5)


def test_an_absent_part_is_left_out_of_its_group_and_adds_nothing() -> None:
    # part b does not apply to the first sample: b's group is (1, 0, 0), mean 1/3, std sqrt(1/3)
    gen = generation({"a": [[1.0, 0.0, 1.0, 0.0]], "b": [[None, 1.0, 0.0, 0.0]]}, {"a": 1.0, "b": 2.0})
    got, _ = assembled(gen, GDPO, {"a": 1.0, "b": 2.0}, grpo.GroupRelativeAdvantage(norm_std=False))
    za = 0.5 / (math.sqrt(1 / 3) + EPS)
    sb = math.sqrt(1 / 3) + EPS
    expected = [za, -za + 2 * (2 / 3) / sb, za + 2 * (-1 / 3) / sb, -za + 2 * (-1 / 3) / sb]
    assert got.tolist() == pytest.approx(expected, abs=1e-5)


def test_samples_scored_with_other_parts_are_refused() -> None:
    gen = generation({"a": [[1.0, 0.0]], "c": [[0.0, 1.0]]}, {"a": 1.0, "c": 1.0})
    with pytest.raises(CoreRLError, match=r"no part b \(they have a, c, a/sub; a rollout.replay_from dump"):
        assembled(gen, GDPO, EQUAL)
    gen.reward_parts = {}  # the reward failed on every sample: no part is present, every reward is 0
    got, _ = assembled(gen, GDPO, EQUAL)
    assert got.tolist() == [0.0, 0.0]


def test_dynamic_sampling_keeps_a_group_whose_parts_vary_where_their_sums_tie() -> None:
    """``drop_uniform_groups`` judges the reward the advantages read: group 0's weighted sums tie
    (0.9 = 0.9 * 1 + 0.1 * 0 = 0.9 * 0 + 0.1 * 9) while its parts differ, so GDPO gives it a
    signal and the filter keeps it; group 1's parts are equal, and it is dropped."""
    from core_rl_grpo.config import DropUniformGroupsConfig
    from core_rl_grpo.filters import DropUniformGroups

    weights = {"a": 0.9, "b": 0.1}
    gen = generation({"a": [[1.0, 0.0], [1.0, 1.0]], "b": [[0.0, 9.0], [0.0, 0.0]]}, weights)
    assert gen.rewards[0] == pytest.approx(gen.rewards[1])
    algorithm = AlgorithmConfig(reward_shaping=RewardShapingConfig(aggregation="normalize_then_sum"))
    assembler = BatchAssembler(
        algorithm,
        filters=[DropUniformGroups(DropUniformGroupsConfig())],
        advantage=grpo.GroupRelativeAdvantage(norm_std=False),
        prompts_per_step=2,
        max_new_tokens=4,
        pad_token_id=0,
        part_weights=weights,
    )
    batch, _ = assembler.assemble(lambda: gen)
    assert batch["group_index"].tolist() == [0, 0]
    # each part's z is +-1/sqrt(2) (two members, unbiased std sqrt(2) of a 0/1 pair, or 9/sqrt(2) of a 0/9 pair)
    z = 1 / math.sqrt(2)
    assert batch["rewards"].tolist() == pytest.approx([0.9 * z - 0.1 * z, -0.9 * z + 0.1 * z], abs=1e-4)


def test_the_default_is_the_weighted_sum_as_before() -> None:
    gen = generation({"a": [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]], "b": [[0.0, 1.0, 0.0, 0.0]] * 2}, EQUAL)
    _, batch = assembled(gen, AlgorithmConfig(), None)
    sums = torch.tensor(gen.rewards)
    reference = grpo.grpo_advantages(sums, batch["group_index"], batch["response_mask"])
    assert torch.equal(batch["advantages"], reference)
    assert torch.equal(batch["rewards"], sums)
    assert not any(key.startswith("reward_part/") for key in batch.keys())
    assert RewardShapingConfig().aggregation == "sum"


def trl_normalize_then_sum(parts: torch.Tensor, weights: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL 1.16's ``normalize_then_sum``, written out (float64): per part within each group of
    ``n``, ``(x - nanmean) / (nanstd + 1e-4)`` with Bessel's correction (NaN below two values), the
    NaN-skipping weighted sum ``r`` (returned first), then the advantages (returned second)
    ``(r - nanmean(r)) / (nanstd(r) + 1e-4)`` over the batch, a row with every part NaN left out
    and given 0."""

    def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        kw = {"dim": dim, "keepdim": True} if dim is not None else {}
        mean = torch.nanmean(x, **kw)
        count = (~x.isnan()).sum(**kw)
        var = torch.nanmean((x - mean) ** 2, **kw) * count / (count - 1)
        return torch.where(count > 1, var, torch.full_like(var, math.nan)).sqrt()

    k = parts.shape[1]
    grouped = parts.double().view(-1, n, k)
    z = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1) + 1e-4)
    rewards = (z.view(-1, k) * weights.double()).nansum(dim=1)
    rewards[parts.isnan().all(dim=1)] = math.nan
    advantages = (rewards - torch.nanmean(rewards)) / (nanstd(rewards) + 1e-4)
    return rewards, torch.nan_to_num(advantages, nan=0.0)


# graded part values (as rewards are) or absent; groups of n samples, K parts
part_value = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, -1.0]), st.none())


@st.composite
def parted_groups(draw):
    n = draw(st.integers(2, 5))
    groups = draw(st.integers(1, 4))
    k = draw(st.integers(1, 3))
    # a row with no part at all TRL leaves out of its batch statistics, where it counts as 0 here
    row = st.lists(part_value, min_size=k, max_size=k).filter(lambda r: any(v is not None for v in r))
    rows = draw(st.lists(row, min_size=n * groups, max_size=n * groups))
    weights = draw(st.lists(st.sampled_from([1.0, 0.5, 0.2, 2.0, -0.3]), min_size=k, max_size=k))
    return n, rows, weights


@settings(max_examples=60, deadline=None)
@given(parted_groups())
# near-cancelling parts: sums of about 3e-4 from parts of about 0.7, with a batch spread close to eps
@example(case=(2, [[0.0, None], [0.0, None], [0.0, 0.0], [0.25, -1.0]], [1.0, 1.0]))
def test_parity_with_trls_normalize_then_sum(case) -> None:
    n, rows, weights = case
    names = [f"p{j}" for j in range(len(weights))]
    parts = {
        name: [[rows[g * n + i][j] for i in range(n)] for g in range(len(rows) // n)] for j, name in enumerate(names)
    }
    named = dict(zip(names, weights))
    gen = generation(parts, named)
    gen.samples[0].response_ids = [5]  # responses of different lengths: every sample counts once
    gen.samples[0].logprobs = [-0.5]
    table = torch.tensor([[math.nan if v is None else v for v in row] for row in rows])
    # TRL's batch normalisation of the sum is reward_shaping.norm at batch level with its eps
    norm = NormConfig(mean_level="batch", std_level="batch", eps=1e-4)
    algorithm = AlgorithmConfig(reward_shaping=RewardShapingConfig(aggregation="normalize_then_sum", norm=norm))
    trl_sums, trl_advantages = trl_normalize_then_sum(table, torch.tensor(weights), n)
    sums = ops.normalize_then_sum(table, torch.tensor(weights), torch.arange(len(rows)) // n, eps=1e-4)
    assert sums.tolist() == pytest.approx(trl_sums.tolist(), rel=1e-5, abs=1e-5)
    got, _ = assembled(gen, algorithm, named, grpo.GroupRelativeAdvantage(norm_std=False))
    # float32 sums carry a rounding error of a few units of 2**-23 times the terms they add (each
    # |z| <= sqrt(n - 1) in a group of n); the batch normalisation divides it by (std + eps), so a
    # batch of near-cancelling sums magnifies it where the float64 reference has none
    present = trl_sums[~trl_sums.isnan()]
    spread = present.std().item() if len(present) > 1 else math.inf
    rounding = 8 * 2**-23 * sum(abs(w) for w in weights) * math.sqrt(n - 1) / (spread + 1e-4)
    assert got.tolist() == pytest.approx(trl_advantages.tolist(), rel=1e-5, abs=1e-5 + rounding)


def _config(minimal: dict, **changes) -> dict:
    out = {
        **minimal,
        "algorithm": {"name": "grpo", "reward_shaping": {"aggregation": "normalize_then_sum"}},
        "rollout": {"engine": {"name": "gen"}, "sampling": {"n": 4}},
        "reward": {
            "name": "combine",
            "parts": [
                {"reward": {"name": "constant", "value": 1.0}, "weight": 0.5, "label": "one"},
                {"reward": {"name": "constant", "value": 0.0}, "weight": 2.0, "label": "two"},
            ],
        },
    }
    out.update(changes)
    return out


def _problems(tmp_path: Path, host, data: dict) -> list[str]:
    from core_rl.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(data))
    try:
        load_config(path, [], host=host)
    except ConfigError as err:
        return err.problems
    return []


def test_a_combine_reward_with_a_group_relative_estimator_loads(tmp_path: Path, host, minimal_config: dict) -> None:
    from core_rl.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(_config(minimal_config)))
    cfg = load_config(path, [], host=host)
    assert reward_part_weights(cfg) == {"one": 0.5, "two": 2.0}
    path.write_text(json.dumps({**_config(minimal_config), "algorithm": {"name": "grpo"}}))
    assert reward_part_weights(load_config(path, [], host=host)) is None  # the default: the score


@attrs.define
class TwoPartConfig:
    """A third party's reward of two weighted parts, ``format`` and ``answer``."""

    format_weight: float = 0.25

    def weighted_parts(self) -> dict[str, float]:
        return {"format": self.format_weight, "answer": 1.0}


class TwoPartReward(Reward):
    """``format_weight * format + answer``, each part reported: format 1 when the response has a
    digit, answer 1 when it is the row's answer."""

    def __init__(self, config: TwoPartConfig) -> None:
        self.config = config

    def score_with_parts(self, items) -> RewardScores:
        form = [float(any(c.isdigit() for c in item.response_text)) for item in items]
        answer = [float(item.response_text == str(item.row["answer"])) for item in items]
        scores = [self.config.format_weight * f + a for f, a in zip(form, answer)]
        return RewardScores(scores=scores, parts={"format": form, "answer": answer})

    def score(self, items) -> list[float]:
        return self.score_with_parts(items).scores


class TwoPartPlugin:
    @hookimpl
    def core_rl_register_rewards(self, register) -> None:
        register("two_part", TwoPartReward, description="two weighted parts", config_cls=TwoPartConfig)


def test_any_reward_whose_config_declares_weighted_parts_is_normalised(
    tmp_path: Path, host, minimal_config: dict
) -> None:
    """Not only ``combine``: a plugin's reward with ``weighted_parts()`` loads with
    ``normalize_then_sum``, the trainer gets its weights, and the parts it reports are the ones
    normalised; a reward without the method is refused."""
    from core_rl.config import load_config

    host.register_plugin(TwoPartPlugin(), distribution="test-two-part", version="1.0")
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(_config(minimal_config, reward={"name": "two_part", "format_weight": 0.5})))
    cfg = load_config(path, [], host=host)
    weights = reward_part_weights(cfg)
    assert weights == {"format": 0.5, "answer": 1.0}
    items = [RewardInput("q", text, [1], [2], {"answer": 7}, "stop") for text in ("7", "x", "8", "y")]
    scored = TwoPartReward(cfg.reward.config).score_with_parts(items)
    assert scored.parts == {"format": [1.0, 0.0, 1.0, 0.0], "answer": [1.0, 0.0, 0.0, 0.0]}
    gen = generation({name: [values] for name, values in scored.parts.items()}, weights)
    got, _ = assembled(gen, GDPO, weights, grpo.GroupRelativeAdvantage(norm_std=False))
    # format: mean 0.5, std sqrt(1/3), weight 0.5; answer: mean 0.25, std 0.5, weight 1
    zf = 0.5 * 0.5 / (math.sqrt(1 / 3) + EPS)
    hit, miss = 0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS)
    assert got.tolist() == pytest.approx([zf + hit, -zf + miss, zf + miss, -zf + miss], abs=1e-5)
    assert _problems(tmp_path, host, _config(minimal_config, reward={"name": "constant", "value": 1.0}))
    with pytest.raises(TypeError, match=r"TwoPartConfig.weighted_parts must return a mapping of labels to weights"):
        weighted_parts(attrs.evolve(cfg.reward.config, format_weight="0.5"))


KEY = "algorithm.reward_shaping.aggregation: normalize_then_sum normalises each weighted part"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reward": {"name": "constant", "value": 0.5}}, "but reward.name is 'constant', a single score"),
        (
            {"algorithm": {"name": "reinforce_pp", "reward_shaping": {"aggregation": "normalize_then_sum"}}},
            "the advantage estimator 'reinforce_pp' (algorithm.advantage.name) does not compare",
        ),
        ({"reward_model": {"model_path": "/models/rm"}}, "but the reward_model: role's score is added"),
    ],
)
def test_refused_where_it_cannot_apply(tmp_path: Path, host, minimal_config: dict, change: dict, message: str) -> None:
    problems = _problems(tmp_path, host, _config(minimal_config, **change))
    mine = [p for p in problems if p.startswith(KEY)]
    assert len(mine) == 1 and message in mine[0] and "or set algorithm.reward_shaping.aggregation: sum" in mine[0], (
        problems
    )


def test_reinforce_pp_with_its_group_baseline_is_group_relative(tmp_path: Path, host, minimal_config: dict) -> None:
    algorithm = {
        "name": "reinforce_pp",
        "advantage": {"name": "reinforce_pp", "group_baseline": True},
        "reward_shaping": {"aggregation": "normalize_then_sum"},
    }
    assert not [p for p in _problems(tmp_path, host, _config(minimal_config, algorithm=algorithm)) if KEY in p]


def test_an_unknown_aggregation_names_the_key(tmp_path: Path, host, minimal_config: dict) -> None:
    data = _config(minimal_config)
    data["algorithm"]["reward_shaping"] = {"aggregation": "mean"}
    problems = _problems(tmp_path, host, data)
    assert any(
        p == "algorithm.reward_shaping.aggregation: must be one of 'sum', 'normalize_then_sum', got 'mean'"
        for p in problems
    ), problems
