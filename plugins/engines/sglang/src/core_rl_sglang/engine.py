"""The ``sglang`` rollout engine: SGLang servers driven over their native HTTP API.

What it sends (everything else is :class:`core_rl_server_kit.remote.ServerRolloutEngine`'s):

- generation: ``POST /generate`` with ``input_ids`` (the prompt repeated ``n`` times: one batch,
  whose common prefix SGLang's radix cache computes once), ``sampling_params`` (``max_new_tokens``,
  ``min_new_tokens``, ``temperature`` (0 for greedy), ``top_p``, ``top_k`` (-1 = off),
  ``min_p`` (0 = off, applied after top-k/top-p as the hf engine does), ``stop_token_ids``,
  ``stop`` strings where SGLang's rule for them agrees with the core's, ``json_schema`` for a
  ``response_format``: guided decoding, no free whitespace by ``--constrained-json-disable-any-whitespace``)
  and ``return_logprob``.
  A prompt with images (``media``: the pixel inputs core-rl computed, its placeholders already
  expanded in ``input_ids``) goes to ``POST /core_rl/generate`` instead, the same request with
  ``image_data`` (the tensors, base64), which the server hands to SGLang as a processed image
  (:mod:`core_rl_sglang.server_side.core_rl_sglang_media`): SGLang keeps the ids as sent and samples
  with the images embedded at their placeholder tokens. A vision-language model's image and video
  placeholder tokens are never sampled (a ``logit_bias`` of :data:`PLACEHOLDER_BIAS` on each, in
  every request of it): a placeholder in a response stands for an image the row does not have, and
  the trainer's forward refuses it. SGLang applies the bias before it computes log-probs, so a
  sampled token's log-prob is that of the logits with the placeholders masked: the model's own plus
  ``-log(1 - p)``, ``p`` the placeholders' probability at that step (0 for a model that has learnt
  not to emit them; about 0.007 for the random tiny model). The ``hf`` engine leaves them in the
  softmax.
  ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty`` (greedy too; SGLang applies
  the repetition penalty to the response's tokens only, not the prompt's, and after the other
  two, where vLLM and the hf engine cover the prompt and apply it first; on a CPU, SGLang 0.5.23
  left the repetition penalty out at some steps in some server runs when frequency or presence
  penalties were set as well: the rollout contract skips that case, naming it).
  SGLang's log-prob of a sampled token is ``log_softmax(logits / temperature)`` before
  top-k/top-p/min-p filtering: the train engine's convention (with penalties set, of the
  penalised logits, where the hf engine reports the model's own).
  Its ``meta_info.weight_versions`` spans give each token the version of the weights that sampled
  it (every weight update carries ``weight_version``), so a sample a weight update interrupted in
  place carries both versions;
- pause/resume: ``POST /pause_generation`` (``keep`` -> mode ``retract``, ``abort`` -> ``abort``)
  and ``POST /continue_generation``;
- weights from disk: ``POST /update_weights_from_disk`` (SGLang flushes its cache);
- weights over a collective: ``POST /init_weights_update_group`` once, then per update
  ``/begin_weight_update``, ``/update_weights_from_distributed`` once per bucket of about
  ``update_bucket_mb`` (the trainer broadcasts meanwhile; the last flushes the cache and sets the
  version) and ``/end_weight_update``; a vision-language model's tensors are named as SGLang's
  model loads them (:func:`served_name`: transformers' ``model.visual.*`` and
  ``model.language_model.*`` are SGLang's ``visual.*`` and ``model.*``, as in the checkpoints a disk
  update writes);
- the sync check (``rollout.sync_check``): ``GET /model_info`` (the weight version served) and
  ``POST /get_weights_by_name`` for the first rows of every tensor the last update sent
  (:mod:`core_rl_sglang.fingerprints`);
- LoRA adapters (``rollout.lora_sync: adapter``; servers started with a ``lora_rank``): a weight
  directory is an adapter, loaded under a new name per version with the version labelled, which
  ``/generate`` requests then name in ``lora_path`` (:mod:`core_rl_sglang.lora`);
- sleeping while the trainer trains (``rollout.sleep_while_training``; servers started with
  ``--enable-memory-saver``): ``POST /release_memory_occupation`` with tags ``kv_cache``,
  ``weights`` and ``cuda_graph`` after generation, then ``POST /resume_memory_occupation`` with
  ``weights`` before the weight update and with ``kv_cache`` and ``cuda_graph`` before the next
  generation. The weights are dropped, not copied to host memory (SGLang keeps no copy without
  ``--enable-weights-cpu-backup``): every weight update core-rl sends holds every weight.
"""

from __future__ import annotations

import base64
import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import core_rl_server_kit.media_wire
from core_rl.config.schema import RolloutConfig
from core_rl.interfaces import SamplingParams
from core_rl.interfaces.sampling import required_json_schema, with_extra
from core_rl.vision.models import placeholder_ids
from core_rl_server_kit.media_wire import encode_tensors
from core_rl_server_kit.remote import Completion, ServerReplyError, ServerRolloutEngine, json_post, versions_from_spans
from core_rl_server_kit.remote.engine import FORK_ENGINE

from core_rl_sglang import fingerprints, lora
from core_rl_sglang.config import SGLangConfig
from core_rl_sglang.wire import checked_post

if TYPE_CHECKING:
    import torch

#: --mem-fraction-static on CPU: the share of free RAM SGLang may take; a small one fails the server when
#: free RAM drops by more than it while the model loads (see SGLangConfig)
CPU_MEM_FRACTION = 0.3
#: --max-total-tokens on CPU (KV-cache tokens) unless set
CPU_MAX_TOTAL_TOKENS = 8192
SERVER_SIDE = Path(__file__).with_name("server_side")
#: ``python -m sglang.launch_server`` with the scheduler and detokenizer forked where that is safe
#: (:mod:`core_rl_sglang.server_side.core_rl_sglang_server`)
LAUNCHER = "core_rl_sglang_server"
# keep -> retract: running requests go back to the queue with what they generated and continue after
# the pause (their KV cache is recomputed), which lets a weight update flush the cache meanwhile
PAUSE_MODE = {"keep": "retract", "abort": "abort"}
#: SGLang's memory tags for each part of core-rl's release (core_rl.interfaces.MEMORY_PARTS)
MEMORY_TAGS = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}


#: core-rl's route for requests with pixel inputs (:mod:`core_rl_sglang.server_side.core_rl_sglang_media`)
MEDIA_ROUTE = "/core_rl/generate"
#: a vision-language model's parameter names in transformers (in memory, as a train engine sends
#: them) -> in SGLang's model (and in the checkpoints transformers writes), by prefix, first match
SERVED_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "model."))


#: the logit bias that keeps a vision-language model's placeholder tokens from being sampled
PLACEHOLDER_BIAS = -1.0e9


def served_name(name: str) -> str:
    """The name SGLang's vision-language model loads the tensor ``name`` under (:data:`SERVED_PREFIXES`)."""
    for hf, served in SERVED_PREFIXES:
        if name.startswith(hf):
            return served + name[len(hf) :]
    return name


#: SGLang's cache of image embeddings (keyed by the pixels' hash), off: SGLang 0.5.23 keeps it across
#: weight updates (its cache flush resets the prefix cache only), so after a sync a prompt whose
#: image it had seen was sampled with the old vision tower's embeddings (measured: log-probs 0.05 to
#: 0.1 off the new model's after a disk update of the tower). The prefix cache, flushed at every
#: update, still spares the n samples of a prompt their second encoding.
NO_IMAGE_EMBEDDING_CACHE = {"SGLANG_VLM_CACHE_SIZE_MB": "0"}

#: SGLang's diagnostics before a crash, off (see :meth:`SGLangRolloutEngine.server_environment`)
NO_CRASH_DIAGNOSTICS = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class SGLangRolloutEngine(ServerRolloutEngine):
    """Generates through ``rollout.engine.server.num_servers`` SGLang servers (or given URLs)."""

    env_name = "sglang"
    health_path = "/health"
    guided_decoding = True  # response_format: the request's json_schema (SGLang's grammar backend)
    #: > 0: the servers return each position's routed experts, of this top-k (routing replay)
    routes_top_k: int = 0
    lora_rank: int = 0  #: > 0: the servers serve LoRA adapters up to this rank (:mod:`core_rl_sglang.lora`)
    #: a vision-language model: collective updates rename its tensors (:func:`served_name`), its
    #: placeholders are never sampled, its servers keep no image-embedding cache
    vision_language: bool = False
    _banned: tuple[int, ...] = ()  #: the tokens no response may hold (a vision-language model's placeholders)

    def __init__(
        self,
        model_path: str | Path,
        config: SGLangConfig,
        run_dir: str | Path,
        *,
        sleep: bool = False,
        trust_remote_code: bool = False,
        lora_rank: int = 0,
        return_routed_experts: bool = False,
    ) -> None:
        self.config = config
        self.lora_rank = lora_rank
        #: the servers return each position's routed experts (routing replay): the model's top-k
        self.routes_top_k = moe_top_k(model_path, trust_remote_code) if return_routed_experts else 0
        self._adapters: dict[str, str] = {}  # server URL -> the adapter name it serves
        #: the name and shape of every tensor the last full-weight update sent (the sync check reads them back)
        self._synced: dict[str, list[int]] = {}
        from core_rl.vision.models import is_vision_language

        self.vision_language = is_vision_language(model_path)
        self._banned = tuple(placeholder_ids(model_path)) if self.vision_language else ()
        super().__init__(model_path, config.server, run_dir, sleep=sleep, trust_remote_code=trust_remote_code)

    # -- the server -----------------------------------------------------------------------------

    def server_command(self, python: str, port: int, index: int) -> list[str]:
        c = self.config
        cpu = self.variant() == "cpu"
        argv = [
            python,
            "-m",
            LAUNCHER,
            "--model-path",
            self.model_path,
            "--host",
            self.options.host,
            "--port",
            str(port),
            "--dtype",
            c.dtype,
            "--random-seed",
            str(c.random_seed + index),
            "--tp-size",
            str(c.tp_size),
            "--dp-size",
            str(c.dp_size),
            "--skip-server-warmup",
            # guided JSON (response_format) without free whitespace (json.dumps's separators)
            "--constrained-json-disable-any-whitespace",
        ]
        if c.context_length:
            argv += ["--context-length", str(c.context_length)]
        if c.max_running_requests:
            argv += ["--max-running-requests", str(c.max_running_requests)]
        if cpu:
            argv += ["--device", "cpu"]
        attention = c.attention_backend or ("torch_native" if cpu else "")
        sampling = c.sampling_backend or ("pytorch" if cpu else "")
        if attention:
            argv += ["--attention-backend", attention]
        if sampling:
            argv += ["--sampling-backend", sampling]
        fraction = c.mem_fraction_static or (CPU_MEM_FRACTION if cpu else 0.0)
        if fraction:
            argv += ["--mem-fraction-static", f"{fraction:g}"]
        total_tokens = c.max_total_tokens or (CPU_MAX_TOTAL_TOKENS if cpu else 0)
        if total_tokens:
            argv += ["--max-total-tokens", str(total_tokens)]
        if not c.enable_prefix_caching:
            argv.append("--disable-radix-cache")
        if c.chunked_prefill_size:
            argv += ["--chunked-prefill-size", str(c.chunked_prefill_size)]
        if c.disable_overlap_schedule or cpu:
            argv.append("--disable-overlap-schedule")
        if c.sleep_on_idle:
            argv.append("--sleep-on-idle")
        if self.sleeps:
            argv.append("--enable-memory-saver")
        if self.trust_remote_code:
            argv.append("--trust-remote-code")
        if self.routes_top_k:
            argv.append("--enable-return-routed-experts")
        return argv + lora.server_args(self.lora_rank, cpu) + list(c.extra_args)

    def server_environment(self, index: int) -> dict[str, str]:
        # Stopping a server ends its scheduler too, which SGLang takes for a crash: by default it
        # then waits 5 s to dump the scheduler's stacks (py-spy, CUDA core dumps), on every stop
        # and restart. ``server.env`` can turn these back on.
        env = {"PYTHONPATH": str(SERVER_SIDE), **NO_CRASH_DIAGNOSTICS}
        if self.vision_language:
            env.update(NO_IMAGE_EMBEDDING_CACHE)
            env["CORE_RL_MEDIA_WIRE_PY"] = str(Path(core_rl_server_kit.media_wire.__file__).resolve())
        c = self.config
        if self.variant() == "cpu" and c.tp_size * c.dp_size == 1:
            # its scheduler and detokenizer are forked, not spawned: no second and third import of
            # SGLang (~11 s of every start on an idle machine)
            env[FORK_ENGINE] = "1"
        if self.variant() == "cpu" and (self.lora_rank or self.routes_top_k):
            env[lora.PINLESS_VARIABLE] = "1"  # pinned and registered host memory made ordinary
        return env

    def workers_per_server(self) -> int:
        return self.config.tp_size * self.config.dp_size

    # -- HTTP calls -----------------------------------------------------------------------------

    def _stops_natively(self, sampling: SamplingParams) -> bool:
        """Whether SGLang gets ``sampling.stop``: it must never stop before the core's cut
        (:mod:`core_rl.rollout.stop_strings`), which the rollout controller makes anyway. SGLang matches
        stop strings from the first token on, ignoring ``min_new_tokens``, and in text that
        spells special tokens out (``<pad>``), so it gets them only without ``min_new_tokens``
        and when no stop string occurs in a special token's text."""
        if not sampling.stop or sampling.min_new_tokens > 0:
            return False
        return not any(stop in text for stop in sampling.stop for text in self._special_texts)

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        """The texts of the served tokenizer's special tokens."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        return tuple(tokenizer.all_special_tokens)

    async def request(
        self,
        client: Any,
        url: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        media: Mapping[str, Any] | None = None,
    ) -> list[Completion]:
        params = {
            "max_new_tokens": sampling.max_new_tokens,
            "min_new_tokens": sampling.min_new_tokens,
            "temperature": 0.0 if sampling.greedy else sampling.temperature,
            "top_p": 1.0 if sampling.greedy else sampling.top_p,
            "top_k": -1 if sampling.greedy or sampling.top_k <= 0 else sampling.top_k,
            "min_p": 0.0 if sampling.greedy else sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "presence_penalty": sampling.presence_penalty,
            "stop_token_ids": list(sampling.stop_token_ids),
            "skip_special_tokens": bool(sampling.stop),
            "no_stop_trim": True,
            **({"stop": list(sampling.stop)} if self._stops_natively(sampling) else {}),
        }
        if sampling.response_format is not None:  # guided decoding: the schema, as text
            params["json_schema"] = json.dumps(required_json_schema(sampling.response_format))
        params = with_extra(params, sampling, "sglang", SGLangConfig.request_keys)
        if self._banned:  # a vision-language model's placeholders are never sampled
            params["logit_bias"] = {**params.get("logit_bias", {}), **{str(t): PLACEHOLDER_BIAS for t in self._banned}}
        payload = {
            "input_ids": [list(prompt_ids)] * sampling.n,
            "sampling_params": params,
            "return_logprob": True,
            **({"return_routed_experts": True} if self.routes_top_k else {}),
        }
        if url in self._adapters:
            payload["lora_path"] = self._adapters[url]
        route = "/generate"
        if media:  # the prompt's images, one copy per sample of the batch
            payload["image_data"] = [encode_tensors(media)] * sampling.n
            route = MEDIA_ROUTE
        body = await json_post(client, url + route, payload)
        try:
            return [_completion(item, self.routes_top_k) for item in (body if isinstance(body, list) else [body])]
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ServerReplyError(f"unexpected /generate answer from {url}: {exc}: {str(body)[:300]}") from None

    async def pause_server(self, client: Any, url: str, mode: str) -> None:
        await json_post(client, url + "/pause_generation", {"mode": PAUSE_MODE[mode]})

    async def resume_server(self, client: Any, url: str) -> None:
        await json_post(client, url + "/continue_generation", {})

    async def abort_all(self, client: Any, url: str) -> None:
        await json_post(client, url + "/abort_request", {"abort_all": True})

    async def release_server(self, client: Any, url: str) -> None:
        tags = [tag for part in MEMORY_TAGS.values() for tag in part]
        await json_post(client, url + "/release_memory_occupation", {"tags": tags})

    async def restore_server(self, client: Any, url: str, parts: tuple[str, ...]) -> None:
        tags = [tag for part in parts for tag in MEMORY_TAGS[part]]
        await json_post(client, url + "/resume_memory_occupation", {"tags": tags})

    async def reload_from_disk(self, client: Any, url: str, path: str, version: int) -> None:
        timeout = self.options.weight_sync_timeout
        if self.lora_rank:  # rollout.lora_sync: adapter
            self._adapters[url] = await lora.load_version(client, url, str(path), version, timeout)
            return
        self._synced = fingerprints.synced_shapes(path)
        try:
            await checked_post(
                client,
                url + "/update_weights_from_disk",
                {"model_path": str(path), "weight_version": str(version)},
                timeout,
            )
        except ServerReplyError as exc:
            if exc.status != 400 or "cache was not flushed" not in str(exc):
                raise
            # SGLang loaded the weights but had not yet retired a finished request, so it kept the
            # prefix cache; flush it once nothing runs (a failure here is an error naming the server)
            await json_post(client, f"{url}/flush_cache?timeout={timeout:g}", timeout=timeout + 30)

    async def join_weight_group(
        self, client: Any, url: str, *, address: str, port: int, rank_offset: int, world_size: int, backend: str
    ) -> None:
        await checked_post(
            client,
            url + "/init_weights_update_group",
            {
                "master_address": address,
                "master_port": port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": self._group_name,
                "backend": backend,
            },
            self.options.weight_sync_timeout,
        )

    async def receive_weights(
        self, client: Any, url: str, *, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int
    ) -> None:
        timeout = self.options.weight_sync_timeout
        self._synced = dict(zip(names, (list(s) for s in shapes)))
        await checked_post(client, url + "/begin_weight_update", {}, timeout)
        sent = [served_name(n) for n in names] if self.vision_language else list(names)
        requests = update_requests(sent, dtypes, shapes, int(self.config.update_bucket_mb * 2**20))
        for i, request in enumerate(requests):
            last = i == len(requests) - 1  # the cache is flushed and the version set once, at the end
            request.update(group_name=self._group_name, flush_cache=last)
            if last:
                request["weight_version"] = str(version)
            await checked_post(client, url + "/update_weights_from_distributed", request, timeout)
        await checked_post(client, url + "/end_weight_update", {}, timeout)

    # -- the sync check -------------------------------------------------------------------------

    #: the check reads back each tensor's first rows only (:mod:`core_rl_sglang.fingerprints`)
    fingerprint_prefix = fingerprints.FINGERPRINT_PREFIX

    def _held_dtype(self) -> torch.dtype | None:
        """The dtype the servers hold floating weights in (``dtype``); ``None`` for ``auto``."""
        import torch

        return None if self.config.dtype == "auto" else getattr(torch, self.config.dtype)

    async def fingerprints_of(self, client: Any, url: str, version: int) -> dict[str, dict[str, float]] | None:
        """The fingerprints of the server's parameters of the tensors the last update sent, read
        back with ``/get_weights_by_name`` (:func:`core_rl_sglang.fingerprints.server_fingerprints`),
        as ``model``; with ``rollout.lora_sync: adapter``, those of the files of the adapter
        directory the server loaded under this version's name
        (:func:`core_rl_sglang.lora.adapter_fingerprints`), as ``adapter``. ``None`` (the check is
        skipped) with ``dtype: auto`` (the dtype the server chose is not reported) or for a model
        SGLang cannot answer for."""
        timeout = self.options.weight_sync_timeout
        if self.lora_rank:
            prints = await lora.adapter_fingerprints(client, url, version, timeout, self.fingerprint_prefix)
            return {"adapter": prints}
        dtype = self._held_dtype()
        if dtype is None:
            return None
        # a budget of tensors per check (sync_check_elements); the rest count as received, unread (NaN)
        shapes = fingerprints.checked_share(self._synced, version, self.config.sync_check_elements)
        prints = await fingerprints.server_fingerprints(client, url, shapes, version, dtype, timeout)
        if prints:
            prints = {name: prints.get(name, math.nan) for name in self._synced}
        return None if prints is None else {"model": prints}

    def fingerprint_dtypes(self, names: list[str], dtypes: list[Any], mode: str) -> list[Any]:
        """The servers' dtype for every floating weight, whatever the mode: the check reads back
        what they hold; an adapter's tensors as they are in its files (the check reads those)."""
        held = None if self.lora_rank else self._held_dtype()
        return [held if held is not None and d.is_floating_point else d for d in dtypes]


def update_requests(
    names: list[str], dtypes: list[str], shapes: list[list[int]], bucket_bytes: int
) -> list[dict[str, Any]]:
    """The ``names``/``dtypes``/``shapes`` of one collective update split, in order, into requests
    of about ``bucket_bytes`` of weights each (:func:`core_rl.sync.buckets.bucketed`, on
    meta tensors); one request for 0. The trainer broadcasts the tensors in the same order, each
    received by the request that lists it."""
    if bucket_bytes <= 0:
        return [{"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes]}]
    import torch
    from core_rl.sync.buckets import bucketed

    meta = ((n, torch.empty(s, dtype=getattr(torch, d), device="meta")) for n, d, s in zip(names, dtypes, shapes))
    return [
        {
            "names": list(bucket),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
            "shapes": [list(t.shape) for t in bucket.values()],
        }
        for bucket in bucketed(meta, bucket_bytes)
    ]


def _completion(item: dict[str, Any], routes_top_k: int = 0) -> Completion:
    """One ``/generate`` answer; with ``routes_top_k``, its ``meta_info.routed_experts`` (base64 of
    int32 ``[positions, layers, top_k]``, flat) as :attr:`Completion.routes`."""
    meta = item["meta_info"]
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"unknown finish reason {reason!r}")
    entries = meta.get("output_token_logprobs") or []
    token_ids = [int(t) for t in item["output_ids"]]
    if len(entries) != len(token_ids):
        raise ValueError(f"{len(token_ids)} output ids but {len(entries)} log-probs")
    return Completion(
        token_ids=token_ids,
        logprobs=[float(e[0]) for e in entries],
        finish_reason=str(kind),
        versions=versions_from_spans(meta.get("weight_versions"), len(token_ids)),
        routes=_routes(meta.get("routed_experts"), routes_top_k, meta) if routes_top_k else None,
    )


def _routes(encoded: Any, top_k: int, meta: dict[str, Any]) -> Any:
    """SGLang's routed experts (base64 of little-endian int32, ``[positions, layers, top_k]`` flat,
    one position per token fed to the model: the prompt's and every output token's but the last)."""

    import numpy as np

    if not isinstance(encoded, str):
        raise ValueError(
            "no routed_experts in the answer (was the server started with --enable-return-routed-experts?)"
        )
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    positions = int(meta["prompt_tokens"]) + int(meta["completion_tokens"]) - 1
    if positions <= 0 or flat.size % (positions * top_k):
        raise ValueError(f"{flat.size} routed experts for {positions} positions of top-{top_k}")
    return flat.reshape(positions, -1, top_k).copy()


def moe_top_k(model_path: str | Path, trust_remote_code: bool) -> int:
    """The top-k of a mixture-of-experts model's routers (its config's ``num_experts_per_tok``); a
    :class:`~core_rl.errors.ConfigError` for a model without one."""
    from core_rl.errors import ConfigError
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    top_k = getattr(getattr(config, "text_config", config), "num_experts_per_tok", 0)
    if not top_k:
        raise ConfigError(
            [
                f"rollout.return_routed_experts (or actor.moe.routing_replay: rollout): {model_path} is "
                f"{type(config).__name__}, not a mixture-of-experts model; set actor.moe.routing_replay: off"
            ]
        )
    return int(top_k)


def make_engine(
    rollout: RolloutConfig,
    engine_config: SGLangConfig | None,
    *,
    model_path: str,
    run_dir: Path,
    trust_remote_code: bool = False,
    lora_rank: int = 0,
) -> SGLangRolloutEngine:
    """The registered factory (sampling comes with each request): the servers start able to
    release their memory when ``rollout.sleep_while_training`` is ``True`` (as the trainer
    resolved it; ``auto`` is off), with ``--trust-remote-code`` when ``trust_remote_code``
    (``actor.trust_remote_code``), serving LoRA adapters up to ``lora_rank`` (``actor.lora.rank``
    with ``rollout.lora_sync: adapter``), and returning routed experts with
    ``rollout.return_routed_experts`` (routing replay)."""
    config = engine_config if engine_config is not None else SGLangConfig()
    sleep, trust = rollout.sleep_while_training is True, trust_remote_code
    routes = getattr(rollout, "return_routed_experts", False)
    return SGLangRolloutEngine(
        model_path,
        config,
        run_dir,
        sleep=sleep,
        trust_remote_code=trust,
        lora_rank=lora_rank,
        return_routed_experts=routes,
    )
