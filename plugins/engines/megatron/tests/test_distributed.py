"""Two ranks on CPU (gloo): one ``torchrun`` launch of ``dist_worker.py`` runs tensor parallelism 2,
then data parallelism 2, and every figure is checked here against the Hugging Face model and
against the ``fsdp`` engine running the same steps in this process.

Tolerances (float32): logits 1e-4 absolute, log-probs 1e-5; losses and entropies relative 1e-6
and gradient norms 1e-5 against ``fsdp`` (the figures seen are in the plugin README); final weights
3e-4 absolute against ``fsdp`` after 3 AdamW steps at lr 1e-2 (see ``mcore_common.WEIGHT_ATOL``); resuming from
a checkpoint is exact; the Hugging Face <-> Megatron round trip is bit-exact. A critic (value head)
on tensor parallelism 2 is checked against the one-rank ``fsdp`` critic with the same tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import mcore_common as common
import pytest
import torch
from mcore_common import LOGIT_ATOL, LOGPROB_ATOL, VALUE_KEYS, WEIGHT_ATOL, same_metrics, same_weights

SCRIPT = Path(__file__).with_name("dist_worker.py")


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("megatron_dist")
    common.run_torchrun(SCRIPT, 2, "--model", str(tiny_model), "--out", str(out), timeout=420, cpu=True)
    return json.loads((out / "result.json").read_text()), out


@pytest.fixture(scope="module")
def fsdp_reference(tiny_model: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The same 3 steps on the ``fsdp`` engine (one rank, on the CPU like the ranks it is compared
    with, also on a GPU machine): metrics and final weights."""
    pytest.importorskip("core_rl_fsdp")
    from core_rl_fsdp.config import FSDPConfig
    from core_rl_fsdp.engine import FSDPEngine

    engine = FSDPEngine(common.actor(str(tiny_model), "fsdp"), FSDPConfig(device="cpu"))  # as the CPU ranks
    metrics = common.train(engine, range(3), 0, 1)
    final = engine.full_state_dict()
    engine.close()
    return metrics, final


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_tp2_shards_and_round_trip_are_bit_exact(run: tuple[dict, Path]) -> None:
    tp2 = run[0]["tp2"]
    assert tp2["tp"] == 2 and tp2["padded_vocab"] == 48  # 47 padded to a multiple of 8 * 2
    assert tp2["shards_equal"], "the engine's TP=2 shards differ from the converter's"
    assert tp2["round_trip_exact"], "gathering the TP=2 shards does not give back the HF weights bit for bit"


def test_tp2_logits_loss_and_logprobs_match_transformers(run: tuple[dict, Path], tiny_model: Path) -> None:
    from core_rl.testing.contracts import hf_logprobs

    forward = _load(run[1] / "tp2_forward.pt")
    batch = common.batches()[0]
    want = common.hf_logits(str(tiny_model), batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(forward["logits"][real], want[real], atol=LOGIT_ATOL, rtol=0)
    assert common.mean_nll(forward["logits"], batch) == pytest.approx(common.mean_nll(want, batch), rel=1e-6)
    # both ranks passed the whole batch: the replica ran 14 rows and handed rank 0 its 7
    lp = hf_logprobs(tiny_model, batch["input_ids"], batch["attention_mask"], 0.7)
    torch.testing.assert_close(forward["logprobs"], lp, atol=LOGPROB_ATOL, rtol=0)


def test_vocab_parallel_values_and_gradients_match_full_vocabulary(run: tuple[dict, Path]) -> None:
    parity = run[0]["tp2"]["vocab_parallel"]
    assert parity["logprob"] < 1e-5 and parity["entropy"] < 1e-5 and parity["grad"] < 1e-5, parity
    assert parity["grad_padding"] == 0.0  # padded vocabulary entries get no gradient


def test_tp2_training_matches_fsdp(run: tuple[dict, Path], fsdp_reference: tuple[list[dict], dict]) -> None:
    metrics, final = fsdp_reference
    tp2 = run[0]["tp2"]
    same_metrics(tp2["metrics_a"], metrics)
    assert [m["num_micro_batches"] for m in tp2["metrics_a"]] == [4.0, 4.0, 4.0]  # one replica: all 7 rows
    same_weights(_load(run[1] / "tp2_final.pt")["a"], final, WEIGHT_ATOL)


def test_tp2_resume_is_exact(run: tuple[dict, Path]) -> None:
    tp2 = run[0]["tp2"]
    same_metrics(tp2["metrics_b"], tp2["metrics_a"][1:], exact=True)
    finals = _load(run[1] / "tp2_final.pt")
    for key, value in finals["a"].items():
        assert torch.equal(finals["b"][key], value), key
    ckpt = run[1] / "ckpt_tp2"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["step"] == 1 and meta["layout"]["tensor_model_parallel_size"] == 2
    assert sorted(p.name for p in (ckpt / "optimizer").iterdir()) == ["exp_avg", "exp_avg_sq"]
    assert not list(ckpt.rglob("*.pt")) and not list(ckpt.rglob("*.bin")), "nothing may need unpickling"
    assert not [p for p in run[1].iterdir() if p.name.startswith(".")], "a partial directory was left"


def test_tp2_bucketed_export_loads_in_transformers(run: tuple[dict, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = run[1] / "export_tp2"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "export_bucket_mb=0.05 should give several files"
    AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    final = _load(run[1] / "tp2_final.pt")["a"]
    state = model.state_dict()
    assert state.keys() == final.keys()
    for key in final:
        assert torch.equal(state[key], final[key]), key


def test_dp2_training_matches_fsdp(run: tuple[dict, Path], fsdp_reference: tuple[list[dict], dict]) -> None:
    metrics, final = fsdp_reference
    dp2 = run[0]["dp2"]
    assert (dp2["tp"], dp2["dp"]) == (1, 2)
    same_metrics(dp2["metrics"], metrics)
    # ranks with 4/3, 6/1 and 7/0 rows: the rank with more micro-batches sets the count
    assert [m["num_micro_batches"] for m in dp2["metrics"]] == [2.0, 3.0, 4.0]
    same_weights(_load(run[1] / "dp2_final.pt")["final"], final, WEIGHT_ATOL)


def test_tp2_checkpoint_resumes_with_data_parallelism(run: tuple[dict, Path]) -> None:
    """The checkpoint holds model and optimizer state with Hugging Face names: written by TP=2, it
    resumes on TP=1 x DP=2 and continues the TP=2 run."""
    result = run[0]
    same_metrics(result["dp2"]["metrics_c"], result["tp2"]["metrics_a"][1:])
    same_weights(_load(run[1] / "dp2_final.pt")["cross"], _load(run[1] / "tp2_final.pt")["a"], WEIGHT_ATOL)


def test_a_second_layout_in_one_process_is_a_clear_error(run: tuple[dict, Path]) -> None:
    message = run[0]["tp2"]["layout_clash"]
    assert message is not None and "tensor_model_parallel_size: 2 (wanted 1)" in message


def test_tp2_critic_matches_fsdp_resumes_and_exports(run: tuple[dict, Path], fsdp_critic_cpu: dict) -> None:
    """A value head on tensor parallelism 2 (replicated on both ranks, fed the full hidden state)
    trains like the one-rank fsdp critic; its checkpoint resumes exactly; its export is a token
    classifier that gives the engine's values."""
    from transformers import AutoModelForTokenClassification

    result, critic = run[0]["tp2_critic"], _load(run[1] / "tp2_critic.pt")
    assert torch.equal(critic["start"], torch.zeros_like(critic["start"]))
    same_metrics(result["metrics_a"], fsdp_critic_cpu["metrics"], keys=VALUE_KEYS)
    torch.testing.assert_close(critic["values"], fsdp_critic_cpu["values"], atol=LOGPROB_ATOL, rtol=0)
    same_weights(critic["a"], fsdp_critic_cpu["final"], WEIGHT_ATOL)
    same_metrics(result["metrics_b"], result["metrics_a"][1:], exact=True, keys=VALUE_KEYS)
    assert all(torch.equal(critic["b"][k], v) for k, v in critic["a"].items())
    assert json.loads((run[1] / "ckpt_tp2_critic" / "meta.json").read_text())["head"] == "value"
    model = AutoModelForTokenClassification.from_pretrained(run[1] / "export_tp2_critic", dtype=torch.float32)
    batch = common.value_batches()[0]
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]
    want = torch.zeros_like(out)
    want[:, 1:] = out[:, :-1] * batch["attention_mask"][:, 1:]
    torch.testing.assert_close(critic["values"], want, atol=LOGPROB_ATOL, rtol=0)


def test_dp2_critic_matches_fsdp(run: tuple[dict, Path], fsdp_critic_cpu: dict) -> None:
    """A critic on 2 data-parallel ranks with uneven rows (down to a rank with none) sums its
    gradients like the one-rank fsdp critic."""
    same_metrics(run[0]["dp2"]["critic_metrics"], fsdp_critic_cpu["metrics"], keys=VALUE_KEYS)
    same_weights(_load(run[1] / "dp2_final.pt")["critic"], fsdp_critic_cpu["final"], WEIGHT_ATOL)
