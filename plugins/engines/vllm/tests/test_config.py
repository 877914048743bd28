"""The ``vllm`` engine's configuration and server command line (no server started here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_rl.cli import main
from core_rl.config.loader import structure
from core_rl.errors import ConfigError, CoreRLError
from core_rl_vllm.config import VLLMConfig
from core_rl_vllm.engine import VLLMRolloutEngine

ROOT = Path(__file__).resolve().parents[4]


def _command(**options: object) -> tuple[list[str], dict[str, str]]:
    engine = _engine(**options)
    return engine.server_command("/env/bin/python", 8123, 1), engine.server_environment(1)


def _engine(**options: object) -> VLLMRolloutEngine:
    config = structure(options, VLLMConfig, path="rollout.engine")
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # the command needs no running server
    engine.config, engine.options, engine.model_path = config, config.server, "/models/m"
    return engine


def test_the_servers_run_a_models_own_code_only_with_trust_remote_code() -> None:
    from core_rl.testing.remote_code_model import check_server_trust_flag
    from core_rl_vllm.engine import make_engine

    check_server_trust_flag(_engine(extra_args=["--x", "1"]), make_engine)


def test_command_passes_options_through() -> None:
    argv, env = _command(
        dtype="float16",
        max_model_len=512,
        max_num_seqs=8,
        tensor_parallel_size=2,
        seed=5,
        attention_backend="TORCH_SDPA",
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        extra_args=["--block-size", "32"],
        kv_cache_space_gib=2,
        server={"env_variant": "cpu"},
    )
    line = " ".join(argv)
    assert argv[:3] == ["/env/bin/python", "-m", "core_rl_vllm_server"]  # vLLM's api_server (server_side)
    for part in (
        "--model /models/m",
        "--port 8123",
        "--dtype float16",
        "--max-model-len 512",
        "--max-num-seqs 8",
        "--tensor-parallel-size 2",
        "--seed 6",  # seed + server index
        "--attention-backend TORCH_SDPA",
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--logprobs-mode processed_logprobs",
        "--worker-extension-cls core_rl_vllm_worker.WeightSyncExtension",
    ):
        assert part in line, part
    assert argv[-2:] == ["--block-size", "32"]
    assert "--distributed-executor-backend" not in line  # tp 2 uses vLLM's own executor
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert (Path(env["PYTHONPATH"]) / "core_rl_vllm_worker.py").is_file()
    assert Path(env["CORE_RL_WEIGHT_GROUP_PY"]).name == "weight_group.py"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # tensor parallel: vLLM's worker processes
    assert "CORE_RL_FORK_ENGINE" not in env  # ...which vLLM spawns, as it does
    assert (Path(env["PYTHONPATH"]) / "core_rl_vllm_server.py").is_file()


def test_defaults_use_the_model_length_and_one_process() -> None:
    argv, env = _command(server={"env_variant": "cpu"})
    assert "--max-model-len" not in argv and "--gpu-memory-utilization" not in argv
    assert "--max-num-seqs" not in argv  # vLLM's own default: 128 per rank on CPU, by memory on a GPU
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # on CPU the model runs in the engine-core process
    assert env["CORE_RL_FORK_ENGINE"] == "1"  # ...which is forked, not spawned
    assert "--disable-log-stats" in argv
    assert "--disable-log-stats" not in _command(server={"env_variant": "cpu"}, log_stats=True)[0]
    assert "--enforce-eager" in argv  # eager on CPU, compiled with CUDA graphs on a GPU (enforce_eager: auto)
    gpu, gpu_env = _command(server={"env_variant": "cuda"}, gpu_memory_utilization=0.5)
    assert gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.5"
    assert "--enforce-eager" not in gpu and "--max-num-seqs" not in gpu
    assert "--enforce-eager" in _command(server={"env_variant": "cuda"}, enforce_eager=True)[0]
    assert "--enforce-eager" not in _command(server={"env_variant": "cpu"}, enforce_eager=False)[0]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in gpu_env and "CORE_RL_FORK_ENGINE" not in gpu_env


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "float64"}, "rollout.engine.dtype: must be one of"),
        ({"max_num_seqs": -1}, "rollout.engine.max_num_seqs: must be >= 0"),
        ({"server": {"on_server_failure": "retry"}}, "rollout.engine.server.on_server_failure: must be one of"),
        ({"server": {"num_servers": 0}}, "rollout.engine.server.num_servers: must be > 0"),
        ({"server": {"prot": 1}}, "rollout.engine.server.prot: unknown key"),
    ],
)
def test_bad_options_name_their_key(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        structure(options, VLLMConfig, path="rollout.engine")


def test_example_config_validates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "validate", str(ROOT / "examples" / "server_grpo" / "vllm.yaml")]) == 0
    # memory weight sync is not something a server can do: refused when the config is validated
    assert (
        main(["config", "validate", str(ROOT / "examples" / "server_grpo" / "vllm.yaml"), "rollout.weight_sync=memory"])
        == 2
    )
    err = capsys.readouterr().err
    assert "rollout.weight_sync: rollout engine 'vllm' (core-rl-vllm) does not support 'memory'" in err


def test_server_cpus_bind_the_cpu_workers_openmp_threads() -> None:
    """``server.cpus`` (the servers' affinity) also binds vLLM's OpenMP threads to exactly those
    cores; without it vLLM's own binding ("auto") stays."""
    _, env = _command(server={"env_variant": "cpu", "cpus": [0, 1]})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    _, env = _command(server={"env_variant": "cpu"})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env


GIB = 2**30


def test_memory_share_on_a_gpu_of_its_own_is_vllms_default() -> None:
    gpu, _ = _command(server={"env_variant": "cuda"})
    assert gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.9"


@pytest.mark.parametrize(
    ("budget_gib", "share"),
    [
        (60, 0.75),  # 60 of 80 GiB
        (40 / 3, 0.166),  # rounded down: the budget is an upper bound
        (79, 0.9),  # never more than on a GPU of its own
    ],
)
def test_on_the_trainers_gpu_auto_takes_what_the_trainer_leaves(budget_gib: float, share: float) -> None:
    config, note = VLLMConfig().with_colocated_memory(int(budget_gib * GIB), 80 * GIB)
    assert config.gpu_memory_utilization == share
    assert note is not None and note.startswith(f"rollout.engine.gpu_memory_utilization: auto -> {share:g} (")
    kept, none = VLLMConfig(gpu_memory_utilization=0.3).with_colocated_memory(60 * GIB, 80 * GIB)
    assert kept.gpu_memory_utilization == 0.3 and none is None  # the user's figure stands


def test_too_little_left_on_the_trainers_gpu_names_the_key_and_the_ways_out() -> None:
    from core_rl.errors import CoreRLError

    with pytest.raises(CoreRLError, match=r"gpu_memory_utilization: 0 \(auto\), but .* may take 2\.0 GiB of 80\.0"):
        VLLMConfig().with_colocated_memory(2 * GIB, 80 * GIB)
    with pytest.raises(CoreRLError, match="placement.mode: split"):
        VLLMConfig().with_colocated_memory(-5 * GIB, 80 * GIB)


@pytest.mark.parametrize(("rank", "flag"), [(1, 1), (4, 8), (8, 8), (9, 16), (300, 320), (321, 512), (512, 512)])
def test_a_lora_rank_starts_the_servers_serving_adapters_of_the_least_rank_vllm_accepts(rank: int, flag: int) -> None:
    """``rollout.lora_sync: adapter`` (the factory's ``lora_rank``): LoRA on, ``--max-lora-rank`` the
    least of vLLM's accepted ranks at or above it, before ``extra_args``; without it, no LoRA flag."""
    engine = _engine(extra_args=["--x", "1"], server={"env_variant": "cpu"})
    plain = engine.server_command("/env/bin/python", 8123, 0)
    assert not any("lora" in part for part in plain)
    engine.lora_rank = rank
    argv = engine.server_command("/env/bin/python", 8123, 0)
    added = ["--enable-lora", "--max-lora-rank", str(flag), "--max-cpu-loras", "2"]
    assert argv == plain[:-2] + added + ["--x", "1"]


def test_a_lora_rank_above_what_vllm_serves_is_refused() -> None:
    from core_rl_vllm.lora import max_lora_rank

    with pytest.raises(ValueError, match="at most 512, not 513"):
        max_lora_rank(513)


def test_a_vision_language_models_servers_take_core_rls_pixels_as_they_are(tmp_path: Path) -> None:
    """A VLM's servers skip vLLM's in-model normalisation (core-rl's pixels are normalised) and its
    cache of processed images; a text model's start without either flag."""
    from core_rl.testing.tiny_vlm import build_tiny_vlm

    text = _engine(extra_args=["--x", "1"], server={"env_variant": "cpu"})
    plain = text.server_command("/env/bin/python", 8123, 0)
    assert not any("mm-" in part for part in plain)
    vlm = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    vlm.__dict__.update(text.__dict__)
    VLLMRolloutEngine._read_model(vlm, build_tiny_vlm(tmp_path / "vlm", num_heads=2))
    assert vlm.vision_language and vlm._banned and vlm._image_token in vlm._banned
    argv = vlm.server_command("/env/bin/python", 8123, 0)
    assert argv == [*plain[:-2], "--no-mm-device-do-normalize", "--mm-processor-cache-gb", "0", "--x", "1"]


def test_each_image_takes_its_run_of_placeholder_tokens() -> None:
    import torch
    from core_rl_vllm.engine import image_placeholders

    grid = torch.tensor([[1, 2, 2], [1, 4, 2], [0, 0, 0]])  # two images and a padding row
    ids = [1, 7, 9, 9, 9, 9, 8, 5, 7, 9, 9, 8, 2]
    assert image_placeholders(ids, 9, grid) == [{"offset": 2, "length": 4}, {"offset": 9, "length": 2}]
    with pytest.raises(CoreRLError, match="hold 1 runs of the image placeholder token 9 but its pixel inputs hold 2"):
        image_placeholders([1, 9, 9, 2], 9, grid)


def test_a_prompt_with_images_goes_alone_to_the_batch_route_and_placeholders_are_never_sampled(monkeypatch) -> None:
    """A vision-language model's request: its pixel inputs (encoded: core_rl_server_kit.media_wire) and each
    image's placeholder run, one item of ``/core_rl/generate``; every request of it carries a
    ``logit_bias`` banning the placeholders (kept alongside one from ``rollout.sampling.extra``)."""
    import asyncio
    import json

    import torch
    from core_rl.interfaces import SamplingParams
    from core_rl_server_kit.media_wire import decode_tensors
    from core_rl_vllm import engine as module

    sent = []
    answer = {"choices": [{"index": 0, "token_ids": [9], "logprobs": {"content": [{"logprob": -1.0}]}}]}

    async def fake_post(client, url, payload, timeout=None):
        sent.append((url, payload))
        return {"index": 0, "status": 200, "body": json.loads(json.dumps(answer))} if "core_rl" in url else answer

    monkeypatch.setattr(module, "json_post", fake_post)
    engine = _engine()
    engine.vision_language, engine._banned, engine._image_token = True, (5, 6), 5
    engine._adapters, engine._per_token_versions, engine.model_name = {}, True, "m"
    media = {"pixel_values": torch.randn(16, 96), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    sampling = SamplingParams(n=1, max_new_tokens=1, temperature=1.0, extra={"logit_bias": {"7": -2.0}})
    (done,) = asyncio.run(engine.request(None, "http://s", [1, 5, 5, 5, 5, 2], sampling, media=media))
    asyncio.run(engine.request(None, "http://s", [1, 2], SamplingParams(n=1, max_new_tokens=1, temperature=1.0)))
    (url, body), (text_url, text_payload) = sent
    assert url == "http://s/core_rl/generate" and text_url == "http://s/inference/v1/generate"
    assert done.token_ids == [9] and done.logprobs == [-1.0]
    (payload,) = body["requests"]
    assert payload["token_ids"] == [1, 5, 5, 5, 5, 2]
    assert payload["core_rl_media"]["placeholders"] == [{"offset": 1, "length": 4}]
    decoded = decode_tensors(payload["core_rl_media"]["tensors"])
    assert all(decoded[key].dtype == t.dtype and torch.equal(decoded[key], t) for key, t in media.items())
    bias = {"5": module.PLACEHOLDER_BIAS, "6": module.PLACEHOLDER_BIAS}
    assert payload["sampling_params"]["logit_bias"] == {"7": -2.0, **bias}
    assert text_payload["sampling_params"]["logit_bias"] == bias and "core_rl_media" not in text_payload
