"""``SamplingParams.response_format`` (guided decoding): the schema an engine enforces, requests
told apart by it, the vLLM engine's request, and the rollout controller refusing it for an engine
without ``guided_decoding``. The real servers sampling under it: the rollout contract's
``test_guided_decoding_samples_what_the_schema_accepts`` and the agent proxy's vLLM test."""

from __future__ import annotations

import asyncio

import pytest
from core_rl.interfaces import RolloutEngine, SamplingParams
from core_rl.interfaces.sampling import GuidedDecodingUnsupported, batch_key, required_json_schema
from core_rl.protocol import Sample

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}


def test_the_schema_to_enforce() -> None:
    assert required_json_schema({"type": "json_object"}) == {"type": "object"}
    assert required_json_schema({"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}) == SCHEMA
    for bad in ({"type": "json_schema", "json_schema": {"name": "a"}}, {"type": "regex"}, {}):
        with pytest.raises(ValueError, match="expected"):
            required_json_schema(bad)


def test_requests_under_other_formats_are_not_batched_together() -> None:
    free, json_object = SamplingParams(), SamplingParams(response_format={"type": "json_object"})
    schema = SamplingParams(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    assert len({batch_key(free), batch_key(json_object), batch_key(schema)}) == 3


def test_the_vllm_engine_asks_for_the_schema() -> None:
    pytest.importorskip("core_rl_vllm")
    from core_rl_vllm.request_params import own_params

    sampling = SamplingParams(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    assert own_params(sampling)["structured_outputs"] == {"json": SCHEMA}
    assert "structured_outputs" not in own_params(SamplingParams())


class _Echo(RolloutEngine):
    """Answers every prompt with one token; ``guided_decoding`` as the test sets it."""

    calls = 0

    @property
    def weight_version(self) -> int:
        return 0

    async def agenerate(self, prompt_ids, sampling):
        type(self).calls += 1
        return [Sample(list(prompt_ids), [5], [-0.1], 0, "length") for _ in range(sampling.n)]

    def update_weights(self, state_dict, version):  # pragma: no cover - not used
        pass

    def load_weights_from_path(self, path, version):  # pragma: no cover - not used
        pass


@pytest.mark.parametrize("claims", [False, True])
def test_the_controller_sends_a_format_only_to_an_engine_that_claims_guided_decoding(claims: bool) -> None:
    from core_rl.config.schema import ControllerConfig
    from core_rl.rollout.controller import RolloutController
    from core_rl.rollout.workflows import RolloutWorkflow

    guided = SamplingParams(n=1, max_new_tokens=1, response_format={"type": "json_object"})

    class AsksForJSON(RolloutWorkflow):
        async def run(self, prompt, ctx):
            return await ctx.generate(prompt.prompt_ids, guided)

    class Prompt:
        row, text, prompt_ids = {}, "", [1, 2]

    class Data:
        def next_batch(self):
            return [Prompt()]

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    engine = type("Guided" if claims else "Unguided", (_Echo,), {"guided_decoding": claims, "calls": 0})()
    controller = RolloutController(
        engine, AsksForJSON(), Data(), SamplingParams(), ControllerConfig(wait_timeout_s=60), batch_size=1
    )
    controller.start()
    try:
        if claims:
            (group,) = controller.take(new_step=True).groups
            assert group[0].response_ids == [5] and engine.calls == 1
        else:
            with pytest.raises(GuidedDecodingUnsupported, match=r"Unguided has no guided decoding.*vllm, sglang"):
                controller.take(new_step=True)
            assert engine.calls == 0  # refused before the engine saw it
    finally:
        controller.close()
    asyncio.set_event_loop(None)
