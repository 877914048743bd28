"""A single-turn verifiers (``verifiers.v1``) taskset for the examples and tests: sums of two
digits; the reward is 1 when the reply's last word is the sum, else 0. Taskset id ``tiny-arith``
(this directory on the worker's ``PYTHONPATH``: the plugin's ``python_path``)."""

from collections.abc import Iterator

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: str = ""


class ArithTask(vf.Task[ArithData, vf.State]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        words = trace.last_reply.split()
        return float(bool(words) and words[-1] == self.data.answer)


class ArithConfig(vf.TasksetConfig):
    size: int = 8
    seed: int = 0


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> Iterator[ArithTask]:
        for i in range(self.config.size):
            a, b = (i * 7 + self.config.seed) % 10, (i * 3 + 1 + self.config.seed) % 10
            yield ArithTask(ArithData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["ArithConfig", "ArithData", "ArithTask", "ArithTaskset"]
