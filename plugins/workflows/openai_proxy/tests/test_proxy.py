"""The ``openai_agent`` workflow and its proxy, over real HTTP with the real ``openai`` client,
in front of the real ``hf`` engine on a tiny model, through core-rl's rollout controller.

- the trained tokens are byte-identical to the sampled ids plus the inserted ids, across three
  turns with tool and user messages in between, and the inserted ids are the template's text,
  hand-written; the sampled tokens' log-probs are the engine's and equal a train-engine forward on
  the trajectory (importance ratio 1);
- 24 sessions at once keep to their own trajectories;
- history rewrites start a new trajectory (or are a 400), timeouts keep what was generated,
  client mistakes are OpenAI-style 4xx bodies and the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import ClassVar

import core_rl.builtin.tool_parsers
import httpx
import openai
import pytest
import torch
from core_rl.protocol import samples_to_batch
from core_rl.testing import WorkflowContract, installed_distribution
from core_rl_openai_proxy import plugin
from core_rl_server_kit.processes import pid_alive
from proxy_agents import LOG, TOOLS, client, tool_result

AGENTS = "proxy_agents"
ROWS = [{"prompt": f"{a}+{b}", "reward": (a + b) / 20} for a, b in ((1, 2), (9, 9), (4, 0), (7, 5), (3, 3), (0, 6))]


class TestOpenAIAgentContract(WorkflowContract):
    plugin = plugin
    name = "openai_agent"
    distribution = installed_distribution("core-rl-openai-proxy")
    options = {"program": f"{AGENTS}:no_call"}  # noqa: RUF012
    extra_plugins: ClassVar[list[object]] = [core_rl.builtin.tool_parsers]  # tool_parser: {name: hermes}


@pytest.fixture(scope="module")
def three_turn_wave(run_wave):
    """One wave of the three-turn agent: 6 rows x 4 sessions, all at once (request batching)."""
    LOG.clear()
    wave, _ = run_wave(ROWS, n=4, batching="request", program=f"{AGENTS}:three_turns")
    return wave, dict(LOG)


def test_tokens_are_the_sampled_and_inserted_ids(three_turn_wave, tokenizer) -> None:
    wave, log = three_turn_wave
    sessions = set()
    for prompt, group in zip(wave.prompts, wave.groups):
        assert len(group) == 4
        for sample in group:
            info = sample.info
            assert info["calls"] == 3 and info["trajectories"] == 1 and info["history_mismatches"] == 0
            # what the agent sent first, for rollout.dump (whose prompt_text is the data row's)
            assert info["request"] == {"messages": [{"role": "user", "content": prompt.row["prompt"]}], "tools": []}
            assert sample.reward == prompt.row["reward"]
            sessions.add(info["session"])
            calls = [c["choices"][0] for c in log[info["session"]]]
            # the first prompt: the template's text by hand
            assert sample.prompt_ids == tokenizer.encode(f"<s>u:{prompt.row['prompt']}>a:", add_special_tokens=False)
            assert calls[0]["prompt_token_ids"] == sample.prompt_ids
            follow = [f"t:{tool_result(prompt.row['prompt'])}>a:", "u:ok>a:"]
            want_ids, want_mask, want_lp = [], [], []
            for k, call in enumerate(calls):
                sampled = call["token_ids"]
                want_ids += sampled
                want_mask += [1] * len(sampled)
                content = [t["logprob"] for t in call["logprobs"]["content"]]
                assert content == pytest.approx(sample.logprobs[len(want_lp) : len(want_lp) + len(content)])
                want_lp += sample.logprobs[len(want_lp) : len(want_lp) + len(sampled)]
                if k < 2:  # the turn's end if the model did not sample it, then the next message
                    glue = ("" if call["finish_reason"] == "stop" else "</s>") + follow[k]
                    inserted = tokenizer.encode(glue, add_special_tokens=False)
                    want_ids += inserted
                    want_mask += [0] * len(inserted)
                    want_lp += [0.0] * len(inserted)
                    # the next call's prompt is exactly the trajectory so far: nothing re-tokenised
                    assert calls[k + 1]["prompt_token_ids"] == sample.prompt_ids + want_ids
            assert sample.response_ids == want_ids
            assert sample.token_mask == want_mask
            assert sample.logprobs == want_lp
            assert sample.versions == [0] * len(want_ids)
            assert sample.finish_reason == calls[-1]["finish_reason"]
    assert len(sessions) == 24 and set(log) == sessions  # every session its own trajectory


def test_behaviour_logprobs_equal_a_train_engine_forward(three_turn_wave, model) -> None:
    pytest.importorskip("core_rl_fsdp")
    from core_rl.config.loader import structure
    from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
    from core_rl.plugins.host import PluginHost
    from core_rl.plugins.kinds import TRAIN_ENGINE

    wave, _ = three_turn_wave
    samples = [s for group in wave.groups for s in group]
    batch = samples_to_batch(samples, list(range(len(samples))), pad_token_id=0)
    entry = PluginHost().get(TRAIN_ENGINE, "fsdp")
    actor = ActorConfig(
        model_path=str(model), engine=PluginSpec(name="fsdp"), optimizer=OptimizerConfig(name="sgd", lr=0.1)
    )
    train = entry.factory(actor, structure({"device": "cpu"}, entry.config_cls), trainable=False)
    recomputed = train.compute_logprobs(batch)
    on = batch["response_mask"].bool()
    assert on.sum() > 100 and (batch["response_mask"].sum(1) < batch["attention_mask"].sum(1)).all()
    ratio = torch.exp(recomputed[on] - batch["behave_logprobs"][on])
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4)


@pytest.mark.parametrize("mode", ["new_trajectory", "error"])
def test_a_rewritten_history_is_detected(run_wave, mode) -> None:
    LOG.clear()
    wave, _ = run_wave(ROWS[:2], n=2, program=f"{AGENTS}:rewrites_history", on_history_mismatch=mode)
    for group in wave.groups:
        sessions = {s.info["session"] for s in group}
        assert len(sessions) == 2
        for sample in group:
            assert sample.reward == 0.5  # posted to the proxy
        if mode == "new_trajectory":
            assert len(group) == 4  # two trajectories per session
            assert all(s.info["history_mismatches"] == 1 and s.info["trajectories"] == 2 for s in group)
            second = [s for s in group if s.info["trajectory"] == 1]
            assert all(s.token_mask == [1] * len(s.response_ids) for s in second)
        else:
            assert len(group) == 2 and all(s.info["calls"] == 1 for s in group)
    outcome = {e["second"] for entries in LOG.values() for e in entries}
    assert outcome == ({"ok"} if mode == "new_trajectory" else {"history_mismatch"})


def test_an_episode_past_its_timeout_keeps_its_calls(run_wave) -> None:
    # the timeout must cover the agent's first call (client, proxy, a generation) on a loaded machine
    wave, _ = run_wave(ROWS[:1], n=2, program=f"{AGENTS}:one_call_then_hangs", timeout_s=8.0, timeout_reward=-1.0)
    (group,) = wave.groups
    assert len(group) == 2
    assert all(s.info["timed_out"] and s.reward == -1.0 and s.info["calls"] == 1 for s in group)


def test_an_episode_without_a_call_fails_the_run_naming_the_program(run_wave) -> None:
    from core_rl_openai_proxy.workflow import AgentMadeNoCall

    with pytest.raises(AgentMadeNoCall, match=r"proxy_agents:no_call ended without a model call"):
        run_wave(ROWS[:1], n=1, program=f"{AGENTS}:no_call")


async def _client_mistakes(base_url: str, api_key: str, row: dict) -> float:
    """Each mistake gets an OpenAI-style 4xx body; a correct call afterwards still works."""
    c = client(base_url, api_key)
    user = [{"role": "user", "content": "1+1"}]
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}) as raw:
        bad_json = await raw.post("/chat/completions", content=b"{not json")
        bad_messages = await raw.post("/chat/completions", json={"messages": [{"role": "robot"}]})
        no_route = await raw.get("/embeddings")
        bad_key = await raw.post("/chat/completions", json={"messages": user}, headers={"Authorization": "Bearer x"})
        bad_prompt = await raw.post("/completions", json={"prompt": [1, 10**6]})
    errors, messages = {}, {}
    for name, call in {
        "model": c.chat.completions.create(model="gpt-4o", messages=user),
        "too_long": c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "9" * 200}]),
        "n": c.chat.completions.create(model="policy", messages=user, n=2),
        "stream": c.completions.create(model="policy", prompt="1+1", stream=True),
        "response_format": c.chat.completions.create(
            model="policy", messages=user, response_format={"type": "json_object"}
        ),
        "json_schema": c.responses.create(
            model="policy",
            input="1+1",
            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        ),
        "schemaless": c.chat.completions.create(
            model="policy", messages=user, response_format={"type": "json_schema", "json_schema": {"name": "x"}}
        ),
        "parallel_tool_calls": c.chat.completions.create(
            model="policy", messages=user, tools=TOOLS, parallel_tool_calls=False
        ),
        "previous_response_id": c.responses.create(model="policy", input="1", previous_response_id="resp_x"),
    }.items():
        try:
            await call
        except openai.APIStatusError as exc:
            errors[name] = (exc.status_code, exc.code)
            messages[name] = exc.message
    ok = await c.chat.completions.create(model="policy", messages=user, max_tokens=2)
    LOG[api_key] = [
        {
            "raw": [r.status_code for r in (bad_json, bad_messages, no_route, bad_key, bad_prompt)],
            "bodies": [set(r.json()["error"]) for r in (bad_json, bad_messages, no_route, bad_key, bad_prompt)],
            "errors": errors,
            "messages": messages,
            "ok": ok.usage.completion_tokens,
        }
    ]
    return 1.0


def test_client_mistakes_are_openai_errors_and_the_run_goes_on(run_wave, monkeypatch) -> None:
    import proxy_agents

    monkeypatch.setattr(proxy_agents, "client_mistakes", _client_mistakes, raising=False)
    LOG.clear()
    wave, _ = run_wave(ROWS[:1], n=1, program=f"{AGENTS}:client_mistakes")
    (entry,) = [e for entries in LOG.values() for e in entries]
    assert entry["raw"] == [400, 400, 404, 401, 400]
    assert all(body == {"message", "type", "param", "code"} for body in entry["bodies"])
    assert entry["errors"] == {
        "model": (404, "model_not_found"),
        "too_long": (400, "context_length_exceeded"),
        "n": (400, None),
        "stream": (400, None),
        "response_format": (400, "unsupported_parameter"),
        "json_schema": (400, "unsupported_parameter"),
        "schemaless": (400, "invalid_value"),
        "parallel_tool_calls": (400, "unsupported_parameter"),
        "previous_response_id": (404, "previous_response_not_found"),
    }
    # structured output needs guided decoding, which the hf engine does not do: the 400 names it
    # (the engine is built here by its class, in a run by its plugin: "rollout engine 'hf' (core-rl-hf)")
    assert "HFRolloutEngine has no guided decoding" in entry["messages"]["response_format"]
    assert "no guided decoding" in entry["messages"]["json_schema"]
    (group,) = wave.groups
    assert entry["ok"] in (1, 2) and group[0].info["calls"] == 1  # only the correct call was recorded


async def _completions(base_url: str, api_key: str, row: dict) -> float:
    """Legacy completions: a text prompt, then the same text plus the completion plus more."""
    c = client(base_url, api_key)
    first = await c.completions.create(model="policy", prompt="12+3=", max_tokens=3, logprobs=1)
    text = "12+3=" + first.choices[0].text + "ok"
    second = await c.completions.create(
        model="policy", prompt=text, max_tokens=3, extra_body={"return_token_ids": True}
    )
    LOG[api_key] = [first.model_dump(), second.model_dump()]
    return 0.0


def test_completions_continue_a_trajectory_by_text(run_wave, tokenizer, monkeypatch) -> None:
    import proxy_agents

    monkeypatch.setattr(proxy_agents, "completions", _completions, raising=False)
    LOG.clear()
    wave, _ = run_wave(ROWS[:1], n=1, program=f"{AGENTS}:completions")
    ((sample,),) = wave.groups
    first, second = LOG[sample.info["session"]]
    assert sample.prompt_ids == tokenizer.encode("12+3=")  # with <s>, as a completion prompt is encoded
    n = len(first["choices"][0]["logprobs"]["tokens"])
    assert first["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(sample.logprobs[:n])
    ok = tokenizer.encode("ok", add_special_tokens=False)
    head = len(sample.response_ids) - len(second["choices"][0]["token_ids"]) - len(ok)
    assert sample.response_ids[head : head + len(ok)] == ok and sample.token_mask[head : head + len(ok)] == [0, 0]
    assert second["choices"][0]["prompt_token_ids"] == sample.prompt_ids + sample.response_ids[: head + len(ok)]
    assert sample.info["trajectories"] == 1 and json.dumps(sample.info)
    assert sample.info["request"] == {"prompt": "12+3="}


def test_a_script_agent_posts_its_reward(run_wave, tokenizer) -> None:
    """The example's agent run as a script (a subprocess with OPENAI_BASE_URL/OPENAI_API_KEY/CORE_RL_ROW)."""
    script = Path(__file__).resolve().parents[4] / "examples" / "agent_proxy" / "agent.py"
    if not script.is_file():
        pytest.skip("the example is not in this checkout")
    rows = [{"prompt": "3+4", "answer": "7"}]
    wave, _ = run_wave(rows, n=2, program=str(script), max_new_tokens=3)
    (group,) = wave.groups
    sys.path.insert(0, str(script.parent))
    from proxy_task import score

    for sample in group:
        assert sample.info["calls"] == 2 and sample.reward is not None
        # the reward the script posted is the score of the answer it got (the second reply)
        cut = len(sample.response_ids) - sample.token_mask[::-1].index(0)
        reply = [t for t, m in zip(sample.response_ids[cut:], sample.token_mask[cut:]) if m]
        answer = tokenizer.decode(reply, skip_special_tokens=True)
        assert sample.reward == pytest.approx(score(answer, "7"))


def test_a_hanging_script_is_killed_at_the_timeout(run_wave, tmp_path) -> None:
    """A script past ``timeout_s`` is killed (its process group); having made no call, its episode
    fails the run with a message naming the program and the timeout."""
    from core_rl_openai_proxy.workflow import AgentMadeNoCall

    script = Path(__file__).resolve().parent / "hanging_agent.py"
    with pytest.raises(AgentMadeNoCall, match=r"hanging_agent.py timed out after 8 s .*rollout.workflow.timeout_s"):
        run_wave(ROWS[:1], n=2, program=str(script), args=[str(tmp_path)], timeout_s=8.0)
    pids = [int(p.read_text()) for p in tmp_path.glob("[!.]*")]
    assert len(pids) == 2
    assert [pid for pid in pids if pid_alive(pid)] == []


def test_a_script_cancelled_twice_is_reaped_before_its_episode_ends(tmp_path) -> None:
    """An episode's timeout and the run stopping its siblings can both cancel a script's episode:
    the second cancellation, arriving while the killed script is being reaped, must not end the
    episode before the script's process is gone."""
    from core_rl_openai_proxy.program import AgentProgram

    program = AgentProgram(str(Path(__file__).resolve().parent / "hanging_agent.py"), [str(tmp_path)])

    async def episode() -> int:
        task = asyncio.ensure_future(program.run("http://127.0.0.1:9", "episode-key", {}))
        for _ in range(500):
            if (tmp_path / "episode-key").exists():
                break
            await asyncio.sleep(0.02)
        task.cancel()
        for _ in range(3):  # the task is now waiting for the killed script to be reaped
            await asyncio.sleep(0)
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError), outcome
        return int((tmp_path / "episode-key").read_text())

    assert not pid_alive(asyncio.run(episode()))


def test_a_requests_penalties_are_accepted_and_the_runs_sample(run_wave) -> None:
    """A request's ``frequency_penalty``, ``presence_penalty`` and ``repetition_penalty`` are
    accepted (no error) and ignored: the run's ``rollout.sampling`` (greedy with a presence penalty
    of 2) samples, so no turn repeats a token; without it the same greedy turns do."""
    repeats = {}
    for presence in (2.0, 0.0):
        LOG.clear()
        wave, _ = run_wave(
            ROWS[:3],
            n=1,
            max_new_tokens=10,
            program=f"{AGENTS}:asks_for_repeats",
            sampling={"greedy": True, "min_new_tokens": 10, "presence_penalty": presence},
        )
        turns = [LOG[s.info["session"]][0]["choices"][0]["token_ids"] for group in wave.groups for s in group]
        assert len(turns) == 3 and all(len(t) == 10 for t in turns)
        repeats[presence] = sum(len(t) - len(set(t)) for t in turns)
    assert repeats == {2.0: 0, 0.0: repeats[0.0]} and repeats[0.0] > 0, repeats
