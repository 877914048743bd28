"""``data.max_length`` in the ``rm`` loop, by hand with a one-token-a-character tokenizer: the score
slot after each response counts as a token, no EOS is added, and ``truncate`` reads the score at the
last kept response token."""

from __future__ import annotations

from types import SimpleNamespace

from core_rl.config.data_config import DataConfig
from core_rl.data.prompts import PromptItem
from core_rl.loops.supervised.length_bound import bound_items
from core_rl.loops.supervised.loop import SupervisedLoop
from core_rl.loops.supervised.pairwise import PairwiseLoop
from core_rl.testing.tiny import build_char_tokenizer
from core_rl_rm.config import RMConfig
from core_rl_rm.loop import RMLoop

TOK = build_char_tokenizer("abcd=")


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def test_the_score_slot_counts_and_truncate_scores_the_last_kept_token():
    row = {"prompt": "ab=", "chosen": "ba", "rejected": "dddd"}
    item = PromptItem(row=row, text="ab=", prompt_ids=ids("ab="), where="pairs.jsonl:1")

    def sequences(item: PromptItem):
        return RMConfig().row_sequences(item, TOK, DataConfig())

    # chosen: 3 + 2 + slot = 6 tokens; rejected: 3 + 4 + slot = 8
    assert bound_items([item], sequences, DataConfig(max_length=8)) == ([item], [])
    assert (
        bound_items([item], sequences, DataConfig(max_length=7))[1][0] == "pairs.jsonl:1: 8 tokens > data.max_length=7"
    )
    data = DataConfig(max_length=6, truncation="truncate")
    loop = SimpleNamespace(loop_config=RMConfig(), tokenizer=TOK, cfg=SimpleNamespace(data=data), pad_token_id=0)
    loop.sequences = lambda item: SupervisedLoop.sequences(loop, item)
    loop.pair_sequences = lambda items: PairwiseLoop.pair_sequences(loop, items)
    loop.margin = lambda item: 0.0
    batch = RMLoop.make_batch(loop, [item])  # type: ignore[arg-type]
    prompt = ids("ab=")
    assert batch["input_ids"].tolist() == [prompt + ids("ba") + [0], prompt + ids("dd") + [0]]
    assert batch["score_mask"].tolist() == [[0, 0, 0, 0, 0, 1]] * 2
