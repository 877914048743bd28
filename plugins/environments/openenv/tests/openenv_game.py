"""The example game's options, shared by this plugin's tests (a module of its own: test modules of
several plugins share names, so one is never imported from another)."""

from pathlib import Path

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
GAME = {
    "environment": "digit_game:DigitGame",
    "action": "digit_game:GuessAction",
    "observation": "digit_game:GuessObservation",
    "python_path": [EXAMPLES],
    "reset_keys": ["seed"],
    "observation_field": "text",
}
