"""The proxy in front of a real vLLM server (CPU, the managed ``vllm`` server environment) instead
of the embedded ``hf`` engine: a two-turn session through the ``openai`` client is one trajectory
whose trained tokens are what the server sampled.

Sampling is greedy, so what the server samples for a prompt can be asked of it again directly
(its own ``/v1/completions``, the prompt as token ids) and compared with what the proxy recorded.
"""

from __future__ import annotations

import httpx
import pytest
from proxy_agents import LOG, tool_result

pytestmark = pytest.mark.server_env("vllm")  # the repository's conftest: built or skipped, files run last

ROWS = [{"prompt": "1+2", "reward": 0.5}, {"prompt": "4+4", "reward": 1.0}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from core_rl.testing.tiny import DEFAULT_ALPHABET, build_tiny_model

    # head size 32 (64 / 2 heads): the smallest vLLM's CPU attention runs; JSON's characters for
    # structured output
    alphabet = DEFAULT_ALPHABET + '{}":,'
    return build_tiny_model(tmp_path_factory.mktemp("proxy-vllm") / "model", seed=0, num_heads=2, alphabet=alphabet)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    pytest.importorskip("core_rl_vllm")
    from core_rl.testing.helpers import build_rollout_engine

    run_dir = tmp_path_factory.mktemp("run")
    engine = build_rollout_engine("vllm", {"dtype": "float32", "max_num_seqs": 8}, model, run_dir)
    yield engine
    engine.close()


def _server_greedy(url: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """The server's own greedy answer to ``prompt_ids`` (not through core-rl)."""
    body = {
        "model": "core-rl",
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    answer.raise_for_status()
    return answer.json()["choices"][0]


def test_a_two_turn_session_through_a_vllm_server_is_one_exact_trajectory(run_wave, engine, tokenizer) -> None:
    LOG.clear()
    wave, _ = run_wave(ROWS, n=2, program="proxy_agents:two_turns", sampling={"greedy": True})
    url = engine.endpoints[0].url
    for prompt, group in zip(wave.prompts, wave.groups):
        assert len(group) == 2
        for sample in group:
            assert sample.info["calls"] == 2 and sample.info["trajectories"] == 1
            assert sample.reward == prompt.row["reward"]
            first, second = (call["choices"][0] for call in LOG[sample.info["session"]])
            assert first["prompt_token_ids"] == sample.prompt_ids
            assert sample.prompt_ids == tokenizer.encode(f"<s>u:{prompt.row['prompt']}>a:", add_special_tokens=False)
            # the recorded ids and log-probs are the server's own for each prompt
            for call in (first, second):
                server = _server_greedy(url, call["prompt_token_ids"], max_tokens=5)
                assert call["token_ids"] == server["token_ids"]
                assert call["finish_reason"] == server["finish_reason"]
                content = [e["logprob"] for e in call["logprobs"]["content"]]
                assert content == pytest.approx(server["logprobs"]["token_logprobs"][: len(content)], abs=1e-3)
            # one trajectory: the first reply, the tool message (masked), the second reply
            glue = ("" if first["finish_reason"] == "stop" else "</s>") + f"t:{tool_result(prompt.row['prompt'])}>a:"
            inserted = tokenizer.encode(glue, add_special_tokens=False)
            sampled1, sampled2 = first["token_ids"], second["token_ids"]
            assert second["prompt_token_ids"] == sample.prompt_ids + sampled1 + inserted
            assert sample.response_ids == sampled1 + inserted + sampled2
            assert sample.token_mask == [1] * len(sampled1) + [0] * len(inserted) + [1] * len(sampled2)
            assert sample.logprobs[len(sampled1) : len(sampled1) + len(inserted)] == [0.0] * len(inserted)
            assert sample.versions == [0] * len(sample.response_ids)


def test_structured_output_is_guided_decoding_on_the_server_and_trains_as_sampled(run_wave, tokenizer) -> None:
    """``response_format`` (chat) and ``text.format`` (responses) reach vLLM's guided decoding: a
    random tiny model answers only what the schema accepts, and the trajectory holds exactly those
    tokens, sampled (log-probs of the constrained distribution) and trainable."""
    LOG.clear()
    wave, _ = run_wave(ROWS[:1], n=2, program="proxy_agents:structured_answers", max_new_tokens=40)
    (group,) = wave.groups
    for sample in group:
        (entry,) = LOG[sample.info["session"]]
        assert sample.reward == 1.0, entry  # both replies parsed as what the schema accepts
        assert entry["finish"] == "stop"
        sampled = [t for t, m in zip(sample.response_ids, sample.token_mask) if m]
        text = tokenizer.decode(sampled, skip_special_tokens=True)
        assert text == entry["chat"] + entry["responses"]
        assert all(lp <= 0.0 for lp in sample.logprobs) and any(lp < 0.0 for lp in sample.logprobs)
