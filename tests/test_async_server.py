"""Asynchronous rollout against one real vLLM server (started once for the module, from the
managed server environment): a request aborted mid-generation for a weight update continues under
the new weights with its per-token versions changing at the interruption point; a request kept in
place across a weight update carries, token by token, the version of the weights that sampled it
(the server's own labels, set within the one-request update); the rollout
controller keeps every sample within the staleness bound over several weight updates by disk;
and benchmarks/async.py runs end to end against the same server and prints its table."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import pytest
from core_rl.config.schema import ControllerConfig
from core_rl.interfaces import SamplingParams
from core_rl.rollout.controller import RolloutController
from core_rl.rollout.workflows import SingleTurnWorkflow
from core_rl.testing import preloaded
from core_rl.testing.server_contract import next_settle

pytest.importorskip("core_rl_vllm")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    bench = __import__("async")  # benchmarks/async.py (a module name that is a keyword)
finally:
    sys.path.remove(str(ROOT / "benchmarks"))

pytestmark = pytest.mark.server_env("vllm")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The vLLM engine on the benchmark's tiny model, and that model's directory."""
    work = tmp_path_factory.mktemp("async_server")
    model, _ = bench.build_task(work)
    engine = bench.start_server("vllm", model, work)
    yield engine, model
    engine.close()


def _update_mid_request(
    engine, sampling: SamplingParams, mode: str, path: Path, version: int, settle: float = 0.3
) -> list:
    """The samples of one request, during which (once it has some tokens: ``settle`` s after it is in
    flight) the engine pauses in ``mode`` and loads the weights at ``path`` as ``version``."""
    result: dict = {}

    def run(out: dict = result) -> None:
        out["samples"] = asyncio.run(engine.agenerate([1, 2, 3], sampling))

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 60
    while engine._inflight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(settle)  # some tokens generated
    engine.pause(mode)
    engine.load_weights_from_path(path, version)
    engine.resume()
    worker.join(300)
    return result["samples"]


def test_abort_mid_request_changes_version_at_the_interruption_point(server) -> None:
    engine, model = server
    engine.load_weights_from_path(model, 0)
    sampling = SamplingParams(n=2, max_new_tokens=48, min_new_tokens=48)
    settle = 0.3
    for _attempt in range(5):
        samples = _update_mid_request(engine, sampling, "abort", model, 1, settle)
        assert all(len(s.response_ids) == 48 and len(s.versions) == 48 for s in samples)
        for s in samples:  # versions only ever go up, from 0 to 1, at one point
            assert s.versions == sorted(s.versions) and set(s.versions) <= {0, 1}
        interrupted = [s for s in samples if s.versions[0] == 0 and s.versions[-1] == 1]
        if interrupted:  # tokens before the cut came from version 0, after it from version 1
            cut = interrupted[0].versions.index(1)
            assert 0 < cut < 48 and interrupted[0].weight_version == 0 and interrupted[0].newest_version == 1
            return
        settle = next_settle(settle, [s.versions for s in samples], 0)
    pytest.fail("no request was caught mid-generation in 5 attempts")


def _with_head(model: Path, out: Path, scale: float) -> None:
    """The tiny model with its output head scaled by ``scale``, saved to ``out``. Scale 0 gives
    every token the same logit: whatever such weights sample has the log-prob ``-log(k)`` (``k``
    the tokens the server may sample), whatever the cache of the earlier tokens held."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(scale)
    hf.save_pretrained(out)


def test_keep_update_labels_each_token_with_the_weights_that_sampled_it(server, tmp_path: Path) -> None:
    """pause("keep") + a weight update mid-request: the request goes on in place, and its tokens
    carry version 0 up to the swap and version 1 from the first token the new weights sampled.
    The log-probs prove where the swap happened: version 1 (a zero output head) gives every token
    it samples the same log-prob -log(k), version 0 (a sharpened head) does not."""
    import math

    engine, model = server
    _with_head(model, tmp_path / "sharp", 20.0)
    _with_head(model, tmp_path / "flat", 0.0)
    sampling = SamplingParams(n=2, max_new_tokens=200, min_new_tokens=200)  # the tiny model's 256 positions
    settle = 0.3
    for _attempt in range(5):
        engine.load_weights_from_path(tmp_path / "sharp", 0)
        samples = _update_mid_request(engine, sampling, "keep", tmp_path / "flat", 1, settle)
        assert all(len(s.response_ids) == 200 == len(s.versions) for s in samples)
        for s in samples:
            assert s.versions == sorted(s.versions) and set(s.versions) <= {0, 1}, s.versions
        interrupted = [s for s in samples if s.versions[0] == 0 and s.versions[-1] == 1]
        if interrupted:
            s = interrupted[0]
            cut = s.versions.index(1)
            uniform = s.logprobs[-1]  # sampled by version 1: -log(k) for a whole number k
            assert abs(math.exp(-uniform) - round(math.exp(-uniform))) < 1e-2, uniform
            flat = [abs(lp - uniform) < 1e-3 for lp in s.logprobs]
            assert all(flat[cut:]), f"a token labelled 1 was not sampled by version 1: {s.logprobs[cut:]}"
            assert not flat[cut - 1] and sum(flat[:cut]) <= cut // 10, s.logprobs[:cut]
            assert s.weight_version == 0 and s.newest_version == 1
            engine.load_weights_from_path(model, 0)
            return
        settle = next_settle(settle, [s.versions for s in samples], 0)
    engine.load_weights_from_path(model, 0)
    pytest.fail("no request was caught mid-generation in 5 attempts")


class Data:
    def __init__(self) -> None:
        self.position = 0

    def next_batch(self):
        class P:
            def __init__(self, i: int) -> None:
                self.index, self.prompt_ids = i, [1, 2 + i % 5, 3]

        out = [P(i) for i in range(self.position, self.position + 4)]
        self.position += 4
        return out

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state) -> None:
        self.position = state["position"]


@pytest.mark.parametrize("bound", [0, 2])
def test_controller_keeps_the_bound_through_a_server(server, bound) -> None:
    engine, model = server
    engine.load_weights_from_path(model, 0)
    cfg = ControllerConfig(max_head_offpolicyness=bound, pause_mode="abort")
    controller = RolloutController(
        engine, SingleTurnWorkflow(), Data(), SamplingParams(n=2, max_new_tokens=16), cfg, batch_size=4
    )
    controller.start()
    seen = []
    try:
        for step in range(1, 5):
            wave = controller.take(new_step=True)
            for prompt, group in zip(wave.prompts, wave.groups):
                seen.append(prompt.index)
                for sample in group:
                    assert step - 1 - min(sample.versions) <= bound
            controller.update_weights(lambda v=step: engine.load_weights_from_path(model, v), step)
    finally:
        controller.close()
    assert seen == list(range(16))


def test_benchmark_runs_against_the_server(server, tmp_path: Path) -> None:
    pytest.importorskip("core_rl_fsdp")
    engine, _ = server
    out = tmp_path / "figures.json"
    proc = preloaded.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "async.py"),
            *("--steps", "3", "--batch-size", "4", "--n", "2", "--max-new-tokens", "4", "--bound", "1"),
            *("--url", engine.endpoints[0].url, "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "wall time per step (s)" in proc.stdout and "speed-up sync/async" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["sync"]["steps"] == figures["async"]["steps"] == 3
    assert figures["sync"]["staleness_max"] == 0 and figures["async"]["staleness_max"] <= 1
    assert figures["speedup"] > 0
