"""A rollout engine asleep while the trainer trains (``rollout.sleep_while_training``), for the
engines' tests: :func:`sleep_cycle`, what the synchronous trainer does with the engine between two
generations, and, on a GPU, :func:`check_sleep_round_trip`, the same check for every engine
(``test_gpu_sleep.py``): releasing frees at least half of the GPU memory the engine holds, taking
it back holds it again, and greedy generation afterwards gives the tokens it gave before."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: greedy prompts generated before the release and after the restore
PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12, 13]]
GIB = 2**30


def gpu_marks(server_env: str | None = None) -> list[Any]:
    """The marks of a GPU test (``gpu``, skipped without CUDA), of one needing the server
    environment ``server_env`` too where given."""
    import torch

    marks = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
    return marks + ([pytest.mark.server_env(server_env)] if server_env else [])


def free_gpu_bytes() -> int:
    """The current GPU's free memory, every process's use counted."""
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def failed_release_message(server: Any, engine_cls: type, config_cls: type, run_dir: Path) -> str:
    """The error an engine built with ``sleep=True`` on the recording ``server``
    (:class:`~core_rl.testing.recording_server.RecordingServer`, set up to refuse the release)
    raises from ``release_memory()``: a :class:`~core_rl_server_kit.remote.ServerReplyError`, as text."""
    from core_rl_server_kit.remote import ServerReplyError

    from core_rl.testing.recording_server import engine_on

    with engine_on(server, engine_cls, config_cls, run_dir, sleep=True) as engine:
        with pytest.raises(ServerReplyError) as caught:
            engine.release_memory()
    return str(caught.value)


def sleep_cycle(
    engine: Any, weights_path: str | Path, version: int, while_asleep: Callable[[], None] | None = None
) -> None:
    """Release ``engine``'s memory, call ``while_asleep`` (where the trainer trains), take back
    the weights, load ``weights_path`` as ``version``, take back the KV cache: the synchronous
    trainer's calls from one generation to the next (:mod:`core_rl.rollout.colocation`)."""
    engine.release_memory()
    if while_asleep is not None:
        while_asleep()
    engine.restore_memory(["weights"])
    engine.load_weights_from_path(weights_path, version)
    engine.restore_memory(["kv_cache"])


def check_sleep_round_trip(engine: Any, model_path: str | Path, held_bytes: float) -> None:
    """Generate, release, take back the weights, reload them from ``model_path`` as version 1,
    take back the KV cache and generate again (see the module doc); ``held_bytes``: the GPU
    memory the engine holds while awake (its configured share)."""
    from core_rl.interfaces import SamplingParams

    greedy = SamplingParams(n=2, max_new_tokens=16, greedy=True)
    before = engine.generate(PROMPTS, greedy)
    awake = free_gpu_bytes()
    freed: list[int] = []
    # the weights were dropped: the update brings them back
    sleep_cycle(engine, model_path, 1, while_asleep=lambda: freed.append(free_gpu_bytes()))
    (asleep,) = freed
    assert asleep - awake > 0.5 * held_bytes, f"the release freed {(asleep - awake) / GIB:.2f} GiB"
    assert asleep - free_gpu_bytes() > 0.5 * held_bytes, "the memory did not come back"
    after = engine.generate(PROMPTS, greedy)
    assert [[s.response_ids for s in g] for g in after] == [[s.response_ids for s in g] for g in before]
    assert all(s.weight_version == 1 for g in after for s in g)
