"""A multi-turn verifiers (``verifiers.v1``) environment for the examples and tests: guess a digit.
The ``Env`` answers each guess with ``higher`` or ``lower`` until the guess is right or
``max_guesses`` are spent; the task's rewards score the trace: ``solved`` (1 when the last reply
is the digit), ``quick`` (weight 0.5: 1 / the number of guesses, when solved) and ``digits``
(weight 0.25: the share of the last reply's characters, spaces aside, that are digits: a signal a
tiny random model can learn from). Taskset id ``tiny-guess``."""

from collections.abc import Iterator

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: int = 0


class GuessTask(vf.Task[GuessData, vf.State]):
    @vf.reward
    async def solved(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == str(self.data.secret))

    @vf.reward(weight=0.5)
    async def quick(self, trace: vf.Trace) -> float:
        return 1.0 / max(1, trace.num_turns) if self.data.secret == _guess(trace.last_reply) else 0.0

    @vf.reward(weight=0.25)
    async def digits(self, trace: vf.Trace) -> float:
        chars = "".join(trace.last_reply.split())
        return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def _guess(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


class GuessConfig(vf.TasksetConfig):
    size: int = 8


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> Iterator[GuessTask]:
        for i in range(self.config.size):
            yield GuessTask(GuessData(prompt="Guess my digit:", secret=(i * 3) % 10), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    max_guesses: int = 3


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as game:
            segment = await game.turn()
            for _ in range(self.config.max_guesses - 1):
                guess = _guess(segment.last_reply)
                if guess == task.data.secret:
                    break
                hint = "higher" if guess is None or guess < task.data.secret else "lower"
                segment = await game.turn(hint)


__all__ = ["GuessConfig", "GuessData", "GuessEnv", "GuessEnvConfig", "GuessTask", "GuessTaskset"]
