"""``data.max_length`` in the ``sft`` loop: the batch a truncated row makes (by hand, with the tiny
model's tokenizer), then through ``core-rl train`` with the real ``fsdp`` engine on the CPU: a long
row refused before the model loads (exit 2, naming it), dropped rows never trained on, and the loss
of truncated rows equal to a plain transformers forward's NLL of the rows cut by hand."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from core_rl import cli
from core_rl.builtin.loggers import read_metrics
from core_rl.config.data_config import DataConfig
from core_rl.data.prompts import PromptItem
from core_rl.loops.supervised.loop import SupervisedLoop
from core_rl.testing.tiny import add_chat_template, build_tiny_model
from core_rl_sft.config import SFTConfig
from core_rl_sft.loop import SFTLoop
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("core_rl_fsdp")

SHORT = ["ab", "ba", "cd", "dc", "ac", "ca", "bd", "db", "ad", "da", "bc", "cb"]  # 4 + 2 + EOS = 7 tokens
LONG = ["abcdabcd", "dcbadcba", "aabbccdd", "ddccbbaa"]  # 4 + 8 + EOS = 13 tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sft_max_length")
    model = build_tiny_model(root / "model", alphabet="abcd=su:>", seed=0)
    add_chat_template(model)
    data = root / "sft.jsonl"
    rows = [{"prompt": "ab=", "response": s} for s in SHORT[:6] + LONG[:2] + SHORT[6:] + LONG[2:]]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 2},
        "data": {"train_files": [str(data)], "batch_size": 4, "max_length": 8},
        "actor": {"model_path": str(model), "optimizer": {"name": "adamw", "lr": 1e-2}},
        "algorithm": {"name": "sft"},
        "trainer": {"total_epochs": 1, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "at_end": False},
        "loggers": [{"name": "console"}],
    }
    path = root / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    return {"root": root, "config": path, "data": data, "model": model}


def batch_of(setup, rows: list[dict], *, max_length: int | None, **loop: object):
    """The batch :meth:`SFTLoop.make_batch` makes of ``rows`` (prompt text with BOS) with
    ``data.max_length`` and ``data.truncation: truncate``: the loop's own code on a loop holding what
    it reads (config, tokenizer, data section)."""
    tok = AutoTokenizer.from_pretrained(setup["model"])
    truncation = "truncate" if max_length is not None else None
    data = DataConfig(prompt_key="prompt", max_length=max_length, truncation=truncation, apply_chat_template=True)
    loop = SimpleNamespace(loop_config=SFTConfig(**loop), tokenizer=tok, cfg=SimpleNamespace(data=data), pad_token_id=0)
    loop.sequences = lambda item: SupervisedLoop.sequences(loop, item)

    def prompt_ids(prompt: object) -> list[int]:  # a conversation's come from its rendering
        return tok(prompt)["input_ids"] if isinstance(prompt, str) else []

    items = [PromptItem(row=r, text=str(r["prompt"]), prompt_ids=prompt_ids(r["prompt"])) for r in rows]
    return SFTLoop.make_batch(loop, items), tok  # type: ignore[arg-type]


def test_a_truncated_row_keeps_its_start_without_eos_and_trains_on_the_kept_tokens(setup):
    rows = [{"prompt": "ab=", "response": "ba"}, {"prompt": "ab=", "response": "abcdabcd"}]
    batch, tok = batch_of(setup, rows, max_length=8)
    prompt, eos = tok("ab=")["input_ids"], tok.eos_token_id
    assert batch["input_ids"].shape[1] == 8
    assert batch["input_ids"].tolist() == [
        prompt + tok("ba", add_special_tokens=False)["input_ids"] + [eos, 0],
        prompt + tok("abcd", add_special_tokens=False)["input_ids"],  # cut: no EOS
    ]
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1]]
    whole, _ = batch_of(setup, rows, max_length=None)
    assert whole["input_ids"].shape[1] == 13 and whole["loss_mask"][1].sum() == 9
    # train_on_prompt: every kept token after the first
    batch, _ = batch_of(setup, rows, max_length=8, train_on_prompt=True)
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1, 1]]


def test_a_conversation_is_cut_at_the_end_with_its_assistant_mask(setup):
    messages = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ba"},
        {"role": "user", "content": "="},
        {"role": "assistant", "content": "abcd"},
    ]
    rows = [{"prompt": messages}]
    whole, _ = batch_of(setup, rows, max_length=None, conversations=True)
    ids, mask = whole["input_ids"][0].tolist(), whole["loss_mask"][0].tolist()
    last = max(i for i, m in enumerate(mask) if m)  # the final end of turn
    limit = last - 2  # inside the second assistant turn
    batch, _ = batch_of(setup, rows, max_length=limit, conversations=True)
    assert batch["input_ids"][0].tolist() == ids[:limit]
    assert batch["loss_mask"][0].tolist() == mask[:limit]
    assert 0 < sum(mask[:limit]) < sum(mask)


def test_a_long_row_is_refused_before_the_model_loads(setup, capsys):
    assert cli.main(["train", str(setup["config"]), "experiment.name=error"]) == 2
    err = capsys.readouterr().err
    for line in (7, 8, 15, 16):
        assert f"{setup['data']}:{line}: 13 tokens > data.max_length=8" in err, err
    assert "data.max_length: the rows of data.train_files above are longer than 8 tokens" in err, err
    assert "Traceback" not in err and "Loading weights" not in err, err
    assert not (setup["root"] / "runs" / "error" / "metrics.jsonl").exists()


def test_dropped_rows_are_never_trained_on(setup, capsys):
    assert cli.main(["train", str(setup["config"]), "experiment.name=drop", "data.truncation=drop"]) == 0
    err = capsys.readouterr().err
    assert "core-rl: data: dropped 4 of 16 rows longer than data.max_length=8 tokens (data.truncation: drop)" in err
    rows = read_metrics(setup["root"] / "runs" / "drop" / "metrics.jsonl")
    # one epoch of the 12 rows left, 4 a step; each step 4 short rows of 2 letters + EOS (a long row: 9)
    assert [r["sft/target_tokens"] for r in rows] == [12.0] * 3


def test_the_loss_of_truncated_rows_is_the_nll_of_the_rows_cut_by_hand(setup):
    overrides = ["experiment.name=truncate", "data.truncation=truncate", "data.batch_size=16", "trainer.total_steps=1"]
    assert cli.main(["train", str(setup["config"]), *overrides, "trainer.total_epochs=null"]) == 0
    (first,) = read_metrics(setup["root"] / "runs" / "truncate" / "metrics.jsonl")
    tok = AutoTokenizer.from_pretrained(setup["model"])
    model = AutoModelForCausalLM.from_pretrained(setup["model"]).eval()
    prompt = tok("ab=")["input_ids"]
    total, count = 0.0, 0
    for line in setup["data"].read_text().splitlines():
        response = tok(json.loads(line)["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        response = response[: 8 - len(prompt)]  # the hand cut: 4 tokens after the prompt, EOS gone
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        total -= float(logp[len(prompt) - 1 :].sum())
        count += len(response)
    assert first["sft/target_tokens"] == count == 12 * 3 + 4 * 4
    assert first["sft/loss"] == pytest.approx(total / count, abs=1e-5)


def test_a_loop_built_without_preflight_bounds_its_rows_too(setup):
    """The rows a loop draws when it reads the files itself (no preflight: ``rows=None``), as
    :class:`~core_rl.loops.supervised.loop.SupervisedLoop` builds its source: the long rows left out
    with ``drop``, refused with ``error``."""
    from core_rl.config import load_config
    from core_rl.data.prompts import PromptSource
    from core_rl.errors import DataError
    from core_rl.loops.supervised.length_bound import run_bound
    from core_rl.plugins.host import PluginHost

    tok = AutoTokenizer.from_pretrained(setup["model"])
    cfg = load_config(setup["config"], ["data.truncation=drop"], host=PluginHost())
    source = PromptSource(cfg.data, tok, seed=0, select=run_bound(cfg, tok))
    assert sorted(item.row["response"] for item in source.items) == sorted(SHORT)
    cfg = load_config(setup["config"], [], host=PluginHost())
    with pytest.raises(DataError, match="16: 13 tokens > data.max_length=8"):
        PromptSource(cfg.data, tok, seed=0, select=run_bound(cfg, tok))
