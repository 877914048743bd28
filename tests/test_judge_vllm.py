"""The ``judge`` reward with a real vLLM server (CPU, the managed ``vllm`` server environment) as the
judge: a scripted tiny model (:mod:`core_rl.testing.scripted_model`) whose chat template ends the
prompt on ``:`` and whose weights answer that with ``Score: 7``, through vLLM's own
``/v1/chat/completions``. The reward parses and scales it; a judge asked for too few tokens to
write the score counts the reply as unparsed."""

from __future__ import annotations

import math

import pytest
from core_rl.config.loader import structure
from core_rl.testing import make_reward_input

pytestmark = pytest.mark.server_env("vllm")  # the repository's conftest: built or skipped, files run last

#: renders every message as "<role initial>:<content>>", then the generation prompt "a:"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}>{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("core_rl_vllm")
    from core_rl.testing.helpers import build_rollout_engine
    from core_rl.testing.scripted_model import build_scripted_model

    root = tmp_path_factory.mktemp("judge")
    model = build_scripted_model(root / "model", {":": ["Score: 7"]}, chat_template=TEMPLATE)
    engine = build_rollout_engine("vllm", {"dtype": "float32", "max_num_seqs": 4}, model, root / "run")
    yield engine
    engine.close()


def test_a_vllm_judge_scores_through_its_chat_endpoint(server) -> None:
    from core_rl_reward_remote.config import JudgeConfig
    from core_rl_reward_remote.judge import JudgeReward

    options = {"url": server.endpoints[0].url + "/v1", "model": server.model_name, "max_tokens": 4}
    reward = JudgeReward(structure(options, JudgeConfig, path="reward"))
    items = [make_reward_input("3", prompt="1+2"), make_reward_input("5", prompt="2+2")]
    result = reward.score_with_parts(items)
    assert result.scores == [pytest.approx(0.7)] * 2 and result.parts["score"] == [7.0, 7.0]
    # one token is "Score: 7" itself; with max_tokens 1 the reply is that token: still parsed
    short = JudgeReward(structure({**options, "score_pattern": r"Score: (\d+)$", "max_tokens": 1}, JudgeConfig))
    assert short.score(items[:1]) == [pytest.approx(0.7)]
    strict = JudgeReward(structure({**options, "score_pattern": r"Verdict: (\d+)"}, JudgeConfig))
    unparsed = strict.score_with_parts(items[:1])
    assert math.isnan(unparsed.scores[0]) and unparsed.parts["unparsed"] == [1.0]
    for r in (reward, short, strict):
        r.close()
