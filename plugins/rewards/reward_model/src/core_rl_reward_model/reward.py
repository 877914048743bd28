"""The ``reward_model`` reward: a frozen Hugging Face sequence-classification model scores each
``template.format(prompt=..., response=...)``.

``score = transform(logits[label_index])`` with ``transform`` the identity or the sigmoid. Texts
longer than ``max_length`` tokens keep their *end* (the response). Batches of ``batch_size`` are
right-padded; the model reads the last real token of each row, so a score does not depend on the
batch it is in.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from core_rl.errors import CoreRLError
from core_rl.interfaces import Reward
from core_rl.protocol import RewardInput
from core_rl.roles.hf import no_progress_bars

from core_rl_reward_model.config import RewardModelConfig


class ModelReward(Reward):
    """See the module docstring. The model is loaded once, in eval mode, without gradients."""

    def __init__(self, config: RewardModelConfig) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.config = config
        path = Path(config.model_path)
        if not (path / "config.json").is_file():
            raise CoreRLError(
                f"reward 'reward_model': {path} is not a Hugging Face model directory (no config.json); "
                "set reward.model_path"
            )
        trust = config.trust_remote_code
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or path, trust_remote_code=trust)
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        with no_progress_bars():
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=getattr(torch, config.dtype), trust_remote_code=trust
            )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        labels = self.model.config.num_labels
        if config.label_index >= labels:
            raise CoreRLError(
                f"reward 'reward_model': reward.label_index is {config.label_index} but {path} has {labels} label(s)"
            )
        self.model.to(config.device).eval().requires_grad_(False)
        self._lock = threading.Lock()

    def texts(self, items: Sequence[RewardInput]) -> list[str]:
        return [self.config.template.format(prompt=i.prompt_text, response=i.response_text) for i in items]

    @torch.no_grad()
    def score(self, items: Sequence[RewardInput]) -> list[float]:
        cfg = self.config
        texts = self.texts(items)
        scores: list[float] = []
        with self._lock:
            for start in range(0, len(texts), cfg.batch_size):
                enc = self.tokenizer(
                    texts[start : start + cfg.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=cfg.max_length,
                ).to(cfg.device)
                logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
                values = logits[:, cfg.label_index].float()
                if cfg.transform == "sigmoid":
                    values = torch.sigmoid(values)
                scores.extend(values.tolist())
        return scores

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
