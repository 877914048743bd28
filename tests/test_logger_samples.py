"""Sample logging in the built-in loggers, and the console logger as a progress bar with an ETA on
a terminal (a real pseudo-terminal)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import termios

from core_rl.builtin.loggers import ConsoleLogger, ConsoleLoggerConfig, JsonlLogger, JsonlLoggerConfig
from core_rl.interfaces import RunInfo, SampleRecord, sample_table

SAMPLES = [
    SampleRecord("abc=", "cba", 1.0, "stop", {"char_match": 1.0}),
    SampleRecord("ab=", "b", float("nan"), "length", {"format": 0.0}),
]


def test_jsonl_appends_samples_per_step(tmp_path):
    lg = JsonlLogger(JsonlLoggerConfig())
    lg.start(RunInfo(name="r", output_dir=tmp_path, config={}))
    lg.log_samples(SAMPLES, step=2)
    lg.log_samples(SAMPLES[:1], step=4)
    lg.close()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows == [
        {
            "step": 2,
            "prompt": "abc=",
            "response": "cba",
            "reward": 1.0,
            "finish_reason": "stop",
            "reward/char_match": 1.0,
        },
        {"step": 2, "prompt": "ab=", "response": "b", "reward": "nan", "finish_reason": "length", "reward/format": 0.0},
        {
            "step": 4,
            "prompt": "abc=",
            "response": "cba",
            "reward": 1.0,
            "finish_reason": "stop",
            "reward/char_match": 1.0,
        },
    ]


def test_a_record_shows_the_prompt_as_the_model_saw_it_after_the_prompt():
    record = SampleRecord("ab", "ba", 1.0, "stop", {"match": 1.0}, rendered_prompt="<s>u:ab>a:")
    assert list(record.as_row()) == ["prompt", "rendered_prompt", "response", "reward", "finish_reason", "reward/match"]
    assert record.as_row()["rendered_prompt"] == "<s>u:ab>a:"


def test_sample_records_decode_the_prompt_with_its_special_tokens():
    """The sample log's records: the prompt as the data holds it (what the reward read) and as the
    chat template rendered it for the model (its tokens decoded, special ones included)."""
    from core_rl.config.schema import SampleLogConfig
    from core_rl.loops.rl.reward_runner import ScoreResult
    from core_rl.loops.rl.sample_log import sample_records
    from core_rl.protocol import RewardInput
    from core_rl.rollout.chat_template import render_prompt
    from core_rl.testing.tiny import CHAT_TEMPLATE, build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    ids, _ = render_prompt(tokenizer, messages, {})
    item = RewardInput("ab", "ba", prompt_ids=ids, response_ids=[], row={}, finish_reason="stop")
    result = ScoreResult(scores=[1.0], failures=[])
    config = SampleLogConfig(every_n_steps=1, num_samples=1)
    [record] = sample_records([item], result, config, step=1, tokenizer=tokenizer)
    assert (record.prompt, record.rendered_prompt) == ("ab", "<s>s:be brief>u:ab>a:")


def test_sample_table_unions_the_parts():
    columns, rows = sample_table(SAMPLES)
    assert columns == ["prompt", "response", "reward", "finish_reason", "reward/char_match", "reward/format"]
    assert rows[0][-2:] == [1.0, None] and rows[1][-2:] == [None, 0.0]


def test_console_is_a_progress_bar_with_eta_on_a_terminal(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a 160-column terminal
    with os.fdopen(slave, "w", closefd=True) as terminal:
        lg = ConsoleLogger(ConsoleLoggerConfig(), stream=terminal)
        lg.start(RunInfo(name="demo", output_dir=tmp_path, config={"trainer": {"total_steps": 4}}))
        for step in (1, 2):
            lg.log({"reward/mean": 0.25 * step}, step)
        lg.close()
        terminal.flush()
        chunks = []
        while select.select([master], [], [], 1.0)[0]:
            chunks.append(os.read(master, 65536))
        screen = b"".join(chunks).decode()
    os.close(master)
    assert "demo:  50%" in screen and "2/4" in screen  # a bar over trainer.total_steps
    assert "<" in screen.split("2/4", 1)[1]  # [elapsed<remaining ...]: the ETA
    assert "reward=0.5" in screen
