"""Value and score heads of the megatron engine on CPU (one process, the test-only shim; the
conformance kit's value and score tests run in ``test_conformance.py``, tensor parallelism 2 in
``test_distributed.py``):

- a critic (``head="value"``) trains like the ``fsdp`` critic on the same model and batches: PPO's
  clipped value loss, its clip fraction, the gradient norm and the learning rate per step within the
  engines' parity tolerances, the values and the weights after 3 AdamW steps;
- the ``rm`` loop runs on megatron (``actor.engine.name=megatron``) like on fsdp (loss, accuracy and
  scores per step), its export loads as a sequence classifier that the ``reward_model`` reward serves
  with the engine's scores, and a score model exported by the fsdp ``rm`` run loads into a megatron
  score engine bit for bit (a critic started from it gets its head, bias 0);
- a checkpoint of one head is refused by an engine of another.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import mcore_common as common
import pytest
import torch
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.checkpoint.files import CheckpointFormatError
from core_rl_megatron.config import MegatronConfig
from core_rl_megatron.engine import MegatronEngine
from mcore_common import ON_GPU, VALUE_KEYS, WEIGHT_ATOL, same_metrics, same_weights

pytest.importorskip("core_rl_fsdp")

OPTIONS = MegatronConfig(make_vocab_size_divisible_by=8)


def test_critic_trains_like_the_fsdp_critic(tiny_model: Path, fsdp_critic: dict) -> None:
    got = common.critic_run(MegatronEngine(common.actor(str(tiny_model)), OPTIONS, head="value"))
    want = fsdp_critic
    assert torch.equal(got["start"], torch.zeros_like(got["start"]))  # the head starts at 0 on both
    same_metrics(got["metrics"], want["metrics"], keys=VALUE_KEYS, scale=ON_GPU)
    clipped = [m["value_clipped"] for m in got["metrics"]]
    assert any(0 < c < 1 for c in clipped), clipped  # both branches of the clipped loss are exercised
    torch.testing.assert_close(got["values"], want["values"], atol=common.LOGPROB_ATOL, rtol=0)
    assert set(got["final"]) == set(want["final"]) and "score.bias" in got["final"]
    same_weights(got["final"], want["final"], WEIGHT_ATOL)


def test_a_checkpoint_of_another_head_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    critic = MegatronEngine(common.actor(str(tiny_model)), OPTIONS, head="value")
    critic.save_state(tmp_path / "critic", {})
    critic.close()
    policy = MegatronEngine(common.actor(str(tiny_model)), OPTIONS)
    with pytest.raises(CheckpointFormatError, match="head='value'.*head='lm'"):
        policy.load_state(tmp_path / "critic")
    with pytest.raises(RuntimeError, match="compute_values needs an engine built with head in"):
        policy.compute_values(common.value_batches()[0])
    policy.close()


# ------------------------------------------------------------------ the rm loop


def _pairs(rng: random.Random) -> list[dict]:
    """Chosen: the prompt reversed; rejected: the same with one letter replaced by ``d``."""
    rows = []
    for s in ("ab", "ba", "abc", "cab", "bca", "acb", "cc", "abca"):
        rejected = list(s[::-1])
        rejected[rng.randrange(len(s))] = "d"
        rows.append({"prompt": f"{s}=", "chosen": s[::-1], "rejected": "".join(rejected)})
    return rows


@pytest.fixture(scope="module")
def rm_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """4 steps of the ``rm`` loop on fsdp and on megatron (``core-rl train`` in this process: the
    shim must be in place), same model, pairs and seed."""
    from core_rl import cli
    from core_rl.testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("rm_megatron")
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _pairs(random.Random(0))))
    config = {
        "experiment": {"name": "fsdp", "output_dir": str(root / "runs"), "seed": 3},
        "data": {"train_files": [str(data)], "batch_size": 4},
        "actor": {"model_path": str(model), "optimizer": {"name": "adamw", "lr": 3e-3}},
        "algorithm": {"name": "rm"},
        "trainer": {"total_steps": 4, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "at_end": False},
        "loggers": [],
    }
    path = root / "rm.yaml"
    path.write_text(yaml.safe_dump(config))
    megatron = ["experiment.name=megatron", "actor.engine={name: megatron, make_vocab_size_divisible_by: 8}"]
    for overrides in (["experiment.name=fsdp"], megatron):
        assert cli.main(["train", str(path), *overrides]) == 0
    runs = root / "runs"
    return {"model": model, "fsdp": runs / "fsdp", "megatron": runs / "megatron"}


def test_rm_loop_on_megatron_matches_fsdp_and_exports_a_sequence_classifier(rm_runs: dict) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    fsdp, mega = (read_metrics(rm_runs[k] / "metrics.jsonl") for k in ("fsdp", "megatron"))
    assert [r["step"] for r in mega] == [1, 2, 3, 4]
    assert mega[0]["rm/loss"] == pytest.approx(0.693147, abs=1e-6)  # the score head starts at 0
    for a, b in zip(fsdp, mega):
        for key in ("rm/loss", "rm/accuracy", "rm/scores/chosen", "rm/scores/rejected", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5 * ON_GPU, abs=1e-7), (a["step"], key)
    assert mega[-1]["rm/loss"] < mega[0]["rm/loss"]
    export = rm_runs["megatron"] / "final_hf"
    config = AutoConfig.from_pretrained(export)
    assert config.architectures == ["LlamaForSequenceClassification"] and config.num_labels == 1
    got, want = load_file(export / "model.safetensors"), load_file(rm_runs["fsdp"] / "final_hf" / "model.safetensors")
    assert "score.bias" not in got and "lm_head.weight" not in got
    same_weights(got, want, WEIGHT_ATOL)


def test_rm_export_is_served_by_the_reward_model_reward(rm_runs: dict) -> None:
    """The megatron run's export, served by the ``reward_model`` reward, gives the scores a megatron
    score engine computes from the same directory (the last token's value)."""
    pytest.importorskip("core_rl_reward_model")
    from core_rl.config.loader import structure
    from core_rl.testing import make_reward_input
    from core_rl_reward_model.config import RewardModelConfig
    from core_rl_reward_model.reward import ModelReward
    from core_rl_rm.loop import score_batch
    from transformers import AutoTokenizer

    export = rm_runs["megatron"] / "final_hf"
    pairs = _pairs(random.Random(0))
    tok = AutoTokenizer.from_pretrained(export)
    prompts = [tok(p["prompt"])["input_ids"] for p in pairs] * 2
    responses = [tok(p[k], add_special_tokens=False)["input_ids"] for k in ("chosen", "rejected") for p in pairs]
    batch = score_batch(prompts, responses, tok.pad_token_id)
    engine = MegatronEngine(common.actor(str(export)), OPTIONS, head="score", trainable=False)
    scores = (engine.compute_values(batch) * batch["score_mask"]).sum(1)
    engine.close()
    reward = ModelReward(structure({"model_path": str(export), "batch_size": 5}, RewardModelConfig, path="reward"))
    items = [make_reward_input(p[k], prompt=p["prompt"]) for k in ("chosen", "rejected") for p in pairs]
    served = torch.tensor(reward.score(items))
    assert served.abs().max() > 1e-3  # trained, not the zero head
    torch.testing.assert_close(served, scores, atol=2e-5, rtol=1e-5)


def test_a_score_model_exported_by_fsdp_loads_into_megatron(rm_runs: dict) -> None:
    """The fsdp ``rm`` export (``LlamaForSequenceClassification``) as a megatron score model: its
    weights bit for bit; as a critic's starting point: its head with a zero bias."""
    from safetensors.torch import load_file

    export = rm_runs["fsdp"] / "final_hf"
    saved = load_file(export / "model.safetensors")
    score = MegatronEngine(common.actor(str(export)), OPTIONS, head="score", trainable=False)
    state = score.full_state_dict()
    score.close()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    critic = MegatronEngine(common.actor(str(export)), OPTIONS, head="value")
    state = critic.full_state_dict()
    critic.close()
    assert torch.equal(state["score.weight"], saved["score.weight"])
    assert torch.equal(state["score.bias"], torch.zeros(1))
