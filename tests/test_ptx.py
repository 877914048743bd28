"""``algorithm.ptx``: supervised rows mixed into every optimiser step of the policy. The rows a
minibatch gains (masks and weights), the update's gradient against ``policy loss + coef * mean
NLL`` computed apart with the real fsdp engine, the draw's order and resume, data problems, and a
real run logging ``actor/ptx_nll``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from core_rl.config.loader import structure
from core_rl.config.schema import AlgorithmConfig, DataConfig, PTXConfig
from core_rl.errors import DataError
from core_rl.loops.rl.ptx import PTXLoss, PTXRows, with_ptx
from core_rl.loops.supervised.sequences import TrainSequence
from core_rl.testing import make_rl_batch
from core_rl.testing.tiny import build_char_tokenizer

TOK = build_char_tokenizer("abcd=")


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_rows_a_minibatch_gains() -> None:
    minibatch = make_rl_batch(batch_size=2, seed=0)
    minibatch["loss_weight"] = torch.full_like(minibatch["response_mask"], 0.5) * minibatch["response_mask"]
    sequences = [TrainSequence([5, 6], [7, 8, 2]), TrainSequence([5], [9])]
    out = with_ptx(minibatch, sequences, coef=0.2, pad_token_id=0)
    assert out.batch_size == 4 and set(out.keys()) == {*minibatch.keys(), "ptx_mask"}
    assert torch.equal(out["input_ids"][2, :5], torch.tensor([5, 6, 7, 8, 2]))
    assert out["response_mask"][2:].sum() == 0 and out["loss_mask"][2:].sum() == 0  # the policy loss never sees them
    assert out["ptx_mask"][:2].sum() == 0 and out["ptx_mask"][2:].sum() == 4  # 3 + 1 completion tokens
    assert torch.allclose(out["loss_weight"][2:].sum(), torch.tensor(0.2))  # coef over their 4 tokens
    width = minibatch["input_ids"].shape[1]
    assert torch.equal(out["loss_weight"][:2, :width], minibatch["loss_weight"])
    assert out["advantages"][2:].abs().sum() == 0


def test_the_update_minimises_the_policy_loss_plus_coef_times_the_mean_nll(tmp_path: Path) -> None:
    """One PolicyUpdate step with the real fsdp engine (SGD, lr 1): the weights move by minus the
    gradient of policy loss + coef * mean NLL, the two computed apart by plain autograd."""
    pytest.importorskip("core_rl_fsdp")
    from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
    from core_rl.loops.rl.update import PolicyUpdate
    from core_rl.plugins.host import PluginHost
    from core_rl.plugins.kinds import POLICY_LOSS, TRAIN_ENGINE
    from core_rl.testing.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    model_path = build_tiny_model(tmp_path / "model", seed=0)
    host = PluginHost()
    entry = host.get(TRAIN_ENGINE, "fsdp")
    actor = ActorConfig(
        model_path=str(model_path),
        engine=PluginSpec(name="fsdp"),
        optimizer=OptimizerConfig(name="sgd", lr=1.0),
        grad_clip=0.0,
    )
    engine = entry.factory(actor, structure({}, entry.config_cls), trainable=True)
    base = host.create(POLICY_LOSS, "ppo_clip", structure({}, host.get(POLICY_LOSS, "ppo_clip").config_cls))
    ptx_cfg = PTXConfig(files=["x"], coef=0.3, rows=2)
    update = PolicyUpdate(
        engine=engine,
        ref=None,
        loss=PTXLoss(base),
        algorithm=AlgorithmConfig(ptx=ptx_cfg),
        temperature=1.0,
        shard=lambda b: b,
        world_size=1,
    )
    sequences = [TrainSequence([5, 6, 7], [8, 9, 2]), TrainSequence([5], [10, 11])]

    class Rows:
        config = ptx_cfg

        def next_rows(self):
            return sequences

    update.ptx, update.pad_token_id = Rows(), 0
    batch = make_rl_batch(batch_size=4, seed=3)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    metrics = update(batch, train_version=1)
    assert metrics["actor/ptx_nll"] > 0

    # the same objective by plain autograd on a transformers copy of the starting weights
    hf = AutoModelForCausalLM.from_pretrained(model_path)
    rl = batch.rows(slice(0, 4))
    rl["loss_weight"] = base.loss_weights(rl["loss_mask"])
    logits = hf(input_ids=rl["input_ids"], attention_mask=rl["attention_mask"]).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, rl["input_ids"][:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    policy = (base(rl, lp, torch.zeros_like(lp)).per_token_loss * rl["loss_weight"]).sum()
    nll, tokens = 0.0, 0
    for s in sequences:
        ids = torch.tensor([s.prompt + s.response])
        out = torch.log_softmax(hf(input_ids=ids).logits.float()[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        nll = nll - out[len(s.prompt) - 1 :].sum()
        tokens += len(s.response)
    (policy + 0.3 * nll / tokens).backward()
    after = engine.full_state_dict()
    for name, param in hf.named_parameters():
        torch.testing.assert_close(after[name], before[name] - param.grad, atol=2e-5, rtol=1e-4, msg=name)
    engine.close()


def test_the_draw_is_seeded_reshuffled_each_epoch_and_resumes(tmp_path: Path) -> None:
    files = [str(write_rows(tmp_path / "sft.jsonl", [{"prompt": "ab=", "response": r} for r in ("a", "b", "c")]))]
    config = PTXConfig(files=files, rows=2)
    rows = PTXRows(config, DataConfig(), TOK, seed=1)
    drawn = [rows.next_rows() for _ in range(3)]  # 6 draws: two epochs of 3
    first, second = [s.response[0] for d in drawn for s in d][:3], [s.response[0] for d in drawn for s in d][3:]
    assert sorted(first) == sorted(second) == sorted(TOK.convert_tokens_to_ids(list("abc")))
    again = PTXRows(config, DataConfig(), TOK, seed=1)
    again.next_rows()
    state = json.loads(json.dumps(again.state_dict()))
    resumed = PTXRows(config, DataConfig(), TOK, seed=1)
    resumed.load_state_dict(state)
    assert [resumed.next_rows() for _ in range(2)] == drawn[1:]
    assert all(s.response[-1] == TOK.eos_token_id for d in drawn for s in d)  # EOS after each completion


def test_data_problems_name_the_file_and_line(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "sft.jsonl", [{"prompt": "ab=", "response": "a"}, {"prompt": "ab="}])
    with pytest.raises(DataError, match=r"sft.jsonl:2.*'response'"):
        PTXRows(PTXConfig(files=[str(path)]), DataConfig(), TOK, seed=0)
    with pytest.raises(Exception, match=r"algorithm.ptx.files"):
        structure({"files": []}, PTXConfig, path="algorithm.ptx")


def test_a_real_run_logs_the_ptx_loss(tmp_path: Path) -> None:
    """``core-rl train`` (fsdp + hf, 3 steps) with ptx rows that teach one answer: the NLL of the
    rows is logged each step and falls."""
    for dist in ("core_rl_fsdp", "core_rl_hf", "core_rl_reward_match"):
        pytest.importorskip(dist)
    from core_rl.builtin.loggers import read_metrics
    from core_rl.testing.launch import run_train, write_grpo_config
    from core_rl.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", alphabet="ab=", hidden_size=16, num_heads=2, seed=0)
    data = write_rows(tmp_path / "train.jsonl", [{"prompt": f"{s}=", "answer": s} for s in ("ab", "ba")])
    sft = write_rows(tmp_path / "sft.jsonl", [{"prompt": "ab=", "response": "ba"}] * 4)
    config = write_grpo_config(
        tmp_path,
        model,
        [str(data)],
        algorithm={"name": "grpo", "ptx": {"files": [str(sft)], "coef": 1.0, "rows": 4}},
        actor={"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 0.05}},
        trainer={"total_steps": 3},
        saver={"export_hf": False},
        loggers=[{"name": "jsonl"}],
    )
    run_train(config, cpu=True)
    rows = read_metrics(next((tmp_path / "runs").rglob("metrics.jsonl")))
    nll = [r["actor/ptx_nll"] for r in rows]
    assert len(nll) == 3 and nll[-1] < nll[0]


def test_ptx_is_refused_outside_the_rl_loop(tmp_path: Path, host, minimal_config: dict) -> None:
    pytest.importorskip("core_rl_sft")
    from core_rl.config import load_config
    from core_rl.errors import ConfigError

    minimal_config["algorithm"] = {**minimal_config.get("algorithm", {}), "ptx": {"files": ["sft.jsonl"]}}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(minimal_config))
    assert load_config(path, [], host=host).algorithm.ptx == PTXConfig(files=["sft.jsonl"])
    path.write_text(json.dumps({**minimal_config, "trainer": {"loop": {"name": "sft"}}}))
    with pytest.raises(ConfigError) as err:
        load_config(path, [], host=host)
    assert any(p.startswith("algorithm.ptx: mixes supervised rows into the rl loop") for p in err.value.problems)


def _ptx_rank(rank: int, init: str, out: str) -> None:
    """Rank ``rank`` of 2 (gloo): a ptx token count and NLL of its own, then ``observe_step``."""
    import torch.distributed as dist
    from core_rl_grpo.losses import PPOClipLoss

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        loss = PTXLoss(PPOClipLoss())
        batch = make_rl_batch(seed=rank)
        ptx = torch.zeros_like(batch["response_mask"])
        ptx[0, -1 - rank :] = 1.0  # rank 0: one ptx token, rank 1: two
        batch["ptx_mask"] = ptx
        logprobs = torch.full_like(ptx, -float(rank + 1))  # NLL 1 on rank 0's token, 2 on rank 1's
        loss(batch, logprobs, torch.zeros_like(ptx))
        Path(out, f"rank{rank}.json").write_text(json.dumps(loss.observe_step({})))
    finally:
        dist.destroy_process_group()


def test_the_ptx_nll_is_the_mean_over_every_ranks_tokens(tmp_path: Path) -> None:
    """Two real gloo ranks see 1 and 2 ptx tokens of NLL 1 and 2: both report (1 + 2 + 2) / 3."""
    pytest.importorskip("core_rl_grpo")
    import torch.multiprocessing as mp

    mp.start_processes(_ptx_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["ptx_nll"] == pytest.approx(5 / 3)
