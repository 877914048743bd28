"""Fixtures of the megatron engine's tests: the test-only CPU shim and the tiny model."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # mcore_cpu_shim and mcore_common

torch.set_num_threads(1)

with warnings.catch_warnings():  # megatron-core warns at import that Apex / Transformer Engine are absent
    warnings.simplefilter("ignore")
    try:
        import megatron.core.distributed
        import megatron.core.models.gpt
        import megatron.core.optimizer  # noqa: F401
    except ImportError:  # an install without it: the root conftest skips these tests with the reason
        pass

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """megatron-core warns at import that Apex / Transformer Engine are absent (expected on CPU) and
    about its own deprecations: not ours to act on."""
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.filterwarnings("ignore:.*(Apex|Transformer Engine).*not installed"))
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"))
            item.add_marker(pytest.mark.filterwarnings("ignore::UserWarning:megatron"))


@pytest.fixture(autouse=True, scope="module")
def cpu_shim() -> Iterator[None]:
    """megatron-core's few CUDA calls pointed at CPU equivalents (see ``mcore_cpu_shim.py``), for the
    tests of one module; without CUDA only (a GPU runs the real thing)."""
    if torch.cuda.is_available():
        yield
        return
    import mcore_cpu_shim as cpu_shim

    with cpu_shim.installed():
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Llama with its char tokenizer (see ``core_rl.testing.tiny``)."""
    from core_rl.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def fsdp_critic(tiny_model: Path) -> dict:
    """The reference critic: the ``fsdp`` engine with a value head (one rank) on
    ``mcore_common.value_batches``: values before and after 3 value steps, their metrics, the final
    weights."""
    pytest.importorskip("core_rl_fsdp")
    import mcore_common as common
    from core_rl_fsdp.engine import FSDPEngine

    return common.critic_run(FSDPEngine(common.actor(str(tiny_model), "fsdp"), head="value"))


@pytest.fixture(scope="session")
def fsdp_critic_cpu(tiny_model: Path, request: pytest.FixtureRequest) -> dict:
    """:func:`fsdp_critic` on the CPU, for the tests of CPU ranks (the same fixture on a CPU machine)."""
    if not torch.cuda.is_available():
        return request.getfixturevalue("fsdp_critic")
    pytest.importorskip("core_rl_fsdp")
    import mcore_common as common
    from core_rl_fsdp.config import FSDPConfig
    from core_rl_fsdp.engine import FSDPEngine

    engine = FSDPEngine(common.actor(str(tiny_model), "fsdp"), FSDPConfig(device="cpu"), head="value")
    return common.critic_run(engine)
