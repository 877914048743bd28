"""The reference-free losses of the ``dpo`` loop (``simpo``, ``orpo`` with ``reference: none``) end
to end on the tiny model of ``test_dpo_loop.py`` (CPU, the real ``fsdp`` engine): the loss falls
and the chosen-rejected margin grows without any reference model being built, the first step's
loss and gradient norm equal a plain transformers forward/backward of the formula on the
length-normalised log-probs, and the config mistakes are one line naming the key (exit 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from core_rl import cli
from core_rl.builtin.loggers import read_metrics
from pair_task import STRINGS, pair_task

pytest.importorskip("core_rl_fsdp")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return pair_task(
        tmp_path_factory.mktemp("reference_free"), "simpo", {"name": "simpo"}, {}, {"every_n_steps": 0, "at_end": False}
    )


@pytest.fixture
def built_roles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The roles the dpo loop builds a train engine for (its reference), recorded in process."""
    import core_rl_dpo.sequence

    roles: list[str] = []
    real = core_rl_dpo.sequence.build_engine

    def spy(*args, **kwargs):
        roles.append(kwargs.get("role", "?"))
        return real(*args, **kwargs)

    monkeypatch.setattr(core_rl_dpo.sequence, "build_engine", spy)
    return roles


def train(config: Path, *overrides: str) -> None:
    assert cli.main(["train", str(config), *overrides]) == 0


@pytest.mark.parametrize("algorithm", ["simpo", "orpo"])
def test_loss_falls_and_margin_grows_without_a_reference(setup, built_roles, algorithm):
    train(setup["config"], f"experiment.name={algorithm}", f"algorithm.name={algorithm}")
    assert built_roles == []  # no reference model, of any kind
    rows = read_metrics(setup["root"] / "runs" / algorithm / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    first, last = rows[0], rows[-1]
    assert last["dpo/loss"] < 0.75 * first["dpo/loss"]
    assert last["dpo/rewards/margin"] > first["dpo/rewards/margin"] + 0.05
    assert last["dpo/rewards/accuracy"] == 1.0
    # the rewards are scale * the mean log-probs (SimPO: beta = 2 from the recipe; ORPO: lambda 0.1)
    scale = 2.0 if algorithm == "simpo" else 0.1
    assert first["dpo/rewards/chosen"] == pytest.approx(scale * first["dpo/logps_mean/chosen"], rel=1e-5)
    if algorithm == "orpo":
        assert last["dpo/nll"] < first["dpo/nll"]  # the chosen responses' NLL falls
        assert last["dpo/log_odds/margin"] > first["dpo/log_odds/margin"] + 0.5
        assert first["dpo/nll"] == pytest.approx(-first["dpo/logps_mean/chosen"], rel=1e-6)


def test_the_spy_sees_a_reference_model_when_one_is_built(setup, built_roles):
    """The check of the test above can fail: the dpo loss builds its reference through the spy."""
    train(
        setup["config"],
        "experiment.name=with_reference",
        "algorithm.name=dpo",
        "trainer.total_steps=1",
    )
    assert built_roles == ["ref"]


def direct_first_step(
    model_dir: Path, rows: list[dict], loss_type: str, rpo_alpha: float = 0.0
) -> tuple[float, float, float]:
    """The step's loss, gradient norm and chosen token-mean NLL from a plain transformers
    forward/backward: each response's log-probs summed over its tokens then EOS, divided by that
    count, into the formula; with ``rpo_alpha`` plus ``rpo_alpha`` times the NLL of every chosen
    token of the step, averaged over those tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).train(False)

    def token_logprobs(prompt: str, response: str) -> torch.Tensor:
        p = tok(prompt)["input_ids"]
        ids = torch.tensor([p + tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
        logp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        return logp[len(p) - 1 :]

    def mean_logprob(prompt: str, response: str) -> torch.Tensor:
        return token_logprobs(prompt, response).mean()

    chosen_tokens = torch.cat([token_logprobs(r["prompt"], r["chosen"]) for r in rows])
    nll = -chosen_tokens.mean()  # over every chosen token of the step, not a mean of per-row means
    a_w = torch.stack([mean_logprob(r["prompt"], r["chosen"]) for r in rows])
    a_l = torch.stack([mean_logprob(r["prompt"], r["rejected"]) for r in rows])
    if loss_type == "simpo":  # beta 2 (the recipe's), gamma 0.5
        loss = -torch.nn.functional.logsigmoid(2.0 * (a_w - a_l) - 0.5).mean()
    else:  # lambda 0.1; log-odds log(p / (1 - p)) of p = e^a, written directly
        odds = lambda a: a - torch.log(1 - torch.exp(a))  # noqa: E731
        loss = (-a_w - 0.1 * torch.nn.functional.logsigmoid(odds(a_w) - odds(a_l))).mean()
    loss = loss + rpo_alpha * nll
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), norm, float(nll.detach())


@pytest.mark.parametrize(("algorithm", "rpo_alpha"), [("simpo", 0.0), ("orpo", 0.0), ("simpo", 0.7)])
def test_first_step_matches_a_direct_computation_of_the_formula(setup, tmp_path, algorithm, rpo_alpha):
    """The whole data set in one step (8 pairs of different lengths, 2-3 letters + EOS): the loop's
    loss and gradient norm (through its per-token surrogate) equal the formula's on a plain forward;
    with ``rpo_alpha`` the chosen responses' token-mean NLL is in both (and reported as ``dpo/rpo_nll``)."""
    rows = [{"prompt": f"{s}=", "chosen": s[::-1], "rejected": "d" * len(s)} for s in STRINGS[5:13]]
    assert {len(r["chosen"]) for r in rows} == {2, 3}
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    train(
        setup["config"],
        "experiment.name=direct",
        f"experiment.output_dir={tmp_path / 'runs'}",
        f"algorithm.name={algorithm}",
        f"data.train_files=[{data}]",
        "trainer.total_steps=1",
        *([f"trainer.loop.rpo_alpha={rpo_alpha}"] if rpo_alpha else []),
    )
    (first,) = read_metrics(tmp_path / "runs" / "direct" / "metrics.jsonl")
    loss, norm, nll = direct_first_step(setup["model"], rows, algorithm, rpo_alpha)
    assert first["dpo/loss"] == pytest.approx(loss, rel=1e-5)
    assert first["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    if rpo_alpha:
        assert first["dpo/rpo_nll"] == pytest.approx(nll, rel=1e-5)
        # the NLL moves the gradient: without it the norm is another one
        assert norm != pytest.approx(direct_first_step(setup["model"], rows, algorithm)[1], rel=1e-3)
    else:
        assert "dpo/rpo_nll" not in first


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.name=dpo", "trainer.loop.loss_type=simpo"],
            "trainer.loop.reference: model, but loss_type simpo reads no reference",
        ),
        (
            ["algorithm.name=orpo", "trainer.loop.reference=precomputed"],
            "trainer.loop.reference: precomputed, but loss_type orpo reads no reference",
        ),
        (
            ["trainer.loop.loss_type=ipo"],
            "trainer.loop.reference: none, but loss_type ipo compares log-ratios against a reference",
        ),
        (
            ["ref={model_path: MODEL}"],
            "ref: the dpo loop builds no reference model with trainer.loop.reference: none",
        ),
        (
            ["algorithm.name=orpo", "trainer.loop.label_smoothing=0.1"],
            "trainer.loop.label_smoothing: loss_type orpo does not read it",
        ),
        (
            ["trainer.loop.loss_type=exo_pair", "trainer.loop.reference=model"],
            "trainer.loop.label_smoothing: loss_type exo_pair models label noise and needs it in (0, 0.5)",
        ),
        (["trainer.loop.discopop_tau=0.5"], "trainer.loop.discopop_tau: only loss_type discopop reads it"),
        (
            [
                "algorithm.name=dpo",
                "trainer.loop.reference=precomputed",
                "data.max_length=64",
                "data.truncation=truncate",
            ],
            "data.truncation: truncate cuts responses, but trainer.loop.reference: precomputed reads",
        ),
        (["trainer.loop.reference=None"], "trainer.loop.reference"),
        (["trainer.loop.simpo_gamma=-0.5"], "trainer.loop.simpo_gamma"),
        (["algorithm.name=orpo", "trainer.loop.rpo_alpha=0.5"], "trainer.loop.rpo_alpha: loss_type orpo already"),
        (["trainer.loop.rpo_alpha=-1"], "trainer.loop.rpo_alpha"),
    ],
)
def test_config_mistakes_are_one_line_naming_the_key(setup, capsys, overrides, message):
    overrides = [o.replace("MODEL", str(setup["model"])) for o in overrides]
    assert cli.main(["config", "validate", str(setup["config"]), *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("  - ")]) == 1, err


def test_valid_reference_free_configs(setup, capsys):
    for overrides in (
        [],
        ["algorithm.name=orpo"],
        ["algorithm.name=dpo", "trainer.loop.reference=none", "trainer.loop.loss_type=simpo"],
    ):
        assert cli.main(["config", "validate", str(setup["config"]), *overrides]) == 0, capsys.readouterr().err
