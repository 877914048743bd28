"""The ``reward_model`` reward on a tiny sequence-classification model built offline: scores equal
a plain one-text-at-a-time forward (so batching and padding change nothing), transforms, label
choice, truncation keeps the response, and the model stays frozen."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import core_rl_reward_model.plugin
import pytest
import torch
from core_rl.config.loader import structure
from core_rl.errors import ConfigError, CoreRLError
from core_rl.protocol import RewardInput
from core_rl.testing import RewardContract, make_reward_input
from core_rl.testing.tiny import build_char_tokenizer
from core_rl_reward_model.config import RewardModelConfig
from core_rl_reward_model.reward import ModelReward

ITEMS = [
    make_reward_input("12", prompt="5+7="),
    make_reward_input("a much longer response", prompt="q: "),
    make_reward_input("", prompt="empty?"),
    make_reward_input("x", prompt=""),
]


def build_tiny_classifier(path: Path, num_labels: int = 1, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reference_scores(path: Path, texts: list[str], label: int = 0) -> list[float]:
    """One text at a time, no padding: the logit of ``label`` at the last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt")["input_ids"]
            out.append(float(model(input_ids=ids).logits[0, label]))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("rm") / "model")


@pytest.fixture(scope="module")
def two_label_dir(tmp_path_factory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("rm2") / "model", num_labels=2, seed=1)


def _reward(model_dir: Path, **options: Any) -> ModelReward:
    return ModelReward(structure({"model_path": str(model_dir), **options}, RewardModelConfig, path="reward"))


class TestRewardModelContract(RewardContract):
    plugin = core_rl_reward_model.plugin
    name = "reward_model"
    distribution = "core-rl-reward-model"
    options: ClassVar[dict[str, Any]] = {}
    examples: ClassVar[list[tuple[RewardInput, float]]] = []

    @pytest.fixture(autouse=True)
    def _model(self, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        expected = reference_scores(model_dir, [i.prompt_text + i.response_text for i in ITEMS])
        monkeypatch.setattr(type(self), "options", {"model_path": str(model_dir), "batch_size": 3})
        monkeypatch.setattr(type(self), "examples", list(zip(ITEMS, expected)))


def test_scores_do_not_depend_on_batching(model_dir):
    expected = reference_scores(model_dir, [i.prompt_text + i.response_text for i in ITEMS])
    for batch_size in (1, 2, 4):
        got = _reward(model_dir, batch_size=batch_size).score(ITEMS)
        assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(round(x, 4) for x in expected)) == len(expected)  # the texts do score differently


def test_template_label_and_sigmoid(two_label_dir):
    texts = [f"Q: {i.prompt_text}\nA: {i.response_text}" for i in ITEMS]
    expected = reference_scores(two_label_dir, texts, label=1)
    reward = _reward(two_label_dir, template="Q: {prompt}\nA: {response}", label_index=1, transform="sigmoid")
    got = reward.score(ITEMS)
    assert got == pytest.approx([float(torch.sigmoid(torch.tensor(x))) for x in expected], abs=1e-5)
    with pytest.raises(CoreRLError, match="label_index is 2 but .* has 2 label"):
        _reward(two_label_dir, label_index=2)


def test_long_texts_keep_their_end(model_dir):
    item = make_reward_input("the response at the end", prompt="a very long prompt " * 20)
    text = item.prompt_text + item.response_text
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    tail = AutoTokenizer.from_pretrained(model_dir).decode(ids[-31:])  # + the <s> the tokenizer adds = 32
    got = _reward(model_dir, max_length=32).score([item])
    assert got == pytest.approx(reference_scores(model_dir, [tail]), abs=1e-4)
    assert text.endswith(tail)


def test_frozen(model_dir):
    reward = _reward(model_dir)
    assert not reward.model.training
    assert not any(p.requires_grad for p in reward.model.parameters())
    before = {k: v.clone() for k, v in reward.model.state_dict().items()}
    reward.score(ITEMS)
    assert all(torch.equal(before[k], v) for k, v in reward.model.state_dict().items())


def test_errors(tmp_path):
    with pytest.raises(ConfigError, match="reward.model_path: required"):
        structure({}, RewardModelConfig, path="reward")
    with pytest.raises(ConfigError, match=r"reward.template: must contain \{response\}"):
        structure({"model_path": "x", "template": "{prompt}"}, RewardModelConfig, path="reward")
    with pytest.raises(CoreRLError, match="not a Hugging Face model directory"):
        _reward(tmp_path)


def test_a_model_with_its_own_code_needs_trust_remote_code(tmp_path: Path, model_dir: Path) -> None:
    """Before the run the directory is refused without the switch (one line naming it); with it the
    reward loads the model's own class and scores as the plain classifier with the same weights."""
    import shutil
    from types import SimpleNamespace

    from core_rl.testing.remote_code_model import make_remote_code

    remote = make_remote_code(shutil.copytree(model_dir, tmp_path / "remote_code_rm"))
    context = SimpleNamespace(key=lambda name: f"reward.{name}")
    refused = structure({"model_path": str(remote)}, RewardModelConfig, path="reward").check_environment(context)
    assert len(refused) == 1
    assert refused[0].startswith(f"reward.model_path: {str(remote)!r} ships its own modelling code")
    assert "set reward.trust_remote_code: true" in refused[0]
    reward = _reward(remote, trust_remote_code=True)
    assert reward.config.check_environment(context) == []
    assert type(reward.model).__name__ == "TinyRemoteForSequenceClassification"
    texts = reward.texts(ITEMS)
    assert reward.score(ITEMS) == pytest.approx(reference_scores(model_dir, texts), abs=1e-5)
