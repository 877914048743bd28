"""Stop strings through the proxy (a request's ``stop``, as ReAct-style agents send): the turn ends
at the token completing one, that token stays in the trajectory, the returned text ends before the
stop string, and the next call's prompt is still exactly the trajectory so far; bad ``stop`` values
are 400s."""

from __future__ import annotations

import openai
from proxy_agents import LOG, client

AGENTS = "proxy_agents"
ROWS = [{"prompt": f"{a}+{b}", "reward": 0.0} for a, b in ((1, 2), (9, 9), (4, 0), (7, 5))]
#: frequent characters of the tiny model's random text, so that most turns end on one
STOPS = ["a", "e", "i", "o"]


async def _react(base_url: str, api_key: str, row: dict) -> float:
    """Two chat turns with stop strings, the returned reply sent back, then an observation."""
    c = client(base_url, api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    for follow_up in ({"role": "user", "content": "ok"}, None):
        response = await c.chat.completions.create(
            model="policy", messages=messages, max_tokens=12, stop=STOPS, logprobs=True,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        LOG.setdefault(api_key, []).append(response.model_dump())
        if follow_up is None:
            return 0.0
        messages += [response.choices[0].message.model_dump(exclude_none=True), follow_up]
    return 0.0


def test_chat_turns_end_at_stop_strings_and_the_trajectory_is_exact(run_wave, tokenizer, monkeypatch) -> None:
    import proxy_agents

    monkeypatch.setattr(proxy_agents, "react", _react, raising=False)
    LOG.clear()
    wave, _ = run_wave(ROWS, n=3, batching="request", max_new_tokens=12, program=f"{AGENTS}:react")
    by_string = 0
    for group in wave.groups:
        for sample in group:
            assert sample.info["trajectories"] == 1 and sample.info["history_mismatches"] == 0
            first, second = (call["choices"][0] for call in LOG[sample.info["session"]])
            for call in (first, second):
                text = tokenizer.decode(call["token_ids"], skip_special_tokens=True)
                content = call["message"]["content"]
                if call["finish_reason"] == "stop" and call["token_ids"][-1] != tokenizer.eos_token_id:
                    by_string += 1
                    # the last sampled token completes a stop string; the reply is the text before it
                    cut = min(i for i in (text.find(s) for s in STOPS) if i >= 0)
                    assert content == text[:cut] and not any(s in content for s in STOPS)
                    assert call["stop_reason"] == text[cut]  # one-character stop strings
                    assert any(text.endswith(s) for s in STOPS)
                    assert len(call["logprobs"]["content"]) == len(call["token_ids"])
                else:
                    assert not any(s in content for s in STOPS) and call["stop_reason"] is None
            # the second prompt: the first prompt, every sampled id, then the end of the turn the model
            # did not sample and the new message (no stop string is re-tokenised or dropped)
            ended = first["token_ids"][-1] == tokenizer.eos_token_id
            glue = tokenizer.encode(("" if ended else "</s>") + "u:ok>a:", add_special_tokens=False)
            assert second["prompt_token_ids"] == first["prompt_token_ids"] + first["token_ids"] + glue
            assert sample.response_ids == first["token_ids"] + glue + second["token_ids"]
    assert by_string >= 4  # most of the 24 turns end on a stop string


async def _completion_stops(base_url: str, api_key: str, row: dict) -> float:
    """A completion with stop strings, continued by a prompt that appends the stop string itself
    (as ReAct clients append "Observation:" after the text that stopped on it)."""
    c = client(base_url, api_key)
    first = await c.completions.create(model="policy", prompt="12+3=", max_tokens=12, stop=STOPS)
    choice = first.model_dump()["choices"][0]
    LOG[api_key] = [first.model_dump()]
    await c.completions.create(
        model="policy", prompt="12+3=" + choice["text"] + (choice["stop_reason"] or "") + "ok", max_tokens=2
    )
    return 0.0


def test_a_bad_stop_is_a_400(run_wave, monkeypatch) -> None:
    import proxy_agents

    async def bad_stops(base_url: str, api_key: str, row: dict) -> float:
        c = client(base_url, api_key)
        codes = []
        for stop in ([], [""], ["a"] * 5, 3):
            try:
                await c.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "1+1"}], max_tokens=2, stop=stop
                )
            except openai.BadRequestError as exc:
                codes.append((exc.status_code, exc.body.get("param")))
        await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+1"}], max_tokens=2)
        LOG[api_key] = codes
        return 0.0

    monkeypatch.setattr(proxy_agents, "bad_stops", bad_stops, raising=False)
    LOG.clear()
    run_wave(ROWS[:1], n=1, program=f"{AGENTS}:bad_stops")
    (codes,) = LOG.values()
    assert codes == [(400, "stop")] * 4


def test_completions_stop_and_continue(run_wave, tokenizer, monkeypatch) -> None:
    import proxy_agents

    monkeypatch.setattr(proxy_agents, "completion_stops", _completion_stops, raising=False)
    LOG.clear()
    wave, _ = run_wave(ROWS[:1], n=4, program=f"{AGENTS}:completion_stops")
    for sample in wave.groups[0]:
        (first,) = LOG[sample.info["session"]]
        choice = first["choices"][0]
        assert not any(s in choice["text"] for s in STOPS)
        # the client appended the stop string the proxy named: the trajectory goes on
        assert sample.info["trajectories"] == 1 and sample.info["history_mismatches"] == 0
