"""``rollout.sampling.extra``: server parameters passed as they are (the real vLLM and SGLang
servers honour them: the server contract's ``test_extra_sampling_parameters_reach_the_server``).
Here: keys of the section itself are refused, the hf engine refuses any, an engine's own request
keys are refused when a request is built, and requests that differ only in them are not batched
together."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from core_rl.config.loader import structure
from core_rl.config.sampling import SamplingConfig
from core_rl.errors import ConfigError
from core_rl.interfaces import SamplingParams
from core_rl.interfaces.sampling import batch_key, with_extra


def test_keys_of_the_section_itself_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"rollout.sampling.extra: .*temperature: set by this section's own keys"):
        structure({"extra": {"temperature": 0.1, "ignore_eos": True}}, SamplingConfig, path="rollout.sampling")
    assert SamplingConfig(extra={"ignore_eos": True}).to_params().extra == {"ignore_eos": True}


def test_an_engines_own_request_keys_are_refused() -> None:
    sampling = SamplingParams(extra={"logprobs": 5, "ignore_eos": True})
    with pytest.raises(ValueError, match=r"the vllm engine sets logprobs itself"):
        with_extra({"logprobs": 0, "n": 1}, sampling, "vllm")
    assert with_extra({"n": 1}, SamplingParams(extra={"ignore_eos": True}), "vllm") == {"n": 1, "ignore_eos": True}
    # a key the engine sets only sometimes (its reserved ones) is refused even when absent from this request
    with pytest.raises(ValueError, match=r"the vllm engine sets model itself"):
        with_extra({"n": 1}, SamplingParams(extra={"model": "x"}), "vllm", reserved={"model"})


def test_an_engines_own_request_keys_are_refused_at_validate(tmp_path: Path, host, minimal_config: dict) -> None:
    """``max_tokens`` (vLLM's own) in ``extra`` is refused when the config loads, for the training
    and the evaluation sampling alike; a key the engine leaves alone passes."""
    pytest.importorskip("core_rl_vllm")
    from core_rl.config import load_config

    minimal_config["rollout"]["engine"] = {"name": "vllm"}
    minimal_config["rollout"]["sampling"] = {
        **minimal_config["rollout"].get("sampling", {}),
        "extra": {"max_tokens": 3},
    }
    minimal_config["eval"] = {"files": minimal_config["data"]["train_files"], "sampling": {"extra": {"detokenize": 1}}}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(minimal_config))
    with pytest.raises(ConfigError) as err:
        load_config(path, [], host=host)
    problems = [p for p in err.value.problems if "sampling.extra" in p]
    assert any(p.startswith("rollout.sampling.extra: max_tokens: rollout engine 'vllm'") for p in problems), problems
    assert any(p.startswith("eval.sampling.extra: detokenize: rollout engine 'vllm'") for p in problems), problems
    minimal_config["rollout"]["sampling"]["extra"] = {"ignore_eos": True}
    minimal_config["eval"]["sampling"]["extra"] = {}
    path.write_text(json.dumps(minimal_config))
    try:
        load_config(path, [], host=host)
    except ConfigError as exc:  # other problems of a vllm run on this machine may remain, none of extra
        assert not [p for p in exc.problems if "sampling.extra" in p], exc.problems


def test_evaluation_replaces_or_clears_the_runs_extra() -> None:
    from core_rl.config.eval_config import EvalSamplingConfig

    run = SamplingConfig(extra={"ignore_eos": True})
    assert structure({}, EvalSamplingConfig, path="eval.sampling").resolve(run).extra == {"ignore_eos": True}
    assert structure({"extra": {}}, EvalSamplingConfig, path="eval.sampling").resolve(run).extra == {}
    assert structure({"extra": {"seed": 1}}, EvalSamplingConfig, path="eval.sampling").resolve(run).extra == {"seed": 1}
    with pytest.raises(ConfigError, match=r"eval.sampling.extra: n: set by this section's own keys"):
        structure({"extra": {"n": 2}}, EvalSamplingConfig, path="eval.sampling")


def test_requests_with_other_extras_are_told_apart() -> None:
    a, b = SamplingParams(extra={"logit_bias": {"7": 1.0}}), SamplingParams(extra={"logit_bias": {"7": 2.0}})
    assert batch_key(a) != batch_key(b) and batch_key(a) == batch_key(attrs.evolve(a))
    # the key order of extra does not split a batch; every field counts
    assert batch_key(SamplingParams(extra={"a": 1, "b": 2})) == batch_key(SamplingParams(extra={"b": 2, "a": 1}))
    assert batch_key(SamplingParams(stop=["x"])) != batch_key(SamplingParams(stop=["y"]))
    assert len({hash(batch_key(s)) for s in (a, b, SamplingParams())}) == 3
    # YAML may give a logit bias int keys, mixed with text ones; nested values count
    mixed = SamplingParams(extra={"logit_bias": {7: 1.0, "8": 2.0}})
    assert batch_key(mixed) == batch_key(SamplingParams(extra={"logit_bias": {"8": 2.0, 7: 1.0}}))
    assert batch_key(mixed) != batch_key(SamplingParams(extra={"logit_bias": {7: 1.0, "8": 3.0}}))


def test_the_hf_engine_refuses_server_parameters(tmp_path: Path, host, minimal_config: dict) -> None:
    pytest.importorskip("core_rl_hf")
    from core_rl.config import load_config

    minimal_config["rollout"]["engine"] = {"name": "hf"}
    minimal_config["rollout"]["sampling"] = {
        **minimal_config["rollout"].get("sampling", {}),
        "extra": {"ignore_eos": True},
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(minimal_config))
    with pytest.raises(ConfigError) as err:
        load_config(path, [], host=host)
    assert any(
        "rollout.sampling.extra: ignore_eos: rollout engine 'hf' (core-rl-hf) does not pass server parameters on" in p
        for p in err.value.problems
    ), err.value.problems


def test_the_hf_engine_refuses_them_when_called(tmp_path: Path) -> None:
    """A direct caller of the hf engine (no config) gets one error naming them, not a silent ignore."""
    pytest.importorskip("core_rl_hf")
    from core_rl.testing.tiny import build_tiny_model
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(build_tiny_model(tmp_path / "model", seed=0), HFRolloutConfig(device="cpu"))
    try:
        with pytest.raises(ValueError, match=r"extra \(ignore_eos\) holds server parameters"):
            engine.generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=2, extra={"ignore_eos": True}))
    finally:
        engine.close()


def test_the_vllm_engines_reserved_keys_cover_what_it_sets() -> None:
    """Every key the vLLM engine puts in a request from ``rollout.sampling`` (stop strings and
    greedy choice included) is among the ``request_keys`` that ``config validate`` refuses in ``extra``."""
    pytest.importorskip("core_rl_vllm")
    from core_rl_vllm.config import VLLMConfig
    from core_rl_vllm.request_params import own_params

    guided = SamplingParams(response_format={"type": "json_object"})
    for sampling in (SamplingParams(stop=["x"]), SamplingParams(greedy=True), SamplingParams(), guided):
        assert set(own_params(sampling)) <= VLLMConfig.request_keys
