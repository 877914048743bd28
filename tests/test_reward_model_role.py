"""The ``reward_model:`` role (a frozen fsdp engine with a score head, core_rl.roles.build and
core_rl.loops.rl.reward_model) on the tiny task, on CPU:

- its scores on the token ids of this run equal those of the ``reward_model`` reward on the decoded
  text, and of a Hugging Face sequence classifier on the ids, wherever the score is read;
- the rewards it completes on every rank (rule + coef * score) are shaped and turned into
  advantages exactly as the main rank does without it;
- a GRPO run serving the reward model through the role and one serving it through the reward plugin
  see the same rewards; 2 data-parallel ranks match 1; the asynchronous rollout controller works
  with it; configuration mistakes are one line with exit status 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from core_rl import cli
from core_rl.builtin.loggers import read_metrics

for _dist in ("core_rl_fsdp", "core_rl_hf", "core_rl_grpo", "core_rl_reward_model", "core_rl_reward_match"):
    pytest.importorskip(_dist)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_supervised" / "grpo_rm.yaml"
LETTERS = "abcdef"
SHORT = [
    "data.batch_size=4",
    "rollout.sampling.n=4",
    "rollout.sampling.max_new_tokens=6",
    "saver.every_n_steps=0",
    "saver.at_end=false",
    "saver.export_hf=false",
    "loggers=[]",
]


def build_reward_model(source: Path, path: Path, *, seed: int) -> Path:
    """A reward model as the rm loop exports it: ``LlamaForSequenceClassification`` (one label, no
    bias) on ``source``'s backbone with a random score head, and ``source``'s tokenizer."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    torch.manual_seed(seed)
    model = LlamaForSequenceClassification.from_pretrained(source, num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``model`` (the policy), ``rm`` (a reward model on another backbone, same tokenizer),
    ``data/sft.jsonl`` (the example's prompts and their reversals)."""
    from core_rl.testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("rm_role")
    build_tiny_model(root / "model", alphabet=LETTERS + "=", seed=0)
    build_reward_model(build_tiny_model(root / "rm_base", alphabet=LETTERS + "=", seed=1), root / "rm", seed=2)
    strings = [a + b + c for a in LETTERS for b in LETTERS for c in LETTERS[:2]]
    (root / "data").mkdir()
    (root / "data" / "sft.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{s}=", "response": s[::-1]}) + "\n" for s in strings)
    )
    return root


def _paths(workdir: Path) -> list[str]:
    return [
        f"experiment.output_dir={workdir}",
        f"actor.model_path={workdir / 'model'}",
        f"reward_model.model_path={workdir / 'rm'}",
    ]


def _train(workdir: Path, name: str, *overrides: str) -> list[dict]:
    code = cli.main(["train", str(EXAMPLE), *_paths(workdir), *SHORT, f"experiment.name={name}", *overrides])
    assert code == 0
    return read_metrics(workdir / name / "metrics.jsonl")


# -- the stage, in process -----------------------------------------------------------------------


def _samples(tokenizer) -> tuple[list, list[str]]:
    """Samples covering where a score can be read: ending with EOS, truncated, empty, only EOS."""
    from core_rl.protocol import Sample

    eos = tokenizer.eos_token_id
    cases = [("abc=", "cba", True), ("fed=", "dfe", False), ("ab=", "", False), ("ee=", "", True), ("fa=", "afa", True)]
    samples, texts = [], []
    for prompt, response, with_eos in cases:
        ids = tokenizer(response, add_special_tokens=False)["input_ids"] + ([eos] if with_eos else [])
        samples.append(
            Sample(
                prompt_ids=tokenizer(prompt)["input_ids"],
                response_ids=ids,
                logprobs=[0.0] * len(ids),
                weight_version=0,
                finish_reason="stop" if with_eos else "length",
            )
        )
        texts.append((prompt, response))
    return samples, texts


def _stage(workdir: Path, tokenizer, *, coef: float, score_token: str):
    from core_rl.config.schema import AlgorithmConfig, PluginSpec, RewardModelRoleConfig, RunConfig
    from core_rl.loops.rl.batching import BatchAssembler
    from core_rl.loops.rl.reward_model import reward_model_stage
    from core_rl_fsdp.engine import FSDPEngine
    from core_rl_grpo.advantages import GroupRelativeAdvantage

    config = RewardModelRoleConfig(model_path=str(workdir / "rm"), coef=coef, score_token=score_token)
    engine = FSDPEngine(config, trainable=False, head="score")
    batcher = BatchAssembler(
        AlgorithmConfig(),
        filters=[],
        advantage=GroupRelativeAdvantage(),
        prompts_per_step=2,
        max_new_tokens=8,
        pad_token_id=tokenizer.pad_token_id,
        rewards_after_broadcast=True,
    )
    run = RunConfig(reward_model=config, reward=PluginSpec(name="char_match"))
    one_rank = lambda b: b.rows(torch.arange(b.batch_size))  # noqa: E731 - one rank: every row
    stage = reward_model_stage(engine, run, batcher, one_rank, 1, tokenizer, tokenizer.pad_token_id)
    return engine, batcher, stage


def test_role_scores_equal_the_reward_plugin_and_a_sequence_classifier(workdir: Path) -> None:
    from core_rl.config.loader import structure
    from core_rl.protocol import RewardInput, samples_to_batch
    from core_rl_reward_model.config import RewardModelConfig
    from core_rl_reward_model.reward import ModelReward
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    samples, texts = _samples(tokenizer)
    batch = samples_to_batch(samples, [0, 0, 1, 1, 1], tokenizer.pad_token_id)
    classifier = AutoModelForSequenceClassification.from_pretrained(workdir / "rm").eval()
    reward = ModelReward(structure({"model_path": str(workdir / "rm"), "batch_size": 3}, RewardModelConfig))
    served = torch.tensor(
        reward.score(
            [
                RewardInput(prompt_text=p, response_text=r, prompt_ids=[], response_ids=[], row={}, finish_reason="")
                for p, r in texts
            ]
        )
    )
    with torch.no_grad():  # each row alone, unpadded: the classifier reads its last token
        whole = torch.tensor(
            [float(classifier(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, 0]) for s in samples]
        )
    assert served.std() > 0.05 and whole.std() > 0.05  # a real head, not the zero one
    for score_token, expected in (("last_content", served), ("last", whole)):
        engine, _, stage = _stage(workdir, tokenizer, coef=1.0, score_token=score_token)
        try:
            scores = stage.scores(batch)
        finally:
            engine.close()
        torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    # rows 1 and 3 end without EOS and row 3 is empty: both readings agree there, and differ elsewhere
    torch.testing.assert_close(served[[1, 2]], whole[[1, 2]], atol=1e-5, rtol=1e-5)
    assert (served[[0, 3, 4]] - whole[[0, 3, 4]]).abs().min() > 1e-4


def test_prepare_adds_the_scores_then_shapes_and_sets_advantages_as_the_main_rank_does(workdir: Path) -> None:
    from core_rl.protocol import samples_to_batch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    samples, _ = _samples(tokenizer)
    rule = torch.tensor([0.5, 0.0, 1.0, 0.25, 0.0])
    engine, batcher, stage = _stage(workdir, tokenizer, coef=2.0, score_token="last_content")
    try:
        batch = samples_to_batch(samples, [0, 0, 1, 1, 1], tokenizer.pad_token_id)
        batch["rewards"] = rule.clone()
        batch, first = batcher._finish(batch, {})
        assert "advantage/mean" not in first and batch["advantages"].abs().sum() == 0  # left to the stage
        metrics = stage.prepare(batch)
        scores = batch["reward_model_scores"]
        torch.testing.assert_close(batch["rewards"], rule + 2.0 * scores)
        # the main rank's own path (no reward model) on the same final rewards
        batcher.rewards_after_broadcast = False
        reference = samples_to_batch(samples, [0, 0, 1, 1, 1], tokenizer.pad_token_id)
        reference["rewards"] = rule + 2.0 * scores
        reference, expected = batcher._finish(reference, {})
    finally:
        engine.close()
    torch.testing.assert_close(batch["advantages"], reference["advantages"])
    assert batch["advantages"].abs().sum() > 0
    assert metrics["advantage/mean"] == pytest.approx(expected["advantage/mean"], abs=1e-7)
    assert metrics["reward/mean"] == pytest.approx(float((rule + 2.0 * scores).mean()), abs=1e-6)
    assert metrics["reward/reward_model/mean"] == pytest.approx(float(scores.mean()), abs=1e-6)
    assert metrics["reward/rule/max"] == 1.0 and metrics["reward/rule/min"] == 0.0


# -- whole runs through core-rl train ----------------------------------------------------------------


def test_grpo_with_the_role_sees_the_rewards_of_the_reward_plugin(workdir: Path) -> None:
    """The same reward model served by the role (token ids, every rank, after the broadcast) and by
    the ``reward_model`` reward (decoded text, main rank, before it): the same samples get the
    same rewards, so both runs train alike step after step."""
    # generation apart from the global RNG; the untrained policy samples <pad>, <s> and <unk> too,
    # which the reward plugin's decoded text drops: they end a response here (as EOS does), so its
    # text re-tokenises to the sampled ids and both read the score at the last letter
    seeded = ("trainer.total_steps=3", "rollout.engine.seed=7", "rollout.sampling.stop_token_ids=[0,1,3]")
    role = _train(workdir, "role", *seeded)
    served = f"reward={{name: reward_model, model_path: {workdir / 'rm'}}}"
    plugin = _train(workdir, "plugin", *seeded, "reward_model=null", served)
    assert [r["step"] for r in role] == [1, 2, 3]
    for a, b in zip(role, plugin):
        # no rule reward: the reward is the score (coef 1), reported as both
        assert a["reward/mean"] == pytest.approx(a["reward/reward_model/mean"], abs=1e-7)
        assert "reward/rule/mean" not in a
        for key in ("reward/mean", "reward/std", "reward/max", "reward/min", "batch/reward_mean"):
            assert a[key] == pytest.approx(b[key], abs=2e-5), key
        assert a["actor/loss"] == pytest.approx(b["actor/loss"], rel=1e-3, abs=1e-5)
    assert "timing/reward_model_s" in role[0]


def test_a_rule_reward_adds_to_the_score_with_its_coefficient(workdir: Path) -> None:
    rows = _train(
        workdir,
        "both",
        "trainer.total_steps=1",
        "reward={name: char_match, answer_key: response}",
        "reward_model.coef=0.5",
        "loggers=[{name: jsonl}]",
        "sample_log.every_n_steps=1",
        "sample_log.num_samples=16",
    )
    (row,) = rows
    expected = row["reward/rule/mean"] + 0.5 * row["reward/reward_model/mean"]
    assert row["reward/mean"] == pytest.approx(expected, abs=1e-6)
    assert row["reward/rule/mean"] > 0  # char_match scored something
    # the sample log (every sample of the step) carries the final rewards and the scores as a part
    logged = [json.loads(line) for line in (workdir / "both" / "samples.jsonl").read_text().splitlines()]
    assert len(logged) == 16
    assert sum(s["reward"] for s in logged) / 16 == pytest.approx(row["reward/mean"], abs=1e-5)
    assert sum(s["reward/reward_model"] for s in logged) / 16 == pytest.approx(
        row["reward/reward_model/mean"], abs=1e-5
    )


def test_ppo_returns_are_the_reward_model_rewards(workdir: Path) -> None:
    """With a critic the advantages still come after the critic's values (GAE in the update), now on
    the completed rewards: with discount 1 and gae_lambda 1 every response token's return is its
    sample's reward, and all responses are 6 tokens long, so the token mean of the returns is the
    mean reward."""
    pytest.importorskip("core_rl_ppo")
    rows = _train(
        workdir,
        "ppo",
        "trainer.total_steps=2",
        "algorithm.name=ppo",
        f"critic={{model_path: {workdir / 'model'}}}",
        "rollout.sampling.min_new_tokens=6",
    )
    for row in rows:
        assert row["reward/mean"] == pytest.approx(row["reward/reward_model/mean"], abs=1e-7)
        assert row["critic/returns_mean"] == pytest.approx(row["reward/mean"], abs=1e-5)
    assert rows[1]["critic/values_mean"] != 0.0  # the critic trained on them at step 1


def test_two_ranks_match_one(workdir: Path) -> None:
    from core_rl.testing.launch import run_torchrun

    options = ["trainer.total_steps=2", "reward_model.micro_batch.min_num_mb=2"]
    for ranks in (1, 2):  # CPU ranks both times, whatever the machine
        command = ["train", str(EXAMPLE), *_paths(workdir), *SHORT, *options, f"experiment.name=dp{ranks}"]
        run_torchrun(Path(cli.__file__), ranks, *command, timeout=300)
    one, two = (read_metrics(workdir / f"dp{ranks}" / "metrics.jsonl") for ranks in (1, 2))
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        for key in ("reward/mean", "reward/reward_model/std", "advantage/mean", "actor/loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_with_the_asynchronous_rollout_controller(workdir: Path) -> None:
    rows = _train(
        workdir,
        "async",
        "trainer.total_steps=3",
        "rollout.controller.max_head_offpolicyness=1",
        "algorithm.loss.use_decoupled_loss=true",
        "algorithm.loss.prox_logp_method=recompute",
    )
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["async/max_head_offpolicyness"] == 1.0
    for row in rows:
        assert row["reward/mean"] == pytest.approx(row["reward/reward_model/mean"], abs=1e-7)
        assert row["batch/reward_mean"] == pytest.approx(row["reward/mean"], abs=1e-6)


# -- configuration mistakes --------------------------------------------------------------------------


def _refused(workdir: Path, capsys, *overrides: str) -> str:
    code = cli.main(["train", str(EXAMPLE), *_paths(workdir), *SHORT, "experiment.name=refused", *overrides])
    assert code == 2
    return capsys.readouterr().err


def test_a_missing_model_path_is_refused(workdir: Path, capsys) -> None:
    err = _refused(workdir, capsys, "reward_model.model_path=''")
    assert "reward_model.model_path: required; the path of a Hugging Face model directory" in err


def test_sample_filters_and_dynamic_sampling_are_refused(workdir: Path, capsys) -> None:
    err = _refused(
        workdir,
        capsys,
        "algorithm.filters=[{name: drop_uniform_groups}]",
        "algorithm.max_num_gen_batches=3",
    )
    assert "algorithm.filters: the sample filters ('drop_uniform_groups') run on the main rank before" in err
    assert "algorithm.max_num_gen_batches: dynamic sampling (3)" in err


def test_another_tokenizer_is_refused(workdir: Path, capsys) -> None:
    from core_rl.testing.tiny import build_tiny_model

    other = build_reward_model(
        build_tiny_model(workdir / "other_base", alphabet="fedcba=", seed=1), workdir / "other_rm", seed=2
    )
    err = _refused(workdir, capsys, f"reward_model.model_path={other}")
    assert f"reward_model.model_path: the tokenizer in {str(other)!r} is not the actor's" in err
    assert "6 of the actor's 11 tokens have another id or none" in err


def test_a_causal_lm_is_refused(workdir: Path, capsys) -> None:
    err = _refused(workdir, capsys, f"reward_model.model_path={workdir / 'model'}")
    assert "holds LlamaForCausalLM, not a reward model" in err


def test_an_engine_without_a_score_head_is_refused() -> None:
    from core_rl.config.schema import RewardModelRoleConfig, RunConfig
    from core_rl.roles.build import role_problems
    from core_rl.testing import recipe_host

    # recipe_host's stand-in 'fsdp' lists no heads (so: lm only)
    problems = role_problems(RunConfig(reward_model=RewardModelRoleConfig(model_path="/m")), recipe_host())
    assert problems == [
        "reward_model.engine.name: train engine 'fsdp' (distribution <stand-in>) cannot build a reward model "
        "(its config class lists no 'score' head); use an engine that does, e.g. fsdp"
    ]


def test_an_installed_engine_without_a_score_head_is_refused_by_train(workdir: Path, capsys, monkeypatch) -> None:
    """Through ``core-rl train``: every in-repo train engine builds a score head, so megatron's heads
    are cut to the language-model head here."""
    pytest.importorskip("core_rl_megatron")
    from core_rl_megatron.config import MegatronConfig

    monkeypatch.setattr(MegatronConfig, "heads", ("lm",))
    err = _refused(workdir, capsys, "reward_model.engine.name=megatron")
    engine = "train engine 'megatron' (distribution core-rl-megatron)"
    assert f"reward_model.engine.name: {engine} cannot build a reward model" in err
