"""``data.max_length`` in the ``dpo`` loop, by hand with a one-token-a-character tokenizer: the
chosen and the rejected sequence are each bounded (``drop`` leaves the pair out whole when either is
too long), and ``truncate`` cuts each at the end, without EOS, the loss reading the kept tokens."""

from __future__ import annotations

from types import SimpleNamespace

from core_rl.config.data_config import DataConfig
from core_rl.data.prompts import PromptItem
from core_rl.loops.supervised.length_bound import bound_items
from core_rl.loops.supervised.loop import SupervisedLoop
from core_rl.loops.supervised.pairwise import PairwiseLoop
from core_rl.testing.tiny import build_char_tokenizer
from core_rl_dpo.config import DPOConfig
from core_rl_dpo.loop import DPOLoop

TOK = build_char_tokenizer("abcd=")
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def pair(prompt: str, chosen: str, rejected: str, line: int) -> PromptItem:
    row = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    return PromptItem(row=row, text=prompt, prompt_ids=ids(prompt), where=f"pairs.jsonl:{line}")


ITEMS = [pair("ab=", "ba", "dd", 1), pair("ab=", "ba", "dddd", 2), pair("ab=", "bbbb", "d", 3)]


def test_drop_leaves_out_a_pair_when_either_response_is_too_long():
    def sequences(item: PromptItem):
        return DPOConfig().row_sequences(item, TOK, DataConfig())

    # 3 + 2 + EOS = 6 tokens fit; 3 + 4 + EOS = 8 do not, chosen or rejected
    kept, problems = bound_items(ITEMS, sequences, DataConfig(max_length=6, truncation="drop"))
    assert [i.where for i in kept] == ["pairs.jsonl:1"] and problems == []
    _, problems = bound_items(ITEMS, sequences, DataConfig(max_length=6))
    assert problems[:2] == [
        "pairs.jsonl:2: 8 tokens > data.max_length=6",
        "pairs.jsonl:3: 8 tokens > data.max_length=6",
    ]


def test_truncate_cuts_chosen_and_rejected_each_at_the_end():
    data = DataConfig(max_length=6, truncation="truncate")
    loop = SimpleNamespace(loop_config=DPOConfig(), tokenizer=TOK, cfg=SimpleNamespace(data=data), pad_token_id=0)
    loop.sequences = lambda item: SupervisedLoop.sequences(loop, item)
    loop.pair_sequences = lambda items: PairwiseLoop.pair_sequences(loop, items)
    batch = DPOLoop.make_batch(loop, ITEMS)  # type: ignore[arg-type]
    prompt = ids("ab=")
    assert batch["input_ids"].tolist() == [
        prompt + ids("ba") + [EOS],
        prompt + ids("ba") + [EOS],
        prompt + ids("bbb"),  # chosen, cut: no EOS
        prompt + ids("dd") + [EOS],
        prompt + ids("ddd"),  # rejected, cut
        prompt + ids("d") + [EOS, 0],
    ]
    assert batch["loss_mask"].sum(1).tolist() == [3, 3, 3, 3, 3, 2]
    assert batch["loss_mask"][:, :3].sum() == 0
