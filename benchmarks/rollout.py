"""Rollout through inference servers: the plugin's overhead and the cost of a weight update.

For each engine (``vllm``, ``sglang``) it starts one server (from the managed server environment)
on a tiny model and prints:

- generated tokens/s through the plugin (``engine.generate``: ``--prompts`` prompts x ``--n``
  samples of exactly ``--max-new-tokens`` tokens) and through a plain client sending the same
  requests to the same server with the same concurrency, and the plugin's overhead
  ``1 - plugin / plain`` (goal: under 5%). The plain client is the plugin's own (httpx over
  aiohttp's pool, ``core_rl_server_kit.remote.wire.async_client``); the same client on httpx's own pool is
  printed beside it (its cost per request grows with the requests in flight);
- seconds to move the weights from the ``fsdp`` train engine to the server by disk
  (``export_hf`` + the server's reload) and by collective (the trainer's own path,
  :func:`core_rl.sync.weight_sync.collective_state` + a broadcast over a gloo group), for the tiny
  model, a ~10M-parameter one and the real pretrained model (``real``: SmolLM2-135M-Instruct,
  :mod:`core_rl.testing.real_model`) (``--sync-models``), with the collective's bytes on the wire and
  bytes/s, beside the link's own: the same tensors, in the same dtypes, broadcast over a gloo group
  to a second local process that only receives them (``link``: the floor a collective sync cannot
  beat; what the collective takes above it is the server's loading);
- the sync check's cost (``rollout.sync_check``, :mod:`core_rl.sync.check`) after each of
  those updates: the trainer's sampling of what it sent, the server's fingerprints and the
  comparison, in seconds and as a share of the sync it follows (the server's own fingerprinting
  while loading is inside the sync's time).

    python benchmarks/rollout.py [--engines vllm,sglang] [--prompts 64] [--n 8] [--max-new-tokens 32]
                                 [--repeats 3] [--sync-models tiny,10m,real] [--no-throughput] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MODELS = {  # build_tiny_model arguments; head size 32 for vLLM's CPU attention
    "tiny": {"hidden_size": 64, "num_heads": 2, "num_layers": 2, "intermediate_size": 256},
    "10m": {"hidden_size": 256, "num_heads": 8, "num_layers": 10, "intermediate_size": 1024},
}


def build_model(root: Path, size: str) -> Path:
    """The model of ``size``: a tiny one built under ``root``, or ``real`` (cached once per machine)."""
    if size == "real":
        from core_rl.testing.real_model import smollm2

        return smollm2()
    from core_rl.testing.tiny import build_tiny_model

    return build_tiny_model(root / f"model_{size}", seed=0, **MODELS[size])


#: the receiving end of :func:`link_seconds`: joins the group as rank 1 and receives what it is told
LINK_RECEIVER = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from core_rl_server_kit import weight_group
spec = json.loads(sys.argv[2])
torch.set_num_threads(1)
pg = weight_group.init_group(
    "127.0.0.1", spec["port"], 2, backend="gloo", group_name=spec["group"], timeout_s=300, rank=1
)
for _ in range(spec["repeats"]):
    weight_group.drain(weight_group.receive_tensors(pg, spec["names"], spec["dtypes"], spec["shapes"], "cpu"))
"""


def link_seconds(tensors: list[torch.Tensor], repeats: int) -> float:
    """Median seconds to broadcast ``tensors`` (as they are: same shapes, dtypes and order) over a
    gloo group to a second local process that receives each into a fresh tensor and drops it: what
    the link alone costs a collective weight sync."""
    import subprocess

    from core_rl_server_kit import weight_group
    from core_rl_server_kit.processes import free_port

    port, group = free_port("127.0.0.1"), weight_group.new_group_name()
    spec = {
        "port": port,
        "group": group,
        "repeats": repeats,
        "names": [str(i) for i in range(len(tensors))],
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
    }
    core = str(Path(weight_group.__file__).resolve().parents[1])
    receiver = subprocess.Popen([sys.executable, "-c", LINK_RECEIVER, core, json.dumps(spec)])
    try:
        pg = weight_group.init_group("127.0.0.1", port, 2, backend="gloo", group_name=group, timeout_s=300)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            weight_group.broadcast_tensors(pg, tensors, "cpu")
            times.append(time.perf_counter() - start)
        weight_group.destroy_group(pg)
    finally:
        receiver.wait(timeout=300)
    return statistics.median(times)


def make_engine(name: str, model: Path, run_dir: Path, concurrency: int) -> Any:
    from core_rl.config.loader import structure
    from core_rl.config.schema import PluginSpec, RolloutConfig
    from core_rl.plugins.host import PluginHost
    from core_rl.plugins.kinds import ROLLOUT_ENGINE

    entry = PluginHost().get(ROLLOUT_ENGINE, name)
    options = {"dtype": "bfloat16", "server": {"max_concurrent_requests": concurrency}}
    return entry.factory(
        RolloutConfig(engine=PluginSpec(name=name)),
        structure(options, entry.config_cls),
        model_path=str(model),
        run_dir=run_dir,
    )


def plain_payload(name: str, prompt: list[int], n: int, tokens: int, model_name: str) -> tuple[str, dict]:
    """The request a user would write by hand (the same sampling as the plugin's)."""
    if name == "vllm":
        return "/v1/completions", {
            "model": model_name,
            "prompt": prompt,
            "n": n,
            "max_tokens": tokens,
            "min_tokens": tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
        }
    return "/generate", {
        "input_ids": [prompt] * n,
        "sampling_params": {"max_new_tokens": tokens, "min_new_tokens": tokens, "temperature": 1.0},
        "return_logprob": True,
    }


async def plain_client(
    name: str,
    url: str,
    prompts: list[list[int]],
    n: int,
    tokens: int,
    concurrency: int,
    model_name: str,
    pool: str = "aiohttp",
) -> int:
    """Send every prompt's request with at most ``concurrency`` in flight; return tokens generated.
    ``pool``: ``aiohttp`` (the plugin's client) or ``httpx`` (httpx's own connection pool)."""
    import httpx
    from core_rl_server_kit.remote.wire import async_client

    slots = asyncio.Semaphore(concurrency)
    if pool == "httpx":
        client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4))
    else:
        client = async_client(600, concurrency + 4)
    async with client:

        async def one(prompt: list[int]) -> int:
            path, payload = plain_payload(name, prompt, n, tokens, model_name)
            async with slots:
                response = await client.post(url + path, json=payload)
            response.raise_for_status()
            body = response.json()
            if name == "vllm":
                return sum(len(c["token_ids"]) for c in body["choices"])
            return sum(len(item["output_ids"]) for item in body)

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def throughput(engine: Any, name: str, args: argparse.Namespace) -> dict[str, float]:
    from core_rl.interfaces import SamplingParams

    prompts = [[1, 4 + i % 40, 5 + i % 7, 6 + i % 11] for i in range(args.prompts)]
    sampling = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens)
    url = engine.endpoints[0].url
    model_name = getattr(engine, "model_name", "")
    engine.generate(prompts[:4], sampling)  # warm up
    rates: dict[str, list[float]] = {"plugin": [], "aiohttp": [], "httpx": []}
    client_ms: dict[str, list[float]] = {"aiohttp": [], "httpx": []}  # the plain client's CPU per request
    for _ in range(args.repeats):  # interleaved, so all see the same machine load
        start = time.perf_counter()
        out = engine.generate(prompts, sampling)
        rates["plugin"].append(sum(len(s.response_ids) for g in out for s in g) / (time.perf_counter() - start))
        for pool in ("aiohttp", "httpx"):
            start, cpu = time.perf_counter(), time.process_time()
            count = asyncio.run(
                plain_client(name, url, prompts, args.n, args.max_new_tokens, args.concurrency, model_name, pool)
            )
            rates[pool].append(count / (time.perf_counter() - start))
            client_ms[pool].append(1000 * (time.process_time() - cpu) / len(prompts))
    plugin, plain, plain_httpx = (statistics.median(rates[k]) for k in ("plugin", "aiohttp", "httpx"))
    return {
        "plugin_tokens_per_s": plugin,
        "plain_tokens_per_s": plain,
        "plain_httpx_pool_tokens_per_s": plain_httpx,
        "overhead": 1.0 - plugin / plain,
        "client_cpu_ms_per_request": statistics.median(client_ms["aiohttp"]),
        "httpx_pool_client_cpu_ms_per_request": statistics.median(client_ms["httpx"]),
    }


def weight_sync(engine: Any, model: Path, work: Path, repeats: int) -> dict[str, float]:
    """Seconds per update by disk and by collective, from an fsdp train engine on ``model``."""
    from core_rl.config.loader import structure
    from core_rl.config.schema import ActorConfig, PluginSpec
    from core_rl.plugins.host import PluginHost
    from core_rl.plugins.kinds import TRAIN_ENGINE

    entry = PluginHost().get(TRAIN_ENGINE, "fsdp")
    train = entry.factory(
        ActorConfig(model_path=str(model), engine=PluginSpec(name="fsdp")),
        structure({}, entry.config_cls),
        trainable=False,
    )
    from core_rl.sync.check import SentWeights, SyncCheck
    from core_rl.sync.weight_sync import collective_state

    def check_cfg(mode: str) -> SyncCheck:
        from core_rl.config.schema import RunConfig

        return SyncCheck(structure({"rollout": {"engine": {"name": engine.env_name}, "weight_sync": mode}}, RunConfig))

    try:
        disk, collective, disk_check, collective_check = [], [], [], []
        version = engine.weight_version
        for _ in range(repeats):
            version += 1
            start = time.perf_counter()
            train.export_hf(work / "sync")
            engine.load_weights_from_path(work / "sync", version)
            disk.append(time.perf_counter() - start)
            start = time.perf_counter()
            sent = SentWeights(version, engine.fingerprint_prefix)
            sent.add_dir(work / "sync")
            check_cfg("disk").verify(engine, sent)
            disk_check.append(time.perf_counter() - start)
            version += 1
            start = time.perf_counter()
            state = collective_state(train)
            engine.update_weights_collective(state, version)
            collective.append(time.perf_counter() - start)
            start = time.perf_counter()
            sent = SentWeights(version, engine.fingerprint_prefix)
            sent.add_state(state)
            check_cfg("collective").verify(engine, sent)
            collective_check.append(time.perf_counter() - start)
        state = collective_state(train)
        params = sum(t.numel() for t in state.values())
        wire = engine.wire_dtypes(list(state), [t.dtype for t in state.values()])
        on_wire = [t.to(dtype) for t, dtype in zip(state.values(), wire)]
        link = link_seconds(on_wire, repeats)
    finally:
        train.close()
    sent = float(engine.last_sync["bytes"])
    seconds = statistics.median(collective)
    return {
        "params": float(params),
        "bytes": sent,
        "disk_s": statistics.median(disk),
        "collective_s": seconds,
        "collective_bytes_per_s": sent / seconds,
        "link_s": link,
        "link_bytes_per_s": sent / link,
        "check_disk_s": statistics.median(disk_check),
        "check_disk_share": statistics.median(disk_check) / statistics.median(disk),
        "check_collective_s": statistics.median(collective_check),
        "check_collective_share": statistics.median(collective_check) / seconds,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="core-rl-bench-") as tmp:
        root = Path(tmp)
        for name in args.engines:
            results[name] = {}
            for size in args.sync_models or ["tiny"]:
                model = build_model(root, size)
                engine = make_engine(name, model, root / f"run_{name}_{size}", args.concurrency)
                try:
                    if size == "tiny" and args.throughput:
                        results[name]["throughput"] = throughput(engine, name, args)
                    if args.sync_models:
                        results[name][f"sync_{size}"] = weight_sync(
                            engine, model, root / f"sync_{name}_{size}", args.repeats
                        )
                finally:
                    engine.close()
    return results


def report(results: dict[str, Any]) -> None:
    for name, r in results.items():
        t = r.get("throughput")
        if t:
            print(
                f"{name}: plugin {t['plugin_tokens_per_s']:.0f} tok/s, plain HTTP {t['plain_tokens_per_s']:.0f} tok/s, "
                f"overhead {100 * t['overhead']:+.1f}% (goal < 5%: {'met' if t['overhead'] < 0.05 else 'NOT met'}); "
                f"plain HTTP on httpx's own pool {t['plain_httpx_pool_tokens_per_s']:.0f} tok/s; "
                f"the plain client's CPU per request {t['client_cpu_ms_per_request']:.1f} ms (httpx's pool "
                f"{t['httpx_pool_client_cpu_ms_per_request']:.1f} ms)"
            )
        for key, s in r.items():
            if key.startswith("sync_"):
                print(
                    f"{name} weight sync, {key[5:]} model ({s['params'] / 1e6:.2f}M params): "
                    f"disk {s['disk_s']:.3f} s; collective {s['collective_s']:.3f} s for "
                    f"{s['bytes'] / 1e6:.1f} MB on the wire ({s['collective_bytes_per_s'] / 1e9:.2f} GB/s), "
                    f"the link alone {s['link_s']:.3f} s ({s['link_bytes_per_s'] / 1e9:.2f} GB/s); "
                    f"the sync check {1e3 * s['check_disk_s']:.1f} ms after disk "
                    f"({100 * s['check_disk_share']:.1f}% of it), {1e3 * s['check_collective_s']:.1f} ms after "
                    f"collective ({100 * s['check_collective_share']:.1f}% of it)"
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="vllm,sglang", type=lambda s: [x for x in s.split(",") if x])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync-models", default="tiny,10m", type=lambda s: [x for x in s.split(",") if x])
    parser.add_argument("--no-throughput", dest="throughput", action="store_false", help="weight syncs only")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = run(args)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
