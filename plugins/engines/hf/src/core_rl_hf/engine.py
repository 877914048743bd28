"""The ``hf`` rollout engine: a transformers causal LM held in this process.

``generate`` orders prompts by length (so a chunk's prompts need little padding), splits the
``len(prompts) * n`` samples into chunks of at most ``max_batch_size`` (:func:`plan_chunks`),
generates each chunk with :func:`core_rl_hf.generation.generate_batch` (one prefill per distinct
prompt of the chunk), and returns the samples in prompt order.

``agenerate`` (per request) queues the request for a worker thread, which takes everything queued
(up to ``max_batch_size`` samples), groups it by sampling settings and generates each group as one
``generate`` batch: concurrent requests are batched together as a server would batch them.
``pause`` stops generation: with ``abort`` the batch running stops after its current token and its
unfinished samples are continued after ``resume`` from the tokens they had (those later tokens carry
the weight version then loaded, in ``Sample.token_weight_versions``); with ``wait`` or ``keep`` the
batch running finishes first. Generation asked for while paused waits for ``resume``.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import torch
from core_rl.checkpoint.files import generator_state, set_generator_state
from core_rl.config.schema import RolloutConfig
from core_rl.errors import ConfigError
from core_rl.interfaces import PAUSE_MODES, RolloutEngine, SamplingParams
from core_rl.interfaces.sampling import batch_key
from core_rl.protocol import Sample
from core_rl.reliability import awaitable_error
from core_rl.roles.hf import no_progress_bars
from core_rl.sync.buckets import state_items
from core_rl.sync.fingerprint import FingerprintLog
from core_rl.vision.models import auto_model_class
from core_rl_train_kit import attention
from core_rl_train_kit.moe import is_moe

from core_rl_hf.config import GPU_SYNC_EVERY, HFRolloutConfig, resolve_device
from core_rl_hf.decode import lean_supported
from core_rl_hf.generation import Completion, generate_batch
from core_rl_hf.graphs import DecodeGraphs
from core_rl_hf.memory import keep_freed_memory, release_host_memory
from core_rl_hf.sampling import check_sampling
from core_rl_hf.vision_generation import generate_with_images
from core_rl_hf.weights import copy_buckets, load_full_state_dict, read_safetensors_dir

#: how long a generate call waits for ``resume`` after ``pause``
RESUME_TIMEOUT_S = 3600.0
#: the profiler label of each generated chunk (in the thread that generates it): on a GPU sampling
#: runs inside a CUDA graph, so no sampling operator marks generation in a ``trainer.profile`` trace
PROFILE_LABEL = "hf_rollout.generate"


def _ids(value: Any) -> list[int]:
    """``None``, an int or a list of ints -> a list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def special_token_ids(model: Any, tokenizer: Any | None) -> tuple[list[int], int]:
    """``(eos_token_ids, pad_token_id)``.

    EOS ids: the union of the model's generation config ``eos_token_id`` (an int or a list) and
    the tokenizer's ``eos_token_id``. Pad id (only a filler under a zero attention mask): the
    tokenizer's, else the generation config's, else the first EOS id, else 0.
    """
    gen = getattr(model, "generation_config", None)
    eos = _ids(getattr(gen, "eos_token_id", None)) or _ids(getattr(model.config, "eos_token_id", None))
    if tokenizer is not None:
        eos += _ids(tokenizer.eos_token_id)
    eos = sorted(set(eos))
    pads = _ids(getattr(tokenizer, "pad_token_id", None)) + _ids(getattr(gen, "pad_token_id", None)) + eos
    return eos, (pads[0] if pads else 0)


def plan_chunks(prompt_lengths: Sequence[int], n: int, max_batch_size: int) -> list[list[tuple[int, int]]]:
    """Split the ``n`` samples of every prompt into as few chunks of at most ``max_batch_size``
    samples as possible.

    Returns chunks of ``(prompt index, count)``: the samples of all prompts, prompts ordered by
    length (so a chunk holds prompts of similar lengths), laid end to end and cut every
    ``max_batch_size`` samples: ``ceil(len(prompts) * n / max_batch_size)`` chunks, a prompt's
    samples possibly spread over consecutive chunks. Every prompt gets exactly ``n`` samples.
    """
    chunks: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    room = max_batch_size
    for i in sorted(range(len(prompt_lengths)), key=lambda i: prompt_lengths[i]):
        left = n
        while left:
            take = min(left, room)
            current.append((i, take))
            left, room = left - take, room - take
            if room == 0:
                chunks.append(current)
                current, room = [], max_batch_size
    if current:
        chunks.append(current)
    return chunks


class HFRolloutEngine(RolloutEngine):
    """Generates with a transformers ``AutoModelForCausalLM`` loaded from ``model_path`` (running the
    directory's own modelling code only with ``trust_remote_code``)."""

    def __init__(
        self,
        model_path: str | Path,
        config: HFRolloutConfig,
        *,
        trust_remote_code: bool = False,
        return_routed_experts: bool = False,
    ) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.device = resolve_device(config.device)
        #: rollout.engine.host_memory resolved: ``reuse`` on a CPU, ``release`` elsewhere (core_rl_hf.memory)
        self.host_memory = config.host_memory or ("reuse" if self.device.type == "cpu" else "release")
        if self.host_memory == "reuse":
            keep_freed_memory()
        self.compute_dtype = getattr(torch, config.autocast_dtype) if config.autocast_dtype else None
        load: dict[str, Any] = {"trust_remote_code": True} if trust_remote_code else {}
        if self.compute_dtype is not None and self.device.type == "cpu":
            load["attn_implementation"] = attention.register()  # the fsdp engine's autocast attention
        with no_progress_bars():
            model = auto_model_class(model_path).from_pretrained(model_path, dtype=getattr(torch, config.dtype), **load)
        self._model: torch.nn.Module | None = model.to(self.device).eval()
        if return_routed_experts and not is_moe(model):
            raise ConfigError(
                f"rollout.return_routed_experts (or actor.moe.routing_replay: rollout): {model_path} holds "
                f"{type(model).__name__}, which has no mixture-of-experts routers; set actor.moe.routing_replay: none"
            )
        #: samples carry the experts each token was routed to (core_rl_train_kit.moe)
        self.return_routed_experts = return_routed_experts
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):  # a weights-only directory: fall back to the model's config
            tokenizer = None
        self.tokenizer = tokenizer  # stop strings (core_rl_hf.stop_check)
        self.eos_token_ids, self.pad_token_id = special_token_ids(model, tokenizer)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.graphs = self._decode_graphs(config, model)
        self.sync_every = config.sync_every or (1 if self.device.type == "cpu" else GPU_SYNC_EVERY)
        self.generator: torch.Generator | None = None
        if config.seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._weight_version = 0
        #: the names the last weight update wrote and its version, for the sync check (:meth:`weight_fingerprints`)
        self._loaded: tuple[list[str], int] | None = None
        self._model_lock = threading.RLock()  # one batch or weight update at a time
        self._requests: queue.Queue[_Request | None] = queue.Queue()
        self._idle = threading.Condition()  # guards _paused and _active
        self._paused = False
        self._active = 0  # generate calls running on the model
        self._abort = threading.Event()  # set by pause("abort"): running batches stop early
        self._worker: threading.Thread | None = None

    def _decode_graphs(self, config: HFRolloutConfig, model: torch.nn.Module) -> DecodeGraphs | None:
        """The CUDA graph cache when ``cuda_graphs`` asks for it (``null``: where it applies)."""
        lean = config.decoder == "auto" and lean_supported(model)
        if config.cuda_graphs is None:
            return DecodeGraphs() if self.device.type == "cuda" and lean else None
        if not config.cuda_graphs:
            return None
        if self.device.type != "cuda":
            raise ConfigError(
                f"rollout.engine.cuda_graphs: true, but the engine generates on {self.device} (rollout.engine.device: "
                f"{config.device!r}); CUDA graphs need a CUDA device: set cuda_graphs to null or false"
            )
        if not lean:
            raise ConfigError(
                f"rollout.engine.cuda_graphs: true needs the lean decoder (rollout.engine.decoder: auto and a Llama or "
                f"Qwen2 model); this is {type(model).__name__} with decoder {config.decoder!r}: set cuda_graphs to "
                "null or false"
            )
        return DecodeGraphs(required=True)

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            raise RuntimeError("the hf rollout engine is closed")
        return self._model

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        media: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
    ) -> list[list[Sample]]:
        check_sampling(sampling)
        self._check_prompts(prompts)
        if media is not None and any(m is not None for m in media):
            return self._generate_with_images(prompts, sampling, media)
        release = self.host_memory == "release"
        with self._running():
            if release:  # the update's activations are freed: give their pages back first
                release_host_memory()
            groups = self._generate_locked(prompts, sampling)
            if release:  # the KV cache is freed: give free pages back before the update
                release_host_memory()
        aborted = [s for group in groups for s in group if s.finish_reason == "abort"]
        while aborted:
            aborted = self._continue(aborted, sampling)
        return groups

    def _generate_with_images(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        media: Sequence[Mapping[str, torch.Tensor] | None],
    ) -> list[list[Sample]]:
        """Prompts with images (:mod:`core_rl_hf.vision_generation`): never interrupted by a pause
        (``abort`` waits for them, as ``wait`` does)."""
        if len(media) != len(prompts):
            raise ValueError(f"{len(media)} media entries for {len(prompts)} prompts")
        with self._running():
            groups = generate_with_images(
                self.model,
                prompts,
                media,
                sampling,
                eos_token_ids=self.eos_token_ids,
                pad_token_id=self.pad_token_id,
                generator=self.generator,
            )
        return self._samples(prompts, groups)

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Wait while paused (up to :data:`RESUME_TIMEOUT_S`), then hold the model."""
        with self._idle:
            if not self._idle.wait_for(lambda: not self._paused, timeout=RESUME_TIMEOUT_S):
                raise TimeoutError(f"hf rollout engine: not resumed within {RESUME_TIMEOUT_S:.0f} s of pause()")
            self._active += 1
        try:
            with self._model_lock:
                yield
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def _continue(self, aborted: list[Sample], sampling: SamplingParams) -> list[Sample]:
        """Continue samples interrupted by ``pause("abort")`` (in place) with the weights loaded
        since; returns those interrupted again."""
        by_budget: dict[int, list[Sample]] = {}
        for s in aborted:
            by_budget.setdefault(sampling.max_new_tokens - len(s.response_ids), []).append(s)
        again: list[Sample] = []
        with self._running():
            for left, samples in by_budget.items():
                rest = attrs.evolve(
                    sampling,
                    n=1,
                    max_new_tokens=left,
                    min_new_tokens=max(0, sampling.min_new_tokens - sampling.max_new_tokens + left),
                )
                contexts = [s.prompt_ids + s.response_ids for s in samples]
                more = self._generate_locked(contexts, rest, generated=[len(s.response_ids) for s in samples])
                for s, (m,) in zip(samples, more):
                    s.token_weight_versions = s.versions + m.versions
                    s.response_ids = s.response_ids + m.response_ids
                    s.logprobs = s.logprobs + m.logprobs
                    s.finish_reason = m.finish_reason
                    if m.routed_experts is not None:  # the continuation's prefill ran over the whole context
                        s.routed_experts = m.routed_experts
                    if m.finish_reason == "abort":
                        again.append(s)
        return again

    def _generate_locked(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, generated: Sequence[int] | None = None
    ) -> list[list[Sample]]:
        """``sampling.n`` samples of each prompt; ``generated``: per prompt, how many of its last
        tokens are a continued sample's response so far (for the penalties)."""
        completions: list[list[Completion]] = [[] for _ in prompts]
        lengths = [len(p) for p in prompts]
        for chunk in plan_chunks(lengths, sampling.n, self.config.max_batch_size):
            with torch.profiler.record_function(PROFILE_LABEL):  # generation in a trainer.profile trace
                outs = self._generate_chunk(prompts, chunk, sampling, generated)
            for (i, _), out in zip(chunk, outs):
                completions[i].extend(out)
        return self._samples(prompts, completions)

    def _samples(self, prompts: Sequence[Sequence[int]], groups: Sequence[Sequence[Completion]]) -> list[list[Sample]]:
        """Each prompt's completions as samples of the weights now loaded."""
        return [
            [
                Sample(
                    prompt_ids=list(prompt),
                    response_ids=c.token_ids,
                    logprobs=c.logprobs,
                    weight_version=self._weight_version,
                    finish_reason=c.finish_reason,
                    routed_experts=c.routed_experts,
                )
                for c in group
            ]
            for prompt, group in zip(prompts, groups)
        ]

    def _generate_chunk(
        self,
        prompts: Sequence[Sequence[int]],
        chunk: list[tuple[int, int]],
        sampling: SamplingParams,
        generated: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        return generate_batch(
            self.model,
            [prompts[i] for i, _ in chunk],
            [count for _, count in chunk],
            sampling,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            generator=self.generator,
            interrupted=self._abort.is_set,
            lean=self.config.decoder == "auto",
            compute_dtype=self.compute_dtype,
            sync_every=self.sync_every,
            graphs=self.graphs,
            max_rows=self.config.max_batch_size,
            decode_text=self._decode_text if self.tokenizer is not None else None,
            generated=None if generated is None else [generated[i] for i, _ in chunk],
            record_routes=self.return_routed_experts,
            compile_steps=self.config.compile,
        )

    def _decode_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    async def agenerate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, media: Mapping[str, torch.Tensor] | None = None
    ) -> list[Sample]:
        check_sampling(sampling)
        self._check_prompts([prompt_ids])
        future: Future[list[Sample]] = Future()
        self._ensure_worker()
        self._requests.put(_Request(list(prompt_ids), sampling, future, media))
        return await asyncio.wrap_future(future)

    def _ensure_worker(self) -> None:
        with self._idle:
            if self._worker is None:
                self.model  # noqa: B018  (raises if closed)
                self._worker = threading.Thread(target=self._serve, name="hf-rollout-worker", daemon=True)
                self._worker.start()

    def _serve(self) -> None:
        """The worker: take what is queued, generate it in batches, hand out the results."""
        while True:
            first = self._requests.get()
            if first is None:
                return
            batch = [first]
            samples = first.sampling.n
            while samples < self.config.max_batch_size:
                try:
                    item = self._requests.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._requests.put(None)
                    break
                batch.append(item)
                samples += item.sampling.n
            try:
                self._run_batch(batch)
            except BaseException as exc:  # the worker lives on; its callers get the error, never a wait without end
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(awaitable_error(exc))

    def _run_batch(self, batch: list[_Request]) -> None:
        groups: dict[tuple, list[_Request]] = {}
        for request in batch:
            groups.setdefault(batch_key(request.sampling), []).append(request)
        for requests in groups.values():
            # a request its caller cancelled (e.g. a rollout controller closing) is not generated
            requests = [r for r in requests if r.future.set_running_or_notify_cancel()]
            if not requests:
                continue
            try:
                media = [r.media for r in requests]
                with_media = {"media": media} if any(m is not None for m in media) else {}
                out = self.generate([r.prompt_ids for r in requests], requests[0].sampling, **with_media)
            except BaseException as exc:
                for r in requests:
                    r.future.set_exception(awaitable_error(exc))
                continue
            for r, samples in zip(requests, out):
                r.future.set_result(samples)

    def pause(self, mode: str = "wait") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        with self._idle:
            self._paused = True
            if mode == "abort":
                self._abort.set()
            if not self._idle.wait_for(lambda: self._active == 0, timeout=600):
                raise TimeoutError("hf rollout engine: the batch running did not finish within 600 s of pause()")
            self._abort.clear()

    def resume(self) -> None:
        with self._idle:
            self._paused = False
            self._idle.notify_all()

    def health(self) -> dict[str, bool]:
        alive = self._model is not None and (self._worker is None or self._worker.is_alive())
        return {"hf": alive}

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        with self._model_lock:
            load_full_state_dict(self.model, state_dict)
            self._weight_version = version
            self._fingerprint_loaded(list(state_dict), version)

    def update_weights_from_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """Copy each bucket into the model's parameters in place (:func:`core_rl_hf.weights.copy_buckets`):
        a train engine on this engine's device hands over device tensors, and nothing goes through host memory."""
        names: list[str] = []

        def named(stream: Iterable[Mapping[str, torch.Tensor]]) -> Iterator[Mapping[str, torch.Tensor]]:
            for bucket in stream:
                names.extend(bucket)
                yield bucket
                del bucket  # not held while the next one is gathered

        with self._model_lock:
            copy_buckets(self.model, named(buckets))
            self._weight_version = version
            self._fingerprint_loaded(names, version)

    def load_weights_from_path(self, path: str | Path, version: int) -> None:
        self.update_weights(read_safetensors_dir(path), version)

    def _fingerprint_loaded(self, names: list[str], version: int) -> None:
        """Note which tensors an update of ``version`` wrote; :meth:`weight_fingerprints` reads them
        when the sync check asks (nothing is read on a sync the check leaves out)."""
        self._loaded = (names, version)

    def weight_fingerprints(self, version: int) -> dict[str, dict[str, float]]:
        """The fingerprints of the model's own tensors the last update wrote, as the model holds
        them now, in its own dtype (:meth:`fingerprint_dtypes`): this engine checks what it holds.
        An empty mapping when that update was not of ``version``; under the replica name ``engine``."""
        with self._model_lock:
            if self._loaded is None or self._loaded[1] != version:
                return {"engine": {}}
            names, _ = self._loaded
            own = dict(state_items(self.model))
            log = FingerprintLog(version)
            log.add_all((name, own[name]) for name in names)
            return {"engine": log.prints}

    def fingerprint_dtypes(self, names: list[str], dtypes: list[torch.dtype], mode: str) -> list[torch.dtype]:
        """The dtype the model holds each weight in, whatever the mode (the engine fingerprints its own copy)."""
        own = dict(state_items(self.model))
        return [own[name].dtype if name in own else dtype for name, dtype in zip(names, dtypes)]

    def release_memory(self) -> None:
        """On a CUDA device: drop the captured decoding graphs, their memory pools and key/value
        buffers (the next generation captures them again) and return the freed blocks to the
        device. The weights stay. On other devices nothing is held between calls."""
        with self._model_lock:
            if self.graphs is not None:
                self.graphs.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def state_dict(self) -> dict[str, Any]:
        """The engine's own generator (``seed`` set) and the weight version; with ``seed: null``
        sampling draws from torch's global RNG, which the train engine checkpoints."""
        with self._model_lock:  # not while a batch draws from the generator
            state: dict[str, Any] = {"weight_version": self._weight_version}
            if self.generator is not None:
                state["generator"] = generator_state(self.generator)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "generator" in state:
            if self.generator is None:
                raise ConfigError(
                    "rollout.engine.seed: not set, but the checkpoint holds the hf rollout engine's generator; "
                    "set it as in the run that saved the checkpoint"
                )
            with self._model_lock:  # not while a batch draws from the generator
                set_generator_state(self.generator, state["generator"])
        elif self.generator is not None and state:
            raise ConfigError(
                "rollout.engine.seed: set, but the checkpoint holds no generator state for the hf rollout "
                "engine (the run that saved it had no seed); remove it to resume that run"
            )
        if "weight_version" in state:
            self._weight_version = int(state["weight_version"])

    def close(self) -> None:
        if self._worker is not None:
            self.resume()
            self._requests.put(None)
            self._worker.join(timeout=60)
            self._worker = None
        while True:  # fail what is still queued rather than leave its caller waiting
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                break
            if item is not None and item.future.set_running_or_notify_cancel():
                item.future.set_exception(RuntimeError("the hf rollout engine is closed"))
        if self._model is not None:
            self._model = None
            if self.graphs is not None:
                self.graphs.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


@attrs.define
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: Future
    media: Mapping[str, torch.Tensor] | None = None


def make_engine(
    rollout: RolloutConfig,
    engine_config: HFRolloutConfig | None,
    *,
    model_path: str,
    run_dir: Path | None = None,
    trust_remote_code: bool = False,
) -> HFRolloutEngine:
    """The registered factory: ``rollout`` (sampling is passed to each ``generate`` call instead)
    and ``run_dir`` (it writes nothing) are not needed; ``engine_config`` ``None`` means the defaults;
    ``trust_remote_code``: ``actor.trust_remote_code``."""
    config = engine_config if engine_config is not None else HFRolloutConfig()
    return HFRolloutEngine(
        model_path,
        config,
        trust_remote_code=trust_remote_code,
        return_routed_experts=getattr(rollout, "return_routed_experts", False),
    )
