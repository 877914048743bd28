"""What the OpenAI proxy (``openai_agent`` workflow) adds per call: episodes of two chat calls on a
tiny model through the ``hf`` engine, once straight to the engine (``agenerate`` with the same
prompts) and once through the proxy over HTTP with the ``openai`` client, one episode at a time
and many at once. Then what each way of running the agent program costs per episode: the same
agent (``examples/agent_proxy/agent.py``) in-process (``agent:solve``), as a function in a worker
process (``agent.py:solve`` with ``rollout.workflow.python``: one process for the run) and as a
script (``agent.py``: one process per episode).

    python benchmarks/openai_proxy.py [--episodes 128] [--smoke]

Prints two tables: setting, episodes at once, seconds per call (wall / calls), and the proxy's
added milliseconds per call against the direct engine at the same concurrency; then program mode,
episodes at once, seconds per episode, and the milliseconds added per episode against in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "agent_proxy"))


async def _direct(engine, template, row: dict, sampling) -> None:
    messages = [{"role": "user", "content": row["prompt"]}]
    (first,) = await engine.agenerate(template.first_prompt(messages, None).ids, sampling)
    tail = template.encode("t:7>a:")
    await engine.agenerate([*first.prompt_ids, *first.response_ids, *tail], sampling)


async def _timed(episodes, concurrent: bool) -> float:
    start = time.perf_counter()
    if concurrent:
        await asyncio.gather(*(e() for e in episodes))
    else:
        for e in episodes:
            await e()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="8 episodes: checks the script runs")
    args = parser.parse_args(argv)
    episodes = 8 if args.smoke else args.episodes
    torch.set_num_threads(1)
    import transformers
    from agent import solve
    from core_rl.interfaces import SamplingParams
    from core_rl.testing.tiny import build_tiny_model
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine
    from core_rl_openai_proxy.config import OpenAIAgentConfig
    from core_rl_openai_proxy.server import ProxyServer
    from proxy_task import ALPHABET, CHAT_TEMPLATE

    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "model", alphabet=ALPHABET, seed=0)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        engine = HFRolloutEngine(path, HFRolloutConfig(device="cpu", seed=0))
        config = OpenAIAgentConfig(program="agent:solve", chat_template=str(CHAT_TEMPLATE), max_context_tokens=64)
        proxy = ProxyServer(tokenizer, config)
        proxy.start()
        sampling = SamplingParams(n=1, max_new_tokens=3)
        row = {"prompt": "3+4"}

        async def run() -> tuple[dict[tuple[str, bool], float], dict[tuple[str, int], float]]:
            loop = asyncio.get_running_loop()

            def generate(ids, sp, media=None):  # the proxy passes the prompt's images (none here)
                return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(engine.agenerate(ids, sp), loop))

            def proxied():
                session = proxy.open(generate, sampling, row)
                return lambda: solve(proxy.base_url, session.id, row)

            await _timed([proxied()], False)  # warm-up: imports, connections
            out = {}
            for concurrent in (False, True):
                direct = [lambda: _direct(engine, proxy.template, row, sampling) for _ in range(episodes)]
                out["direct", concurrent] = await _timed(direct, concurrent) / (2 * episodes)
                out["proxy", concurrent] = await _timed([proxied() for _ in range(episodes)], concurrent) / (
                    2 * episodes
                )
            modes = await _program_modes(engine, proxy, sampling, row, 4 if args.smoke else episodes // 4)
            return out, modes

        per_call, per_episode = asyncio.run(run())
        proxy.close()
        engine.close()
    print(f"{'setting':<10}{'at once':>8}{'s/call':>10}{'added ms/call':>15}")
    for (name, concurrent), seconds in per_call.items():
        added = (seconds - per_call["direct", concurrent]) * 1000
        print(f"{name:<10}{episodes if concurrent else 1:>8}{seconds:>10.4f}{added:>15.2f}")
    print()
    print(f"{'program':<12}{'at once':>8}{'s/episode':>11}{'added ms/episode':>18}")
    for (name, at_once), seconds in per_episode.items():
        added = (seconds - per_episode["in-process", at_once]) * 1000
        print(f"{name:<12}{at_once:>8}{seconds:>11.4f}{added:>18.2f}")
    return 0


async def _program_modes(engine, proxy, sampling, row: dict, episodes: int) -> dict[tuple[str, int], float]:
    """Seconds per episode of the example agent run each way, one at a time and ``episodes`` at once."""
    from core_rl_openai_proxy.program import AgentProgram

    agent = ROOT / "examples" / "agent_proxy" / "agent.py"
    programs = {
        "in-process": AgentProgram("agent:solve", []),
        "worker": AgentProgram(f"{agent}:solve", [], sys.executable),
        "script": AgentProgram(str(agent), [], sys.executable),
    }
    loop = asyncio.get_running_loop()

    def generate(ids, sp, media=None):  # the proxy passes the prompt's images (none here)
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(engine.agenerate(ids, sp), loop))

    def episode(program: AgentProgram):
        async def run() -> None:
            session = proxy.open(generate, sampling, row)
            try:
                await program.run(proxy.base_url, session.id, row)
            finally:
                proxy.end(session)

        return run

    out = {}
    try:
        for name, program in programs.items():
            await episode(program)()  # warm-up: the worker's start, imports, connections
            for at_once in (1, episodes):
                runs = [episode(program) for _ in range(episodes)]
                out[name, at_once] = await _timed(runs, at_once > 1) / episodes
    finally:
        for program in programs.values():
            program.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
