"""A small OpenEnv text game for the examples and tests: guess a digit. ``reset(seed=...)`` picks
the secret (``seed % 10``); each ``step(GuessAction(message=...))`` answers ``higher``, ``lower``
or ``correct``; a right guess earns reward 1 and ends the episode, as do ``max_guesses`` wrong ones;
a wrong guess that is one digit earns 0.1 (a signal a tiny random model can learn from), any other
text 0. Served by openenv-core's own app factory (the plugin's ``environment:
digit_game:DigitGame``, this directory on ``python_path``)."""

from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    message: str = Field(..., description="the guess: one digit")


class GuessObservation(Observation):
    text: str = Field(default="", description="what the game says")


class DigitGame(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True
    max_guesses = 3

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.secret = (seed or 0) % 10
        return GuessObservation(text="Guess my digit (0-9):", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        guess = action.message.strip()
        if guess == str(self.secret):
            return GuessObservation(text="correct", done=True, reward=1.0)
        out_of_guesses = self._state.step_count >= self.max_guesses
        hint = "higher" if not guess.isdigit() or int(guess) < self.secret else "lower"
        well_formed = len(guess) == 1 and guess.isdigit()
        return GuessObservation(text=hint, done=out_of_guesses, reward=0.1 if well_formed else 0.0)

    @property
    def state(self) -> State:
        return self._state
