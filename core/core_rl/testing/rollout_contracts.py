"""Contract test class of rollout engines (see :mod:`core_rl.testing`): built on a tiny model
offline (:class:`~core_rl.testing.engine_contracts.TinyModelMixin`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from core_rl.config.converter import structure
from core_rl.config.schema import PluginSpec, RolloutConfig
from core_rl.interfaces import RolloutEngine, SamplingParams
from core_rl.plugins.kinds import ROLLOUT_ENGINE
from core_rl.testing.contracts import ComponentContract
from core_rl.testing.engine_contracts import TinyModelMixin
from core_rl.testing.helpers import hf_logprobs, hf_next_token_logprobs
from core_rl.testing.multi_turn import MultiTurnEngineTests
from core_rl.testing.penalty_contracts import PenaltyEngineTests


class RolloutEngineContract(TinyModelMixin, MultiTurnEngineTests, PenaltyEngineTests, ComponentContract):
    """A rollout engine on a tiny model: counts, stop rules, greedy decoding, behaviour log-probs
    that agree with a transformers forward, repetition/frequency/presence penalties
    (:mod:`core_rl.testing.penalty_contracts`), the per-request API (``agenerate`` from any event loop
    and thread, ``pause``/``resume``, ``health``), and weight updates by every mode the engine
    declares in ``weight_sync_modes`` (``memory`` both whole and in buckets) that take effect and
    can be undone.

    ``options`` should make the engine compute in float32 so ``logprob_atol`` can stay tight.
    """

    kind = ROLLOUT_ENGINE
    logprob_atol: ClassVar[float] = 1e-3
    #: an engine with ``stop_strings = True`` stops at them itself with ``min_new_tokens`` too, and
    #: at a stop string that is part of a special token's text (``"a"`` of ``<pad>``)
    native_stops_with_min_new_tokens: ClassVar[bool] = True
    native_stops_in_special_token_text: ClassVar[bool] = True
    #: with ``min_p`` set, the engine reports the log-prob of the filtered, renormalised
    #: distribution (vLLM's, as it does for top-k/top-p) instead of ``log_softmax(logits / T)``
    min_p_logprobs_renormalised: ClassVar[bool] = False

    def make(
        self, model_path: Path, run_dir: Path | None = None, options: dict[str, Any] | None = None
    ) -> RolloutEngine:
        """Build the engine with ``options`` (default: the class's ``options``)."""
        import tempfile

        options = dict(self.options if options is None else options)
        entry = self.entry()
        config = None if entry.config_cls is None else structure(options, entry.config_cls, path=self.kind.key)
        rollout = RolloutConfig(engine=PluginSpec(name=self.name, options=options))
        run_dir = run_dir or Path(tempfile.mkdtemp(prefix="core-rl-rollout-"))
        engine = entry.factory(rollout, config, model_path=str(model_path), run_dir=run_dir)
        assert isinstance(engine, RolloutEngine)
        return engine

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, model_path: Path, tmp_path_factory: pytest.TempPathFactory):
        engine = cls().make(model_path, tmp_path_factory.mktemp("rollout-run"))
        yield engine
        engine.close()

    prompts: ClassVar[list[list[int]]] = [[1, 10, 11, 12], [1, 20, 21]]

    def test_counts_and_shapes(self, engine: RolloutEngine) -> None:
        out = engine.generate(self.prompts, SamplingParams(n=3, max_new_tokens=5))
        assert len(out) == len(self.prompts)
        for prompt, samples in zip(self.prompts, out):
            assert len(samples) == 3
            for s in samples:
                assert s.prompt_ids == prompt
                assert 1 <= len(s.response_ids) <= 5
                assert len(s.logprobs) == len(s.response_ids)
                assert all(lp <= 1e-6 for lp in s.logprobs)
                assert s.weight_version == engine.weight_version
                assert set(s.versions) <= {engine.weight_version}
                assert s.finish_reason in ("stop", "length")

    def test_stop_tokens_and_min_new_tokens(self, engine: RolloutEngine) -> None:
        stops = list(range(4, 40, 2))
        out = engine.generate(
            self.prompts, SamplingParams(n=4, max_new_tokens=8, min_new_tokens=3, stop_token_ids=stops)
        )
        for samples in out:
            for s in samples:
                assert len(s.response_ids) >= 3
                body = s.response_ids[3:-1] if s.finish_reason == "stop" else s.response_ids[3:]
                assert not any(t in stops for t in body), s.response_ids
                if s.finish_reason == "stop":
                    assert s.response_ids[-1] in stops or s.response_ids[-1] == 2
                else:
                    assert len(s.response_ids) == 8

    @pytest.mark.parametrize("min_new_tokens", [0, 2])
    @pytest.mark.parametrize("stops", [["e", "1", "o"], ["a", "e", "1"]], ids=["plain", "in-special"])
    def test_stop_strings_end_at_the_completing_token(
        self, engine: RolloutEngine, model_path: Path, min_new_tokens: int, stops: list[str]
    ) -> None:
        """The rollout controller cuts every engine's responses at ``sampling.stop``
        (:mod:`core_rl.rollout.stop_strings`), so an engine may stop later than the cut, never earlier: a
        response the engine ends with ``"stop"`` ends at its end-of-sequence token or where the cut
        would end it. An engine whose config class says ``stop_strings = True`` stops there
        itself, so the cut leaves its responses as they are (with ``min_new_tokens``, and with a
        stop string inside a special token's text, unless the contract class says otherwise)."""
        from transformers import AutoTokenizer

        from core_rl.rollout.stop_strings import apply_stop_strings, stop_cut

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        sampling = SamplingParams(n=8, max_new_tokens=12, min_new_tokens=min_new_tokens, stop=stops)
        out = engine.generate(self.prompts, sampling)

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        def cut(ids: list[int]) -> int | None:
            return stop_cut(ids, decode, stops, min_tokens=min_new_tokens)

        special = any(stop in text for stop in stops for text in tokenizer.all_special_tokens)
        native = bool(getattr(self.entry().config_cls, "stop_strings", False))
        native = native and (min_new_tokens == 0 or self.native_stops_with_min_new_tokens)
        native = native and (not special or self.native_stops_in_special_token_text)
        stopped = 0
        for samples in out:
            for got, want in zip(samples, apply_stop_strings(samples, decode, stops, min_new_tokens)):
                ids = got.response_ids
                assert len(ids) > min_new_tokens or got.finish_reason == "length", ids
                if got.finish_reason == "stop" and ids[-1] != tokenizer.eos_token_id:
                    assert cut(ids) == len(ids), f"stopped before the cut: {ids} {decode(ids)!r}"
                stopped += cut(want.response_ids) == len(want.response_ids)
                if native:  # the same tokens; a stop on the last allowed token may read "length"
                    assert ids == want.response_ids, (ids, decode(ids))
                    assert got.finish_reason == want.finish_reason or len(ids) == sampling.max_new_tokens
        assert stopped > 0  # the frequent stop strings ended some responses

    def test_greedy_is_argmax_and_top_k_one_matches(self, engine: RolloutEngine, model_path: Path) -> None:
        greedy = engine.generate(self.prompts, SamplingParams(n=2, max_new_tokens=6, greedy=True))
        topk1 = engine.generate(self.prompts, SamplingParams(n=1, max_new_tokens=6, top_k=1))
        for samples, k1 in zip(greedy, topk1):
            assert samples[0].response_ids == samples[1].response_ids == k1[0].response_ids

    def test_min_p_samples_only_tokens_near_the_most_likely(self, engine: RolloutEngine, model_path: Path) -> None:
        """``min_p`` 0.999 leaves the most likely token alone: greedy's tokens. ``min_p`` 0.8 at
        temperature 0.7: every sampled token's probability under the reference forward is at least
        0.8 times the most likely token's (to ``2 * logprob_atol`` in log space), which sampling
        that ignored ``min_p`` would have met with probability under 1%. The log-probs are
        ``log_softmax(logits / T)`` of the sampled tokens, or, where the contract class says the
        engine reports them so, that renormalised over the kept tokens (a token within the
        tolerance of the threshold may count as kept or not)."""
        greedy = engine.generate(self.prompts, SamplingParams(n=1, max_new_tokens=4, greedy=True))
        top = engine.generate(self.prompts, SamplingParams(n=2, max_new_tokens=4, min_p=0.999))
        for want, samples in zip(greedy, top):
            assert [s.response_ids for s in samples] == [want[0].response_ids] * 2
        min_p, temperature, tol = 0.8, 0.7, 2 * self.logprob_atol
        sampling = SamplingParams(n=2, max_new_tokens=4, temperature=temperature, min_p=min_p)
        chance = 0.0  # log-probability that sampling without min_p would have passed the check below
        for samples in engine.generate(self.prompts, sampling):
            for s in samples:
                ids = torch.tensor([s.prompt_ids + s.response_ids])
                dist = hf_next_token_logprobs(model_path, ids, torch.ones_like(ids), temperature)[0]
                dist = dist[len(s.prompt_ids) - 1 : -1]  # [R, V]: the distributions of the response tokens
                lp = dist.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
                floor = dist.amax(dim=-1, keepdim=True) + math.log(min_p)
                assert (lp[:, None] >= floor - tol).all(), (s.response_ids, (lp[:, None] - floor).tolist())
                chance += _kept_mass(dist, floor - tol).sum().item()
                got = torch.tensor(s.logprobs)
                if not self.min_p_logprobs_renormalised:
                    torch.testing.assert_close(got, lp, atol=self.logprob_atol, rtol=0)
                    continue
                low = lp - _kept_mass(dist, floor - tol) - self.logprob_atol
                high = lp - _kept_mass(dist, floor + tol) + self.logprob_atol
                assert ((low <= got) & (got <= high)).all(), (got.tolist(), low.tolist(), high.tolist())
        assert chance < math.log(0.01), f"min_p {min_p} filters too little here to be tested: {math.exp(chance)}"

    def test_logprobs_match_forward(self, engine: RolloutEngine, model_path: Path) -> None:
        out = engine.generate(self.prompts, SamplingParams(n=2, max_new_tokens=6, temperature=0.7))
        self._check_logprobs(out, model_path, 0.7)

    def _check_logprobs(self, out, model_path: Path, temperature: float, state_dict=None) -> None:
        for samples in out:
            for s in samples:
                ids = torch.tensor([s.prompt_ids + s.response_ids])
                ref = hf_logprobs(model_path, ids, torch.ones_like(ids), temperature, state_dict)[0]
                got = torch.tensor(s.logprobs)
                torch.testing.assert_close(got, ref[len(s.prompt_ids) :], atol=self.logprob_atol, rtol=0)

    # -- the per-request API ----------------------------------------------------------------------

    def test_agenerate_concurrent_requests(self, engine: RolloutEngine) -> None:
        import asyncio

        prompts = [[1, 10 + i, 11, 12 + i % 3] for i in range(6)]

        async def run() -> list:
            return await asyncio.gather(*(engine.agenerate(p, SamplingParams(n=2, max_new_tokens=4)) for p in prompts))

        out = asyncio.run(run())
        assert len(out) == len(prompts)
        for prompt, samples in zip(prompts, out):
            assert len(samples) == 2
            assert all(s.prompt_ids == prompt and 1 <= len(s.response_ids) <= 4 for s in samples)

    def test_agenerate_from_several_threads(self, engine: RolloutEngine) -> None:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        def one(prompt: list[int]) -> list:
            return asyncio.run(engine.agenerate(prompt, SamplingParams(n=1, max_new_tokens=3, greedy=True)))

        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(one, [self.prompts[0]] * 3))
        assert results[0][0].response_ids == results[1][0].response_ids == results[2][0].response_ids

    #: the schema of the guided-decoding contract: one key, two allowed values
    guided_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }

    def test_guided_decoding_samples_what_the_schema_accepts(
        self, engine: RolloutEngine, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """An engine claiming :attr:`~core_rl.interfaces.RolloutEngine.guided_decoding` samples, under
        a ``response_format``, only text the schema accepts (JSON without free whitespace, then EOS), on a tiny
        model whose vocabulary has JSON's characters; the same model sampling freely does not."""
        import json

        from transformers import AutoTokenizer

        from core_rl.testing.tiny import DEFAULT_ALPHABET, build_tiny_model

        if not engine.guided_decoding:
            pytest.skip(f"{type(engine).__name__} does not claim guided_decoding")
        options = {**self.tiny_model_options, "alphabet": DEFAULT_ALPHABET + '{}":,'}
        model = build_tiny_model(tmp_path_factory.mktemp("json") / "model", seed=0, **options)
        tokenizer = AutoTokenizer.from_pretrained(model)
        guided = self.make(model, tmp_path_factory.mktemp("json-run"))
        response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": self.guided_schema}}
        try:
            constrained, free = (
                guided.generate(self.prompts[:1], SamplingParams(n=4, max_new_tokens=40, response_format=form))[0]
                for form in (response_format, None)
            )
        finally:
            guided.close()
        # what the schema accepts, without free whitespace: compact (vLLM) or with json.dumps's
        # separators (SGLang)
        accepted = {json.dumps({"answer": a}, separators=sep) for a in ("yes", "no") for sep in ((",", ":"), None)}
        for s in constrained:
            assert s.finish_reason == "stop" and s.response_ids[-1] == tokenizer.eos_token_id, s.response_ids
            assert tokenizer.decode(s.response_ids, skip_special_tokens=True) in accepted
            assert all(math.isfinite(lp) and lp <= 1e-6 for lp in s.logprobs)
        free_texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in free]
        assert not all(text in accepted for text in free_texts), free_texts

    def test_pause_holds_requests_until_resume(self, engine: RolloutEngine) -> None:
        import asyncio

        async def run() -> tuple[bool, list]:
            engine.pause("wait")
            try:
                task = asyncio.ensure_future(engine.agenerate(self.prompts[0], SamplingParams(n=2, max_new_tokens=3)))
                await asyncio.sleep(1.0)
                held = not task.done()
            finally:
                engine.resume()
            return held, await asyncio.wait_for(task, 300)

        held, samples = asyncio.run(run())
        assert held, "a request submitted while paused finished before resume()"
        assert len(samples) == 2

    def test_health(self, engine: RolloutEngine) -> None:
        health = engine.health()
        assert health and all(health.values()), health

    def test_invalid_request_is_rejected(self, engine: RolloutEngine) -> None:
        import asyncio

        with pytest.raises(ValueError):
            asyncio.run(engine.agenerate([], SamplingParams(n=1, max_new_tokens=3)))

    # -- weights ----------------------------------------------------------------------------------

    def _push(self, engine: RolloutEngine, mode: str, state: dict[str, torch.Tensor], version: int, tmp: Path) -> None:
        if mode == "memory":
            engine.update_weights(state, version)
        elif mode == "buckets":  # what weight_sync: memory calls, with the weights in three buckets
            keys = list(state)
            engine.update_weights_from_buckets(({k: state[k] for k in keys[i::3]} for i in range(3)), version)
        elif mode == "disk":
            from safetensors.torch import save_file

            tmp.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
            for name in ("config.json", "generation_config.json"):
                src = Path(self._model_path) / name
                if src.is_file():
                    (tmp / name).write_bytes(src.read_bytes())
            engine.load_weights_from_path(tmp, version)
        else:
            engine.update_weights_collective(state, version)

    def test_update_weights_takes_effect(self, engine: RolloutEngine, model_path: Path, tmp_path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self._model_path = model_path
        original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
        torch.manual_seed(1)
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
        greedy = SamplingParams(n=1, max_new_tokens=5, greedy=True)
        before = engine.generate(self.prompts, greedy)
        version = engine.weight_version
        modes = type(engine).weight_sync_modes
        for i, mode in enumerate([*modes, "buckets"] if "memory" in modes else modes):
            version += 1
            self._push(engine, mode, new, version, tmp_path / f"new_{i}")
            assert engine.weight_version == version, mode
            out = engine.generate(self.prompts, SamplingParams(n=1, max_new_tokens=5))
            assert all(s.weight_version == version for samples in out for s in samples), mode
            self._check_logprobs(out, model_path, 1.0, state_dict=new)
            changed = engine.generate(self.prompts, greedy)
            assert [g[0].response_ids for g in changed] != [g[0].response_ids for g in before] or any(
                a[0].logprobs != b[0].logprobs for a, b in zip(changed, before)
            ), mode
            version += 1
            self._push(engine, mode, original, version, tmp_path / f"old_{i}")
            restored = engine.generate(self.prompts, greedy)
            assert [g[0].response_ids for g in restored] == [g[0].response_ids for g in before], mode
            out = engine.generate(self.prompts, SamplingParams(n=1, max_new_tokens=5))
            self._check_logprobs(out, model_path, 1.0)

    def test_state_dict_round_trips_through_a_checkpoint(self, engine: RolloutEngine, tmp_path: Path) -> None:
        """Whatever :meth:`RolloutEngine.state_dict` holds is a state tree a checkpoint can store,
        and loading it back is accepted."""
        from core_rl.checkpoint.files import load_tree, save_tree

        save_tree(tmp_path, "rollout", engine.state_dict())
        engine.load_state_dict(load_tree(tmp_path, "rollout"))


def _kept_mass(logprobs: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Per row of ``logprobs`` [R, V], the log of the probability of the tokens at or above
    ``floor`` [R, 1]: ``logsumexp`` over them."""
    return torch.logsumexp(logprobs.masked_fill(logprobs < floor, float("-inf")), dim=-1)
