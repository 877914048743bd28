"""The contract of server-backed rollout engines (:class:`core_rl_server_kit.remote.ServerRolloutEngine`),
on top of :class:`~core_rl.testing.RolloutEngineContract`: real servers started from the plugin's
server environment, their logs in the run directory, connecting by URL, pausing with requests in
flight, a server killed mid-rollout (restarted, then reported by name once restarts are used up),
no process left behind when the trainer is killed with SIGKILL, and no CPU burnt while idle.

Subclass it in a server plugin's tests and set ``plugin``, ``name``, ``options`` (without
``server``: the managed environment is used, built on first use) and ``tiny_model_options``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from core_rl_server_kit.processes import ServerError, pid_alive

from core_rl.interfaces import SamplingParams
from core_rl.testing.processes import children_of, environment_of, idle_cpu, shared_anonymous_kib
from core_rl.testing.rollout_contracts import RolloutEngineContract

#: a forked engine process still shares more than this (KiB) of its server's heap: 185 MiB measured for
#: vLLM's engine core on CPU; a spawned one, 0
FORKED_SHARED_KIB = 16 * 1024


def next_settle(settle: float, versions: list[list[int]], old: int) -> float:
    """How long the next attempt to catch a request mid-generation waits after it is in flight,
    from this attempt's per-token ``versions`` (the weights were swapped from ``old`` to a newer
    version ``settle`` s after it was in flight): a third when every sample finished under ``old``
    (the swap came too late: a fast server), three times when no sample has a token of ``old`` (too
    early: a loaded machine's server had sampled nothing yet), else the same."""
    if all(set(v) == {old} for v in versions):
        return settle / 3
    if all(old not in v for v in versions):
        return settle * 3
    return settle


@pytest.mark.server_env  # the environment named by the subclass's ``name`` (see the repository's conftest.py)
class ServerRolloutEngineContract(RolloutEngineContract):
    """See the module docstring."""

    #: a request long enough to be caught in flight: ``long_prompts`` prompts, ``long_n`` samples
    #: each, ``long_tokens`` tokens each (the tiny model allows 256 positions)
    long_prompts: ClassVar[int] = 8
    long_n: ClassVar[int] = 4
    long_tokens: ClassVar[int] = 200
    #: the server forks its engine processes on CPU (``core_rl_server_kit.remote.engine.FORK_ENGINE``) rather than
    #: spawn them
    forks_on_cpu: ClassVar[bool] = False

    def make_with(self, model_path: Path, run_dir: Path, **server: Any):
        """An engine whose ``server`` section adds ``server`` to ``options``."""
        options = {**self.options, "server": {**self.options.get("server", {}), **server}}
        return self.make(model_path, run_dir, options)

    def _long(self) -> tuple[list[list[int]], SamplingParams]:
        prompts = [[1, 10 + i % 20, 11, 12] for i in range(self.long_prompts)]
        tokens = self.long_tokens
        return prompts, SamplingParams(n=self.long_n, max_new_tokens=tokens, min_new_tokens=tokens)

    def test_extra_sampling_parameters_reach_the_server(self, engine) -> None:
        """``rollout.sampling.extra`` goes to the server as it is: a logit bias of 100 on token 7
        makes every greedy token 7; a key the engine sets itself is refused, naming it."""
        biased = SamplingParams(n=1, max_new_tokens=4, greedy=True, extra={"logit_bias": {"7": 100.0}})
        for samples in engine.generate([[1, 10, 11, 12], [1, 13, 14]], biased):
            assert samples[0].response_ids == [7, 7, 7, 7]
        taken = SamplingParams(n=1, max_new_tokens=4, greedy=True, extra={"stop_token_ids": [3]})
        with pytest.raises(ValueError, match=r"rollout.sampling.extra: the \w+ engine sets stop_token_ids itself"):
            engine.generate([[1, 10, 11, 12]], taken)

    def test_server_logs_in_run_dir(self, engine) -> None:
        logs = engine.server_logs()
        assert logs, "a started server has a log"
        for name, path in logs.items():
            assert path.is_file() and path.stat().st_size > 0, name
            assert path.parent.name == "servers"

    def test_servers_write_the_bytecode_of_their_imports(self, engine) -> None:
        """A server's first start compiles what it imports into its environment for the starts
        after it, even where the trainer's environment sets ``PYTHONDONTWRITEBYTECODE``."""
        for ep in engine.endpoints:
            assert ep.server is not None and ep.server.pid is not None
            assert environment_of(ep.server.pid).get("PYTHONDONTWRITEBYTECODE", "") == ""

    def test_engine_processes_are_forked_on_cpu(self, engine) -> None:
        """With ``forks_on_cpu``: every process a CPU server starts is a fork of it, which shares
        the server's imported modules (copy-on-write pages) rather than import them again as a
        ``spawn`` child does (such a child shares no anonymous memory with anyone)."""
        if not self.forks_on_cpu:
            pytest.skip(f"{self.name} servers start their engine processes as the server does")
        if engine.variant() != "cpu":
            pytest.skip("the servers run on a GPU: their engine processes are spawned")
        for ep in engine.endpoints:
            assert ep.server is not None and ep.server.pid is not None
            children = children_of(ep.server.pid)
            assert children, f"server {ep.name} (pid {ep.server.pid}) has no child process"
            shared = {pid: shared_anonymous_kib(pid) for pid in children}
            assert all(kib > FORKED_SHARED_KIB for kib in shared.values()), shared

    def test_connect_by_url_leaves_the_server_running(self, engine, model_path: Path, tmp_path: Path) -> None:
        url = engine.endpoints[0].url
        client = self.make_with(model_path, tmp_path, urls=[url])
        try:
            assert client.server_logs() == {}
            out = client.generate(self.prompts, SamplingParams(n=2, max_new_tokens=4))
            assert [len(g) for g in out] == [2, 2]
        finally:
            client.close()
        assert all(engine.health().values()), "closing a client of a server it did not start stopped it"

    def _run_in_background(self, engine, prompts, sampling) -> tuple[threading.Thread, dict[str, Any]]:
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["out"] = engine.generate(prompts, sampling)
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread, result

    def _wait_in_flight(self, engine, timeout: float = 60.0, settle: float = 0.3) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(ep.inflight for ep in engine.endpoints) > 0:
                time.sleep(settle)  # let the server produce some tokens
                return
            time.sleep(0.02)
        raise AssertionError("no request got in flight")

    def test_pause_abort_continues_under_new_version(self, engine, model_path: Path) -> None:
        prompts, sampling = self._long()
        interrupted, settle = 0, 0.3
        for _attempt in range(5):
            old = engine.weight_version
            thread, result = self._run_in_background(engine, prompts, sampling)
            self._wait_in_flight(engine, settle=settle)
            engine.pause("abort")
            engine.load_weights_from_path(model_path, old + 1)  # same weights, new version
            engine.resume()
            thread.join(600)
            assert "error" not in result, result.get("error")
            out = result["out"]
            assert [len(g) for g in out] == [self.long_n] * len(prompts)
            for group in out:
                for s in group:
                    assert len(s.response_ids) == len(s.logprobs) == self.long_tokens
                    assert s.finish_reason == "length"
                    versions = s.versions
                    assert set(versions) <= {old, old + 1} and versions == sorted(versions), versions
                    interrupted += len(set(versions)) == 2
            if interrupted:
                break
            settle = next_settle(settle, [s.versions for group in out for s in group], old)
        assert interrupted, "no request was interrupted by pause('abort') in 5 attempts"

    def test_pause_keep_resumes_in_place(self, engine) -> None:
        prompts, sampling = self._long()
        thread, result = self._run_in_background(engine, prompts, sampling)
        self._wait_in_flight(engine)
        engine.pause("keep")
        assert engine.paused
        engine.resume()
        thread.join(600)
        assert "error" not in result, result.get("error")
        assert [len(g) for g in result["out"]] == [self.long_n] * len(prompts)
        assert all(len(s.response_ids) == self.long_tokens for g in result["out"] for s in g)

    def test_server_killed_mid_rollout_restarts_then_fails(self, model_path: Path, tmp_path: Path) -> None:
        engine = self.make_with(model_path, tmp_path, max_restarts=1, retry_backoff=0.2, max_retries=2)
        try:
            prompts, sampling = self._long()
            prompts = prompts * 2  # twice the usual work: the kill must land before the batch ends
            ep = engine.endpoints[0]
            for kill in (1, 2):
                thread, result = self._run_in_background(engine, prompts, sampling)
                # kill soon after the requests are sent: a warm server (after a restart, with the
                # prompts' prefixes cached) can finish the batch within a longer settling time
                self._wait_in_flight(engine, settle=0.05)
                assert thread.is_alive(), f"kill {kill}: the batch finished before the server was killed"
                assert ep.server is not None and ep.server.pid is not None
                os.kill(ep.server.pid, signal.SIGKILL)
                thread.join(900)
                if kill == 1:  # restarted; every prompt has exactly n samples
                    assert "error" not in result, result.get("error")
                    assert [len(g) for g in result["out"]] == [self.long_n] * len(prompts)
                    assert all(len(s.response_ids) == self.long_tokens for g in result["out"] for s in g)
                    assert ep.restarts == 1
                    assert all(engine.health().values())
                else:  # restarts used up: the error names the server and quotes its log
                    error = result.get("error")
                    assert isinstance(error, ServerError), error
                    assert ep.name in str(error) and str(ep.server.log_path) in str(error)
                    assert "last lines" in str(error)
        finally:
            engine.close()

    def test_no_orphans_after_trainer_sigkill(self, model_path: Path, tmp_path: Path) -> None:
        """A child process builds the engine (as a trainer would), reports its servers' pids, and
        is killed with SIGKILL; every server process must be gone soon after."""
        script = textwrap.dedent(
            f"""
            import json, sys, time
            from core_rl.config.loader import structure
            from core_rl.config.schema import PluginSpec, RolloutConfig
            from core_rl.plugins.host import PluginHost
            from core_rl.plugins.kinds import ROLLOUT_ENGINE
            from core_rl_server_kit.supervise import session_members

            entry = PluginHost().get(ROLLOUT_ENGINE, {self.name!r})
            options = json.loads({json.dumps(json.dumps(self.options))})
            engine = entry.factory(
                RolloutConfig(engine=PluginSpec(name={self.name!r})),
                structure(options, entry.config_cls),
                model_path={str(model_path)!r},
                run_dir={str(tmp_path)!r},
            )
            pids = []
            for ep in engine.endpoints:
                pids.append(ep.server._proc.pid)
                pids.extend(session_members(ep.server.pid))
            print(json.dumps(pids), flush=True)
            time.sleep(600)
            """
        )
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            assert line, "the trainer process exited before starting its servers"
            pids = json.loads(line)
            assert len(pids) >= 2 and all(pid_alive(p) for p in pids)
        finally:
            proc.kill()
            proc.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.2)
        left = [p for p in pids if pid_alive(p)]
        for pid in left:  # do not leave them to the next test
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left after the trainer was killed: {left}"

    #: most of a core an idle server may use (its processes' CPU time over ``idle_seconds``)
    idle_cores: ClassVar[float] = 0.2
    idle_seconds: ClassVar[float] = 2.0

    def test_an_idle_server_does_not_spin(self, engine) -> None:
        """Between requests a server waits for the next one instead of polling in a loop: on a
        machine the trainer shares, a spinning scheduler takes a core the trainer needs."""
        engine.generate([[1, 10, 11, 12]], SamplingParams(n=2, max_new_tokens=4))
        time.sleep(0.5)  # let the last request's follow-up work end
        for ep in engine.endpoints:
            used = idle_cpu(ep.server.pid, self.idle_seconds)
            assert used < self.idle_cores, f"{ep.name} used {used:.2f} cores while idle"

    def test_agenerate_in_asyncio_with_many_requests(self, engine) -> None:
        async def run() -> list:
            return await asyncio.gather(
                *(engine.agenerate([1, 10 + i % 20, 12], SamplingParams(n=2, max_new_tokens=3)) for i in range(40))
            )

        out = asyncio.run(run())
        assert len(out) == 40 and all(len(g) == 2 for g in out)

    #: the train engine whose log-probs the server's are compared with (skipped if not installed)
    train_engine_name: ClassVar[str] = "fsdp"

    def test_logprobs_match_the_train_engine(self, engine, model_path: Path) -> None:
        """Behaviour log-probs from the server vs the train engine's on the same tokens (float32
        train engine, the server in its configured dtype); prints the largest difference."""
        import torch

        from core_rl.config.loader import structure as structure_config
        from core_rl.config.schema import ActorConfig, PluginSpec
        from core_rl.errors import PluginError
        from core_rl.plugins.host import PluginHost
        from core_rl.plugins.kinds import TRAIN_ENGINE
        from core_rl.protocol import samples_to_batch

        try:
            entry = PluginHost().get(TRAIN_ENGINE, self.train_engine_name)
        except PluginError:
            pytest.skip(f"train engine {self.train_engine_name!r} is not installed")
        actor = ActorConfig(model_path=str(model_path), engine=PluginSpec(name=self.train_engine_name))
        config = None if entry.config_cls is None else structure_config({}, entry.config_cls)
        trainer = entry.factory(actor, config, trainable=False)
        try:
            temperature = 0.8
            out = engine.generate(
                [[1, 10 + i, 11, 12 + i] for i in range(8)],
                SamplingParams(n=4, max_new_tokens=16, temperature=temperature),
            )
            samples = [s for g in out for s in g]
            batch = samples_to_batch(samples, list(range(len(samples))), pad_token_id=0)
            ours = trainer.compute_logprobs(batch, temperature=temperature)
            mask = batch["response_mask"].bool()
            diff = (ours[mask] - batch["old_logprobs"][mask]).abs()
            print(
                f"{self.name}: |server - {self.train_engine_name}| log-prob over {int(mask.sum())} tokens: "
                f"max {diff.max().item():.2e}, mean {diff.mean().item():.2e}"
            )
            assert diff.max().item() <= self.logprob_atol, diff.max().item()
            assert torch.isfinite(ours[mask]).all()
        finally:
            trainer.close()
