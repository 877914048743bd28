import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from core_rl_server_kit.worker import stop_workers

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module", autouse=True)
def workers_end_with_the_module() -> Iterator[None]:
    """The environment workers a module's tests started (``make_environment`` shares one per
    section, kept for the process's life) stop with the module, not with the pytest worker."""
    yield
    stop_workers()
