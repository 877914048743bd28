"""The ``trainer.loop`` section of the ``rm`` loop (no torch import)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from core_rl.config.validators import each, in_range, non_negative, not_empty, positive

if TYPE_CHECKING:
    from core_rl.config.data_config import DataConfig
    from core_rl.data import PromptItem
    from core_rl.loops.supervised import TrainSequence


@attrs.define
class RMConfig:
    """See the package README.

    - ``chosen_key`` / ``rejected_key``: the data columns of the two responses (text or token ids;
      the prompt is ``data.prompt_key``, with the chat template when ``data.apply_chat_template``).
    - ``margin_key``: a column holding each pair's required score margin ``m`` (loss
      ``-log sigmoid(s_w - s_l - m)``); ``None``: no margin.
    - ``label_smoothing``: the assumed fraction of flipped labels, in [0, 0.5).
    - ``center_coef``: the coefficient of the score-centering term ``(s_w + s_l)^2`` (0: off).
    - ``val_files``: held-out pairs (same columns), scored every ``eval_every_n_steps`` steps (0: only
      after the last step) in chunks of ``eval_batch_size`` pairs.

    ``data.max_length`` bounds the chosen and the rejected row each, ``prompt + response`` plus the
    score slot (no EOS is added); it bounds ``val_files`` too.
    """

    rl_sections: ClassVar[bool] = False
    roles: ClassVar[tuple[str, ...]] = ()  # the role sections it reads

    chosen_key: str = attrs.field(default="chosen", validator=not_empty())
    rejected_key: str = attrs.field(default="rejected", validator=not_empty())
    margin_key: str | None = None
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5, high_open=True))
    center_coef: float = attrs.field(default=0.0, validator=in_range(0.0, 1e6))
    val_files: list[str] = attrs.field(factory=list, validator=each(not_empty()))
    eval_every_n_steps: int = attrs.field(default=0, validator=non_negative())
    eval_batch_size: int = attrs.field(default=64, validator=positive(1_048_576))

    def row_sequences(self, item: PromptItem, tokenizer: Any, data: DataConfig) -> list[TrainSequence]:
        """The prompt with the chosen response, then with the rejected one, each followed by the
        score slot (one token; no EOS: the score is read at the response's own last token)."""
        from core_rl.loops.supervised import pair_sequences

        return pair_sequences(item, tokenizer, (self.chosen_key, self.rejected_key), eos=False, suffix=1)
