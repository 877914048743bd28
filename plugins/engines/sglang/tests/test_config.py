"""The ``sglang`` engine's configuration and server command line (no server started here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_rl.cli import main
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.testing import preloaded
from core_rl_sglang.config import SGLangConfig
from core_rl_sglang.engine import SGLangRolloutEngine

ROOT = Path(__file__).resolve().parents[4]


def _command(**options: object) -> tuple[list[str], dict[str, str]]:
    engine = _engine(**options)
    return engine.server_command("/env/bin/python", 8123, 0), engine.server_environment(0)


def _engine(**options: object) -> SGLangRolloutEngine:
    config = structure(options, SGLangConfig, path="rollout.engine")
    engine = SGLangRolloutEngine.__new__(SGLangRolloutEngine)  # the command needs no running server
    engine.config, engine.options, engine.model_path = config, config.server, "/models/m"
    return engine


def test_the_servers_run_a_models_own_code_only_with_trust_remote_code() -> None:
    from core_rl.testing.remote_code_model import check_server_trust_flag
    from core_rl_sglang.engine import make_engine

    check_server_trust_flag(_engine(extra_args=["--x", "1"]), make_engine)


def test_cpu_command_has_the_cpu_recipe_and_passes_options() -> None:
    argv, env = _command(
        dtype="float32",
        context_length=512,
        max_running_requests=8,
        tp_size=2,
        random_seed=3,
        max_total_tokens=4096,
        enable_prefix_caching=False,
        chunked_prefill_size=-1,
        extra_args=["--log-level", "debug"],
        server={"env_variant": "cpu"},
    )
    line = " ".join(argv)
    assert argv[:3] == ["/env/bin/python", "-m", "core_rl_sglang_server"]  # sglang.launch_server (server_side)
    for part in (
        "--model-path /models/m",
        "--port 8123",
        "--dtype float32",
        "--context-length 512",
        "--max-running-requests 8",
        "--tp-size 2",
        "--random-seed 3",
        "--device cpu",
        "--attention-backend torch_native",
        "--sampling-backend pytorch",
        "--mem-fraction-static 0.3",
        "--max-total-tokens 4096",
        "--disable-radix-cache",
        "--chunked-prefill-size -1",
        "--disable-overlap-schedule",
        "--skip-server-warmup",
        "--sleep-on-idle",
    ):
        assert part in line, part
    assert argv[-2:] == ["--log-level", "debug"]
    assert (Path(env["PYTHONPATH"]) / "vllm" / "_custom_ops.py").is_file()
    # a stop is not taken for a crash worth a 5 s wait for py-spy and CUDA core dumps
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    assert (Path(env["PYTHONPATH"]) / "core_rl_sglang_server.py").is_file()
    assert "CORE_RL_FORK_ENGINE" not in env  # two tensor-parallel schedulers: spawned, as SGLang does


def test_gpu_command_leaves_backends_to_sglang() -> None:
    argv, _ = _command(server={"env_variant": "cuda"})
    assert "--device" not in argv and "--attention-backend" not in argv and "--mem-fraction-static" not in argv
    assert "--max-total-tokens" not in argv  # SGLang sizes the KV cache from the memory fraction
    assert "--max-running-requests" not in argv  # ...and the running requests from the KV cache
    assert "--sleep-on-idle" in argv  # on every device: a busy scheduler takes a core per server
    cpu, cpu_env = _command(server={"env_variant": "cpu"})
    assert cpu[cpu.index("--max-total-tokens") + 1] == "8192"
    assert "--max-running-requests" not in cpu  # 4096 measured with that cache: the whole step's batch at once
    assert cpu_env["CORE_RL_FORK_ENGINE"] == "1"  # one scheduler on CPU: forked, not spawned
    assert "CORE_RL_FORK_ENGINE" not in _command(server={"env_variant": "cuda"})[1]


def test_sleep_on_idle_can_be_turned_off() -> None:
    argv, _ = _command(server={"env_variant": "cpu"}, sleep_on_idle=False)
    assert "--sleep-on-idle" not in argv


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "int8"}, "rollout.engine.dtype: must be one of"),
        ({"mem_fraction_static": 2.0}, "rollout.engine.mem_fraction_static"),
        ({"server": {"max_retries": -1}}, "rollout.engine.server.max_retries"),
    ],
)
def test_bad_options_name_their_key(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        structure(options, SGLangConfig, path="rollout.engine")


def test_example_config_validates() -> None:
    assert main(["config", "validate", str(ROOT / "examples" / "server_grpo" / "sglang.yaml")]) == 0


def test_rotary_shim_matches_a_direct_formula() -> None:
    """The pure-torch ``vllm._custom_ops.rotary_embedding`` shim, neox style, against the formula."""
    import importlib.util

    import torch

    path = Path(__file__).resolve().parents[1] / "src" / "core_rl_sglang" / "server_side" / "vllm" / "_custom_ops.py"
    spec = importlib.util.spec_from_file_location("shim", path)
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    torch.manual_seed(0)
    tokens, heads, head, rot = 5, 2, 8, 8
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    angles = torch.arange(16).float()[:, None] * inv[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.tensor([0, 3, 1, 7, 15])
    q, k = torch.randn(tokens, heads * head), torch.randn(tokens, heads * head)
    q0, k0 = q.clone(), k.clone()
    shim.rotary_embedding(positions, q, k, head, cache, True)
    for original, rotated in ((q0, q), (k0, k)):
        x = original.view(tokens, heads, head)
        cos, sin = angles[positions].cos()[:, None], angles[positions].sin()[:, None]
        x1, x2 = x[..., : rot // 2], x[..., rot // 2 :]
        want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(tokens, -1)
        torch.testing.assert_close(rotated, want)
    # GPT-J style rotates (even, odd) pairs: position 0 leaves everything unchanged
    q = q0.clone()
    shim.rotary_embedding(torch.zeros(tokens, dtype=torch.long), q, None, head, cache, False)
    torch.testing.assert_close(q, q0)


def test_a_collective_update_goes_in_buckets_in_the_broadcast_order() -> None:
    """Each request lists about ``update_bucket_mb`` of weights (closed once it reaches it; a tensor
    larger than that goes alone), in the order the trainer broadcasts them."""
    from core_rl_sglang.engine import update_requests

    names = ["a", "b", "c", "d"]
    dtypes = ["float32", "bfloat16", "float32", "float32"]
    shapes = [[4], [2, 2], [16], [1]]  # 16, 8, 64 and 4 bytes
    requests = update_requests(names, dtypes, shapes, bucket_bytes=20)
    assert [r["names"] for r in requests] == [["a", "b"], ["c"], ["d"]]
    assert [r["dtypes"] for r in requests] == [["float32", "bfloat16"], ["float32"], ["float32"]]
    assert [r["shapes"] for r in requests] == [[[4], [2, 2]], [[16]], [[1]]]
    (whole,) = update_requests(names, dtypes, shapes, bucket_bytes=0)
    assert whole == {"names": names, "dtypes": dtypes, "shapes": shapes}
    assert [n for r in update_requests(names, dtypes, shapes, bucket_bytes=1) for n in r["names"]] == names


def test_lora_servers_get_the_lora_flags_and_on_cpu_pinless_host_memory() -> None:
    """``rollout.lora_sync: adapter`` (a ``lora_rank``): SGLang's LoRA flags, its ``torch_native``
    LoRA backend and pinless host memory on CPU only; without one the command is unchanged."""
    from core_rl_sglang.lora import PINLESS_VARIABLE

    plain_argv, plain_env = _command(server={"env_variant": "cpu"})
    for variant in ("cpu", "cuda"):
        engine = _engine(server={"env_variant": variant}, extra_args=["--x", "1"])
        engine.lora_rank = 12
        argv, env = engine.server_command("/env/bin/python", 8123, 0), engine.server_environment(0)
        line = " ".join(argv)
        assert "--enable-lora --max-lora-rank 12 --lora-target-modules all --max-loras-per-batch 2" in line
        assert argv[-2:] == ["--x", "1"]
        assert ("--lora-backend torch_native" in line) is (variant == "cpu")
        assert (env.get(PINLESS_VARIABLE) == "1") is (variant == "cpu")
    assert "lora" not in " ".join(plain_argv) and PINLESS_VARIABLE not in plain_env


def test_pinless_host_memory_where_torch_cannot_pin() -> None:
    """The server-side fix-up (``server_side/core_rl_sglang_pinless.py``), in a fresh interpreter
    (it patches torch): where this torch cannot pin, ``pin_memory=True`` and ``.pin_memory()`` give
    ordinary tensors with the same values, and registering host memory (SGLang's routed-experts
    capture) succeeds doing nothing; where it can, nothing is patched."""
    import sys

    server_side = Path(__file__).resolve().parents[1] / "src" / "core_rl_sglang" / "server_side"
    script = (
        "import torch, core_rl_sglang_pinless as p\n"
        "works = p.pinning_works(torch)\n"
        "assert p.apply() is (not works)\n"
        "t = torch.tensor([1, 2], dtype=torch.int32, pin_memory=True)\n"
        "e = torch.arange(3, pin_memory=True)\n"
        "assert t.tolist() == [1, 2] and e.tolist() == [0, 1, 2]\n"
        "o = torch.ones(2)\n"
        "assert (o.pin_memory() is o) is (not works)\n"
        "if not works and not torch.cuda.is_available():\n"
        "    assert torch.cuda.cudart().cudaHostRegister(o.data_ptr(), 8, 0) == 0\n"
        "print('pins' if works else 'patched')\n"
    )
    out = preloaded.run([sys.executable, "-c", script], cwd=server_side, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("pins", "patched")


def test_the_servers_sitecustomize_applies_pinless_and_runs_the_one_it_shadows(tmp_path: Path) -> None:
    """A server process (``server_side`` first on ``PYTHONPATH``) with ``CORE_RL_SGLANG_PINLESS=1``
    makes pinned tensors, and a ``sitecustomize`` further down the path still runs."""
    import os
    import sys

    from core_rl_sglang.lora import PINLESS_VARIABLE

    server_side = Path(__file__).resolve().parents[1] / "src" / "core_rl_sglang" / "server_side"
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE'] = 'ran'\n")
    env = {**os.environ, "PYTHONPATH": f"{server_side}{os.pathsep}{tmp_path}", PINLESS_VARIABLE: "1"}
    script = "import os, torch\ntorch.zeros(2, pin_memory=True)\nprint(os.environ['SHADOWED_SITECUSTOMIZE'])\n"
    out = preloaded.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ran"


def test_a_sync_check_reads_back_a_budget_of_tensors_a_different_share_each_version() -> None:
    """``sync_check_elements``: each check reads back tensors within the budget (at least one), a
    different share per version, covering every tensor over a few versions; 0 or a model within
    the budget: every tensor."""
    from core_rl_sglang.fingerprints import checked_share

    shapes = {f"layers.{i}.w": [100, 100] for i in range(20)} | {"embed": [5000, 100]}
    assert checked_share(shapes, 3, 0) == shapes and checked_share(shapes, 3, 10**7) == shapes
    shares = [checked_share(shapes, version, 50_000) for version in range(1, 40)]
    assert all(1 <= len(share) and sum(100 * 100 for n in share if n != "embed") <= 50_000 for share in shares)
    assert all(list(share) == [n for n in shapes if n in share] for share in shares)  # in the update's order
    assert len({tuple(share) for share in shares}) > 10
    seen = set().union(*shares)
    assert seen >= {n for n in shapes if n != "embed"}  # every small tensor within 39 checks
    assert checked_share(shapes, 1, 50_000) == checked_share(shapes, 1, 50_000)  # the same on every call


def test_a_prompt_with_images_goes_to_the_media_route_and_placeholders_are_never_sampled(monkeypatch) -> None:
    """A vision-language model's request: its pixel inputs, encoded, to ``/core_rl/generate`` (one
    copy per sample), decoded by the server side to the very tensors; every request of it carries a
    ``logit_bias`` banning the placeholders (kept alongside one from ``rollout.sampling.extra``); a
    prompt without images goes to ``/generate``."""
    import asyncio
    import importlib.util

    import torch
    from core_rl.interfaces import SamplingParams
    from core_rl_sglang import engine as module

    sent = []

    async def fake_post(client, url, payload, timeout=None):
        sent.append((url, payload))
        one = {
            "output_ids": [9],
            "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 9]]},
        }
        return [one] * len(payload["input_ids"])

    monkeypatch.setattr(module, "json_post", fake_post)
    engine = _engine()
    engine.vision_language, engine._banned, engine._adapters = True, (5, 6), {}
    media = {"pixel_values": torch.randn(16, 96), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    sampling = SamplingParams(n=2, max_new_tokens=1, extra={"logit_bias": {"7": -2.0}})
    asyncio.run(engine.request(None, "http://s", [1, 5, 5, 2], sampling, media=media))
    asyncio.run(engine.request(None, "http://s", [1, 2], SamplingParams(n=1, max_new_tokens=1)))
    (url, payload), (text_url, text_payload) = sent
    assert url == "http://s/core_rl/generate" and text_url == "http://s/generate"
    assert payload["input_ids"] == [[1, 5, 5, 2]] * 2 and len(payload["image_data"]) == 2
    assert "image_data" not in text_payload
    assert payload["sampling_params"]["logit_bias"] == {
        "7": -2.0,
        "5": module.PLACEHOLDER_BIAS,
        "6": module.PLACEHOLDER_BIAS,
    }
    assert text_payload["sampling_params"]["logit_bias"] == {"5": module.PLACEHOLDER_BIAS, "6": module.PLACEHOLDER_BIAS}

    monkeypatch.setenv("CORE_RL_MEDIA_WIRE_PY", engine.server_environment(0)["CORE_RL_MEDIA_WIRE_PY"])
    spec = importlib.util.spec_from_file_location("media", module.SERVER_SIDE / "core_rl_sglang_media.py")
    server_side = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server_side)
    (decoded,) = server_side.processor_output(payload["image_data"][0])
    assert decoded["format"] == "processor_output"
    for key, tensor in media.items():
        assert decoded[key].dtype == tensor.dtype and torch.equal(decoded[key], tensor)
    assert server_side.processor_output(None) is None


def test_a_vision_language_models_collective_update_names_tensors_as_sglang_loads_them() -> None:
    from core_rl_sglang.engine import served_name

    assert served_name("model.visual.merger.mlp.0.weight") == "visual.merger.mlp.0.weight"
    assert served_name("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert served_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert served_name("lm_head.weight") == "lm_head.weight"
    env = _engine().server_environment(0)
    assert "SGLANG_VLM_CACHE_SIZE_MB" not in env  # a text model keeps SGLang's defaults
    vlm = _engine()
    vlm.vision_language = True
    assert vlm.server_environment(0)["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
