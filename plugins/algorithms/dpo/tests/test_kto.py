"""The ``kto`` loop: its parts by hand (mismatched pairs, labels, metrics, the class-balance warning)
and end to end through ``core-rl train`` with the real ``fsdp`` engine on the tiny model of
``test_dpo_loop.py`` (CPU): the loss falls and desirable rewards rise above undesirable ones, the
result does not depend on the micro-batches or the number of ranks, a one-class data set trains with
a warning, and every config or data mistake is one line naming the key or the file and line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from core_rl import cli
from core_rl.builtin.loggers import read_metrics
from core_rl.data.prompts import PromptItem
from core_rl.errors import DataError
from core_rl.loops.supervised.sequences import TrainSequence
from core_rl.testing.launch import run_train
from core_rl.testing.tiny import build_tiny_model
from core_rl_dpo.config import KTOConfig, kto_balance_warning, kto_label
from core_rl_dpo.kto import KTOLoop, kto_metrics, kto_sums, mismatched_order, row_label
from pair_task import STRINGS

pytest.importorskip("core_rl_fsdp")


def kto_rows() -> list[dict]:
    """The reversed string is desirable for every prompt; a run of ``d`` of the same length is
    undesirable for every third prompt: 36 desirable rows, 12 undesirable ones."""
    rows = []
    for i, s in enumerate(STRINGS):
        rows.append({"prompt": f"{s}=", "completion": s[::-1], "label": True})
        if i % 3 == 0:
            rows.append({"prompt": f"{s}=", "completion": "d" * len(s), "label": False})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kto")
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    data = write_rows(root / "kto.jsonl", kto_rows())
    config = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 5},
        "data": {"train_files": [str(data)], "batch_size": 8},
        "actor": {"model_path": str(model), "optimizer": {"name": "adamw", "lr": 3e-3}},
        "algorithm": {"name": "kto"},
        "trainer": {"total_steps": 8, "torch_threads": 1, "loop": {"beta": 0.5}},
        "saver": {"every_n_steps": 0, "at_end": False},
        "loggers": [{"name": "console"}],
    }
    path = root / "kto.yaml"
    path.write_text(yaml.safe_dump(config))
    return {"root": root, "config": path, "data": data, "model": model}


def train(config: Path, *overrides: str) -> None:
    assert cli.main(["train", str(config), *overrides]) == 0


# --- parts ------------------------------------------------------------------------------------


def kto_stub(max_length: int | None) -> SimpleNamespace:
    """What :meth:`KTOLoop.make_batch` reads of a loop: each row's completion ids as they are."""
    return SimpleNamespace(
        loop_config=KTOConfig(),
        pad_token_id=0,
        cfg=SimpleNamespace(data=SimpleNamespace(max_length=max_length)),
        sequences=lambda item: [TrainSequence(item.prompt_ids, list(item.row["completion"]))],
    )


def test_mismatched_pairs_by_hand() -> None:
    """Prompt i with the completion of row (i + 1) mod B, after the B rows themselves; labels and
    masks follow the rows, the mismatched copies carry their prompt's label (never read)."""
    assert mismatched_order(2) == [1, 0]
    assert mismatched_order(3) == [1, 2, 0]
    items = [
        PromptItem(row={"completion": [7], "label": True}, text="p0", prompt_ids=[1, 2]),
        PromptItem(row={"completion": [8, 9], "label": 0}, text="p1", prompt_ids=[3]),
        PromptItem(row={"completion": [5], "label": False}, text="p2", prompt_ids=[4]),
    ]
    batch = KTOLoop.make_batch(kto_stub(None), items)  # type: ignore[arg-type]
    assert batch["input_ids"].tolist() == [
        [1, 2, 7, 0],  # prompt 0 + completion 0, padded to the widest row
        [3, 8, 9, 0],  # prompt 1 + completion 1
        [4, 5, 0, 0],  # prompt 2 + completion 2
        [1, 2, 8, 9],  # prompt 0 + completion 1: the mismatched rows
        [3, 5, 0, 0],  # prompt 1 + completion 2
        [4, 7, 0, 0],  # prompt 2 + completion 0
    ]
    assert batch["loss_mask"].tolist() == [
        [0, 0, 1, 0],
        [0, 1, 1, 0],
        [0, 1, 0, 0],
        [0, 0, 1, 1],
        [0, 1, 0, 0],
        [0, 1, 0, 0],
    ]
    assert batch["desirable"].tolist() == [True, False, False, True, False, False]
    # data.max_length: 3 cuts the one mismatched row longer than that at the end (the rows themselves fit)
    cut = KTOLoop.make_batch(kto_stub(3), items)  # type: ignore[arg-type]
    assert cut["input_ids"].tolist() == [[1, 2, 7], [3, 8, 9], [4, 5, 0], [1, 2, 8], [3, 5, 0], [4, 7, 0]]
    assert cut["loss_mask"].tolist() == [row[:3] for row in batch["loss_mask"].tolist()[:3]] + [
        [0, 0, 1],
        [0, 1, 0],
        [0, 1, 0],
    ]


def test_labels_by_hand() -> None:
    assert [kto_label(v) for v in (True, False, 1, 0)] == [True, False, True, False]
    assert [kto_label(v) for v in (2, -1, 1.0, "true", None, [1])] == [None] * 6
    item = PromptItem(row={"prompt": "ab=", "label": 1, "verdict": "good"}, text="ab=", prompt_ids=[1])
    assert row_label(item, "label") is True
    for key in ("verdict", "missing"):
        with pytest.raises(DataError, match=f"column '{key}'.*not a label"):
            row_label(item, key)


def test_metrics_by_hand() -> None:
    # 3 rows: losses 0.2, 0.4, 0.6; desirable, undesirable, desirable; log-ratios 1, -2, 3 (beta 0.5:
    # rewards 0.5, -1, 1.5); policy log-probs -5, -6, -7
    losses, desirable = torch.tensor([0.2, 0.4, 0.6]), torch.tensor([True, False, True])
    sums = kto_sums(losses, desirable, torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-5.0, -6.0, -7.0]), 0.5)
    assert sums.tolist() == pytest.approx([1.2, 2.0, 1.0, 2.0, -1.0, -12.0, -6.0])
    got = kto_metrics(sums, 3, 0.25)
    want = {"kto/loss": 0.4, "kto/kl": 0.25, "kto/count/desirable": 2.0, "kto/count/undesirable": 1.0}
    want |= {"kto/rewards/desirable": 1.0, "kto/rewards/undesirable": -1.0, "kto/rewards/margin": 2.0}
    want |= {"kto/logps/desirable": -6.0, "kto/logps/undesirable": -6.0}
    assert got == pytest.approx(want)
    # no undesirable row in the step: no undesirable means, no margin
    only = kto_metrics(torch.tensor([1.0, 2.0, 0.0, 2.0, 0.0, -12.0, 0.0]), 2, 0.0)
    assert set(only) == {"kto/loss", "kto/kl", "kto/count/desirable", "kto/count/undesirable"} | {
        "kto/rewards/desirable",
        "kto/logps/desirable",
    }


def test_balance_warning_by_hand() -> None:
    # w_D n_D / (w_U n_U): 1 * 10 / 10 = 1 and 1.2 * 10 / 10 = 1.2 are in [1, 4/3]: no warning
    assert kto_balance_warning(10, 10, 1.0, 1.0) is None
    assert kto_balance_warning(10, 10, 1.2, 1.0) is None
    # 36 / 12 = 3: desirable_weight in [1 * 12 / 36, 4/3 * 12 / 36] = [0.333, 0.444]
    message = kto_balance_warning(36, 12, 1.0, 1.0)
    assert message is not None and "is 3, outside" in message and "between 0.333 and 0.444" in message
    assert kto_balance_warning(36, 12, 0.4, 1.0) is None  # 0.4 * 36 / 12 = 1.2
    assert "every row of data.train_files is desirable" in (kto_balance_warning(5, 0, 1.0, 1.0) or "")
    assert "every row of data.train_files is undesirable" in (kto_balance_warning(0, 5, 1.0, 1.0) or "")


# --- end to end -------------------------------------------------------------------------------


def test_loss_falls_and_desirable_rewards_rise_above_undesirable_ones(setup, capsys):
    # desirable_weight 0.4: 0.4 * 36 / 12 = 1.2, the balance KTO recommends (no warning)
    train(setup["config"], "experiment.name=straight", "trainer.loop.desirable_weight=0.4")
    assert "warning" not in capsys.readouterr().err
    rows = read_metrics(setup["root"] / "runs" / "straight" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    first, last = rows[0], rows[-1]
    # policy == reference at step 1: every r = 0 and z = 0, each row's loss w * (1 - sigmoid(0)) = w / 2
    n_d, n_u = first["kto/count/desirable"], first["kto/count/undesirable"]
    assert n_d + n_u == 8 and n_d and n_u
    assert first["kto/loss"] == pytest.approx(0.5 * (0.4 * n_d + 1.0 * n_u) / 8, abs=1e-6)
    assert first["kto/kl"] == 0.0 and first["kto/rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    assert first["actor/loss"] == first["kto/loss"]
    assert sum(r["kto/loss"] for r in rows[-3:]) / 3 < 0.6 * first["kto/loss"]
    assert min(r["kto/rewards/desirable"] for r in rows[-3:]) > 0.1
    assert max(r.get("kto/rewards/undesirable", -9.0) for r in rows[-3:]) < -0.5
    assert last["kto/rewards/margin"] > 1.0
    assert last["kto/logps/desirable"] > first["kto/logps/desirable"]


def direct_first_step(policy_dir: Path, ref_dir: Path, rows: list[dict], beta: float) -> dict[str, float]:
    """The first step of the formula from plain transformers forwards of the policy and the
    reference: each completion's log-probs summed over its tokens then EOS; the KL baseline over
    prompt i with completion (i + 1) mod B; the loss's mean over the rows, and its gradient norm."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).train(False)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir).train(False)

    def seq_logprob(model, prompt: str, completion: str) -> torch.Tensor:
        p = tok(prompt)["input_ids"]
        ids = torch.tensor([p + tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
        logp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        return logp[len(p) - 1 :].sum()

    def logratio(prompt: str, completion: str) -> torch.Tensor:
        with torch.no_grad():
            reference = seq_logprob(ref, prompt, completion)
        return seq_logprob(policy, prompt, completion) - reference

    n = len(rows)
    with torch.no_grad():
        mismatched = [logratio(rows[i]["prompt"], rows[(i + 1) % n]["completion"]) for i in range(n)]
    z = max(0.0, float(sum(mismatched)) / n)
    r = torch.stack([logratio(row["prompt"], row["completion"]) for row in rows])
    desirable = torch.tensor([row["label"] for row in rows])
    loss = torch.where(desirable, 1 - torch.sigmoid(beta * (r - z)), 1 - torch.sigmoid(beta * (z - r))).mean()
    loss.backward()
    norm = sum(float(p.grad.pow(2).sum()) for p in policy.parameters() if p.grad is not None) ** 0.5
    rewards = beta * r.detach()
    return {
        "kto/loss": float(loss.detach()),
        "kto/kl": z,
        "kto/rewards/desirable": float(rewards[desirable].mean()),
        "kto/rewards/undesirable": float(rewards[~desirable].mean()),
        "kto/count/desirable": float(desirable.sum()),
        "actor/grad_norm": norm,
    }


def test_first_step_against_another_reference_matches_a_direct_computation(setup, tmp_path):
    """With a reference other than the starting policy (the ``ref:`` role: the tiny model of
    another seed) the log-ratios, the KL baseline over the mismatched pairs and the loss are live at
    step 1: the loop's values and gradient norm equal a plain forward/backward of the formula on
    the step's rows in file order (``data.shuffle: false``)."""
    ref = build_tiny_model(tmp_path / "ref", alphabet="abcd=", seed=7)
    rows = kto_rows()[:6]
    data = write_rows(tmp_path / "six.jsonl", rows)
    train(
        setup["config"],
        "experiment.name=direct",
        f"experiment.output_dir={tmp_path / 'runs'}",
        f"data.train_files=[{data}]",
        "data.shuffle=false",
        "data.batch_size=6",
        "trainer.total_steps=1",
        f"ref={{model_path: {ref}}}",
    )
    (first,) = read_metrics(tmp_path / "runs" / "direct" / "metrics.jsonl")
    want = direct_first_step(setup["model"], ref, rows, beta=0.5)
    assert want["kto/kl"] > 0.1  # the baseline shifts every row's loss (the check can fail)
    for key, value in want.items():
        assert first[key] == pytest.approx(value, rel=1e-4 if key == "actor/grad_norm" else 1e-5), key


STEP_KEYS = ("kto/loss", "kto/kl", "kto/rewards/desirable", "kto/rewards/undesirable", "actor/grad_norm")


def test_micro_batches_and_ranks_do_not_change_the_result(setup):
    """Padded micro-batches of one budget, packed ones of a budget of 24 tokens (a few rows each)
    and 2 ranks give the same metrics at steps 1 and 2 (the step-2 values follow the first update,
    with a positive KL baseline: its mean is the whole step's)."""
    runs = setup["root"] / "runs"
    common = ("trainer.total_steps=2",)
    train(setup["config"], "experiment.name=padded", *common, "actor.micro_batch.layout=padded")
    train(
        setup["config"],
        "experiment.name=packed",
        *common,
        "actor.micro_batch.layout=packed",
        "actor.micro_batch.max_tokens_per_mb=24",
    )
    run_train(setup["config"], "experiment.name=two_ranks", *common, nproc=2, cpu=True)
    padded = read_metrics(runs / "padded" / "metrics.jsonl")
    assert padded[1]["kto/kl"] > 0.05  # the baseline is live at step 2 (the check below can fail)
    assert padded[0]["actor/num_micro_batches"] == 1
    packed = read_metrics(runs / "packed" / "metrics.jsonl")
    assert packed[0]["actor/num_micro_batches"] > 2
    for a, b in zip(padded, packed, strict=True):
        for key in STEP_KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-6), key
    for a, b in zip(padded, read_metrics(runs / "two_ranks" / "metrics.jsonl"), strict=True):
        for key in STEP_KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_one_class_data_trains_with_a_warning(setup, tmp_path, capsys):
    data = write_rows(tmp_path / "good.jsonl", [r for r in kto_rows() if r["label"]])
    train(setup["config"], "experiment.name=one_class", f"data.train_files=[{data}]", "trainer.total_steps=2")
    assert "core-rl: warning: every row of data.train_files is desirable" in capsys.readouterr().err
    rows = read_metrics(setup["root"] / "runs" / "one_class" / "metrics.jsonl")
    assert [r["kto/count/undesirable"] for r in rows] == [0.0, 0.0]
    assert "kto/rewards/undesirable" not in rows[0] and rows[-1]["kto/rewards/desirable"] > 0


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.batch_size=1"], "data.batch_size: 1, but the kto loop pairs each prompt"),
        (["trainer.loop.reference=precomputed"], "trainer.loop.reference: unknown key"),
        (["trainer.loop.beta=0"], "trainer.loop.beta"),
        (["trainer.loop.undesirable_weight=-1"], "trainer.loop.undesirable_weight"),
    ],
)
def test_config_mistakes_are_one_line_naming_the_key(setup, capsys, overrides, message):
    assert cli.main(["config", "validate", str(setup["config"]), *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("  - ")]) == 1, err


BAD_ROWS = {
    "string": ({"label": "yes"}, "bad.jsonl:2: column 'label' (trainer.loop.label_key) holds a string ('yes')"),
    "number": ({"label": 2}, "bad.jsonl:2: column 'label' (trainer.loop.label_key) holds a number (2)"),
    "float": ({"label": 1.0}, "bad.jsonl:2: column 'label' (trainer.loop.label_key) holds a number (1.0)"),
    "null": ({"label": None}, "bad.jsonl:2: no column 'label' (or it is null), which trainer.loop.label_key reads"),
    "no completion": (
        {"completion": None},
        "bad.jsonl:2: no column 'completion' (or it is null), which trainer.loop.completion_key reads",
    ),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_data_mistakes_are_one_line_naming_the_file_and_line(setup, tmp_path, capsys, case):
    change, message = BAD_ROWS[case]
    rows = kto_rows()[:4]
    rows[1] = {k: v for k, v in {**rows[1], **change}.items() if v is not None}
    data = write_rows(tmp_path / "bad.jsonl", rows)
    args = ["config", "validate", "--preflight", str(setup["config"]), f"data.train_files=[{data}]"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("  - ")]) == 1, err


def test_train_refuses_bad_labels_before_loading_a_model_and_names_every_row(setup, tmp_path, capsys):
    rows = kto_rows()[:6]
    rows[2]["label"] = "no"
    del rows[3]["label"]
    del rows[5]["label"]
    data = write_rows(tmp_path / "bad.jsonl", rows)
    assert cli.main(["train", str(setup["config"]), f"data.train_files=[{data}]", "experiment.name=bad"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:3: column 'label' (trainer.loop.label_key) holds a string ('no')" in err, err
    assert "bad.jsonl:4: no column 'label' (or it is null) (also lines 6)" in err, err
    assert "Traceback" not in err and "Loading weights" not in err, err
    # a different label column throughout: every row lacks it, one line
    assert cli.main(["config", "validate", "--preflight", str(setup["config"]), "trainer.loop.label_key=verdict"]) == 2
    err = capsys.readouterr().err
    assert "kto.jsonl:1: no column 'verdict' (or it is null) (also lines 2, 3" in err, err
