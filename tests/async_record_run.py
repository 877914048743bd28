"""``python tests/async_record_run.py CONFIG RECORD``: train CONFIG in this process with a reward
``recording`` that appends the prompt of every item it scores to RECORD (one line each, written
before it returns), so a test can tell which prompts a run trained on, even after a SIGKILL."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
from core_rl.config import load_config
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Reward
from core_rl.loops import train
from core_rl.plugins.host import PluginHost


@attrs.define
class RecordingConfig:
    path: str = ""


class RecordingReward(Reward):
    """Char match against ``answer``; records each scored prompt."""

    def __init__(self, config: RecordingConfig) -> None:
        self.path = Path(config.path)

    def score(self, items):
        with self.path.open("a") as f:
            f.write("".join(item.row["prompt"] + "\n" for item in items))
        return [
            sum(a == b for a, b in zip(item.response_text, item.row["answer"])) / max(len(item.row["answer"]), 1)
            for item in items
        ]


class RecordingPlugin:
    @hookimpl
    def core_rl_register_rewards(self, register: Register) -> None:
        register("recording", RecordingReward, description="records scored prompts", config_cls=RecordingConfig)


def main(config: str, record: str) -> None:
    host = PluginHost(environ={})
    host.register_plugin(RecordingPlugin(), distribution="core-rl-test-recording", version="0")
    cfg = load_config(config, [f"reward.path={record}"], host=host)
    train(cfg, host=host)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
