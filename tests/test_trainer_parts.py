"""Trainer building blocks on real files: the prompt source and checkpoint bookkeeping."""

from __future__ import annotations

import json

import pytest
from core_rl.checkpoint import store as checkpoints
from core_rl.config.schema import DataConfig
from core_rl.data.prompts import PromptSource
from core_rl.errors import DataError
from core_rl.testing import preloaded
from core_rl.testing.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompt_source_epochs_and_resume(tmp_path, tokenizer):
    files = [_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)])]
    cfg = DataConfig(train_files=files, batch_size=3, shuffle=True)
    src = PromptSource(cfg, tokenizer, seed=4)
    first_epoch = [p.text for p in src.next_batch()] + [p.text for p in src.next_batch()][:2]
    assert sorted(first_epoch) == [f"q{i}" for i in range(5)]  # every prompt once per epoch
    state = src.state_dict()
    expected = [p.text for p in src.next_batch()]
    resumed = PromptSource(cfg, tokenizer, seed=4)
    resumed.load_state_dict(state)
    assert [p.text for p in resumed.next_batch()] == expected
    item = resumed.items[0]
    assert item.prompt_ids == tokenizer("q0")["input_ids"] and item.row["answer"] == "0"


def test_prompt_source_errors_name_the_row(tmp_path, tokenizer):
    files = [_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"question": "no prompt"}])]
    with pytest.raises(DataError, match=r"p.jsonl:2: no column 'prompt' \(columns: question\)"):  # 1-based lines
        PromptSource(DataConfig(train_files=files), tokenizer, seed=0)
    with pytest.raises(DataError, match="does not exist"):
        PromptSource(DataConfig(train_files=[str(tmp_path / "none.jsonl")]), tokenizer, seed=0)
    with pytest.raises(DataError, match="unsupported extension"):
        PromptSource(DataConfig(train_files=[str(tmp_path / "p.csv")]), tokenizer, seed=0)
    long = [_jsonl(tmp_path / "l.jsonl", [{"prompt": "x" * 20}])]
    with pytest.raises(DataError, match="more than data.max_prompt_tokens=8"):
        PromptSource(DataConfig(train_files=long, max_prompt_tokens=8), tokenizer, seed=0)


def test_checkpoint_latest_and_prune(tmp_path):
    assert checkpoints.latest_checkpoint(tmp_path) is None
    for step in (2, 4, 6):
        checkpoints.checkpoint_dir(tmp_path, step).mkdir(parents=True)
        checkpoints.mark_latest(tmp_path, step)
    # an unfinished checkpoint (no "latest" update) is not picked up
    checkpoints.checkpoint_dir(tmp_path, 8).mkdir()
    assert checkpoints.latest_checkpoint(tmp_path) == checkpoints.checkpoint_dir(tmp_path, 6)
    removed = checkpoints.prune(tmp_path, keep_last=2)
    assert checkpoints.checkpoint_dir(tmp_path, 2) in removed
    assert checkpoints.checkpoint_dir(tmp_path, 6).is_dir()
    assert checkpoints.latest_checkpoint(tmp_path) == checkpoints.checkpoint_dir(tmp_path, 6)


def test_library_progress_bars_are_quiet_without_importing_datasets() -> None:
    """A run silences ``datasets``'s bars through its environment variable, so it does not import
    ``datasets`` (about 86 MiB resident) just for that; once imported, its bars are off."""
    import os
    import sys

    code = (
        "import sys\n"
        "from core_rl.loops.building import quiet_library_progress_bars\n"
        "quiet_library_progress_bars()\n"
        "assert 'datasets' not in sys.modules, 'datasets was imported'\n"
        "import transformers\n"
        "assert not transformers.utils.logging.is_progress_bar_enabled()\n"
        "import datasets\n"
        "assert datasets.utils.are_progress_bars_disabled()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_DATASETS_DISABLE_PROGRESS_BARS"}
    result = preloaded.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_distillation_keeps_the_entropy_graph_only_for_an_rl_term_that_needs_it() -> None:
    """The distillation loss differentiates through the entropy only through its base loss, and
    only while that base loss counts (``rl_coef > 0``)."""
    from core_rl.config.schema import TeacherConfig
    from core_rl.interfaces import LossOutput, PolicyLoss
    from core_rl.loops.rl.distill import DistillationLoss

    class Base(PolicyLoss):
        def __init__(self, entropy_grad: bool) -> None:
            self.entropy_grad = entropy_grad

        def loss_weights(self, response_mask):
            return response_mask

        def __call__(self, batch, logprobs, entropy):
            return LossOutput(per_token_loss=-entropy)

    assert DistillationLoss(Base(True), TeacherConfig(model_path="t")).entropy_grad is True
    assert DistillationLoss(Base(False), TeacherConfig(model_path="t")).entropy_grad is False
    assert DistillationLoss(Base(True), TeacherConfig(model_path="t", rl_coef=0.0)).entropy_grad is False
