"""The core conformance kit run against real SGLang servers started from the managed ``sglang``
server environment (built on first use: ``core-rl server-env create sglang``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, ClassVar

import core_rl_sglang.plugin
from core_rl.testing import ServerRolloutEngineContract, installed_distribution
from core_rl.testing.processes import environment_of
from core_rl_server_kit.supervise import LEFTOVERS_FILE, RUNTIME_DIR_VARIABLE


class TestSGLangRolloutEngine(ServerRolloutEngineContract):
    plugin = core_rl_sglang.plugin
    name = "sglang"
    distribution = installed_distribution("core-rl-sglang")
    # collective updates in requests of ~48 KiB: several per update of the tiny model
    options: ClassVar[dict[str, Any]] = {"dtype": "bfloat16", "max_running_requests": 64, "update_bucket_mb": 0.047}
    tiny_model_options: ClassVar[dict[str, Any]] = {"num_heads": 2}
    forks_on_cpu = True
    logprob_atol = 2e-2
    # SGLang's stop strings ignore min_new_tokens and match special tokens' text: the engine
    # leaves those cases to the rollout controller's cut (core_rl_sglang.engine)
    native_stops_with_min_new_tokens = False
    native_stops_in_special_token_text = False
    long_tokens = 60  # SGLang's torch-native attention on CPU is slow on long sequences
    # SGLang's penalizers: frequency and presence, then repetition on the response's tokens only;
    # its log-probs are log_softmax of the penalised logits (core_rl_sglang.engine)
    repetition_penalty_covers_prompt = False
    penalties_additive_first = True
    penalty_logprobs_penalised = True
    # the repetition penalty combined with frequency and presence: SGLang 0.5.23 on CPU matched
    # the reference (in its order) exactly in some server runs, in others its top log-probs
    # showed the repetition penalty left out for a repeated token at some steps (0.1 to 1.0 off;
    # cause not found: its compiled in-place scaling after the in-place additive penalties is a
    # suspect). Each penalty alone matches in every run.
    penalty_cases_unmatched: ClassVar[dict[str, str]] = {
        "all": "SGLang applies the repetition penalty inconsistently when frequency/presence are also set"
    }

    def test_the_load_report_in_dev_shm_goes_with_a_killed_server(self, model_path: Path, tmp_path: Path) -> None:
        """SGLang's scheduler reports its load through a file in ``/dev/shm``, one per start, that
        SGLang itself never removes. The server lists it in its runtime directory's
        ``remove-when-gone``, and its supervisor removes it once the server is gone, here killed
        outright (a stopped server also removes it itself)."""
        engine = self.make_with(model_path, tmp_path, max_restarts=0)
        try:
            server = engine.endpoints[0].server
            assert server is not None and server.pid is not None
            runtime = Path(environment_of(server.pid)[RUNTIME_DIR_VARIABLE])
            listed = (runtime / LEFTOVERS_FILE).read_text().split()
            (report,) = [Path(p) for p in listed if p.startswith("/dev/shm/sglang_loads_")]
            assert report.is_file()
            os.kill(server.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while report.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not report.exists() and not runtime.exists()
        finally:
            engine.close()
