"""The ``tensorboard`` logger: conformance, and event files read back with TensorBoard's own
EventAccumulator (scalars at their steps, the samples table, the config)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import core_rl_tensorboard.plugin
from core_rl.interfaces import RunInfo, SampleRecord
from core_rl.testing import LoggerContract
from core_rl_tensorboard.logger import TensorboardLogger, markdown_table
from core_rl_tensorboard.plugin import TensorboardConfig
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


class TestTensorboardContract(LoggerContract):
    plugin = core_rl_tensorboard.plugin
    name = "tensorboard"
    distribution = "core-rl-tensorboard"
    options: ClassVar[dict[str, Any]] = {"flush_secs": 1}


def test_event_files_read_back(tmp_path):
    lg = TensorboardLogger(TensorboardConfig())
    lg.start(RunInfo(name="r", output_dir=tmp_path / "run", config={"reward": {"name": "combine"}}))
    for step in (1, 2, 3):
        lg.log({"reward/mean": step / 4, "actor/grad_norm": float("inf") if step == 2 else 1.0}, step)
    lg.log_samples([SampleRecord("abc=", "c|b\na", 0.5, "length", {"format": 0.0})], 3)
    lg.close()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert rewards == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert math.isinf(events.Scalars("actor/grad_norm")[1].value)
    texts = {tag: events.Tensors(tag) for tag in events.Tags()["tensors"]}
    (sample_event,) = [e for e in texts["samples/text_summary"]]
    text = sample_event.tensor_proto.string_val[0].decode()
    assert sample_event.step == 3
    assert text.splitlines()[0] == "| prompt | response | reward | finish_reason | reward/format |"
    assert "| abc= | c\\|b\\na | 0.5 | length | 0 |" in text
    assert "combine" in texts["config/text_summary"][0].tensor_proto.string_val[0].decode()


def test_markdown_table():
    assert markdown_table(["a", "b"], [[1.23456, None], ["x|y", "p\nq"]]) == (
        "| a | b |\n|---|---|\n| 1.235 |  |\n| x\\|y | p\\nq |"
    )
