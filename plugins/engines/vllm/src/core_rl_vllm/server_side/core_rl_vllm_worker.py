"""A vLLM worker extension (``--worker-extension-cls core_rl_vllm_worker.WeightSyncExtension``).

This file runs inside vLLM's worker processes, in the vllm server environment, not in the trainer:
the engine puts its directory on the server's ``PYTHONPATH``. It imports nothing from core-rl
except :mod:`core_rl_server_kit.weight_group`, loaded by file path (``CORE_RL_WEIGHT_GROUP_PY``) because it
needs only torch, so both ends of the weight-update group run the same code.

Methods are called through vLLM's ``/collective_rpc`` with one JSON string argument and return a
string: ``"ok"`` or ``"error: ..."`` (an exception escaping a worker RPC would kill the engine).

Importing it also asks the kernel for the AMX tile state on a CPU server (:func:`allow_amx_tiles`):
vLLM imports this module in each worker process before the model is loaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import traceback
from pathlib import Path


def _load_by_path(variable, name):
    spec = importlib.util.spec_from_file_location(name, os.environ[variable])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _weight_group():
    return _load_by_path("CORE_RL_WEIGHT_GROUP_PY", "core_rl_weight_group")


def _fingerprint_log(payload_args):
    """A :class:`core_rl.sync.fingerprint.FingerprintLog` for the update's ``version`` (the sync
    check's record of the tensors as they arrive, before vLLM's loader casts or fuses them)."""
    module = _load_by_path("CORE_RL_WEIGHT_FINGERPRINT_PY", "core_rl_weight_fingerprint")
    return module.FingerprintLog(int(payload_args.get("version", -1)))


def allow_amx_tiles() -> bool:
    """On a CPU platform whose processor has AMX (Intel Sapphire Rapids and later), ask the kernel
    for the AMX tile state in this process (``torch.cpu._init_amx``); whether it was granted.

    Linux answers the first AMX instruction of a process that has not asked with SIGILL. vLLM's CPU
    kernels for bfloat16 (its ``amx`` attention backend) run AMX instructions without asking, so a
    bfloat16 server on such a machine died on its first request ("Fatal Python error: Illegal
    instruction" in the engine core), with the engine core forked or spawned alike."""
    try:
        import torch
        from vllm.platforms import current_platform
    except ImportError:
        return False
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    init = getattr(torch.cpu, "_init_amx", None)
    if not current_platform.is_cpu() or supported is None or init is None or not supported():
        return False
    return bool(init())


allow_amx_tiles()


class WeightSyncExtension:
    """Mixed into vLLM's worker class: load weights from a directory, join the trainer's
    weight-update group, receive weights."""

    def core_rl_load_dir(self, payload: str) -> str:
        """``payload``: path, a directory of ``*.safetensors`` files, and the weight version. Reads
        them with safetensors, a tensor at a time (each fingerprinted for the sync check as read), and
        loads them with vLLM's in-place ``reload_weights`` (which re-packs what its kernels
        pre-process); a directory without any is left to ``reload_weights(weights_path=...)``.
        Reading the files here skips vLLM's model loader, which costs more than the read
        itself for a small model."""
        try:
            args = json.loads(payload)
            path = Path(args["path"])
            files = sorted(path.glob("*.safetensors"))
            self._core_rl_loaded = None
            if not files:
                self.reload_weights(weights_path=str(path))
            else:
                log = _fingerprint_log(args)
                self.reload_weights(weights_iterator=self._core_rl_in_model_dtypes(log.passing(_read_tensors(files))))
                self._core_rl_loaded = log
            self._core_rl_repack_tied_head()
            return "ok"
        except Exception:
            return "error: " + traceback.format_exc()

    def _core_rl_repack_tied_head(self):
        """After an in-place reload: an output head tied to the input embedding shares its weight,
        which the update wrote through the embedding's name (no ``lm_head.weight`` is sent for a tied
        model), so vLLM never re-ran the head's post-load step. On the CPU that step packs the weight
        into a oneDNN copy the logits are computed from: left alone, the server would sample from the
        pretrained head for the whole run (about 5e-5 of KL from the trainer's float32 weights on
        SmolLM2-135M, hidden under bfloat16's noise). Run it again on the current weight."""
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        config = getattr(self.model_runner.model_config, "hf_config", None)
        tied = bool(getattr(getattr(config, "get_text_config", lambda: config)(), "tie_word_embeddings", False))
        method = getattr(head, "quant_method", None)
        if tied and head is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)

    def _core_rl_in_model_dtypes(self, tensors):
        """``(name, tensor)`` pairs with each floating tensor cast to the dtype of the parameter
        it loads into (the model's dtype for a name vLLM fuses, such as ``q_proj`` into
        ``qkv_proj``). vLLM would convert while copying, but warns once per tensor and update."""
        model = self.model_runner.model
        params = {name: p.dtype for name, p in model.named_parameters()}
        default = self.model_runner.model_config.dtype
        for name, tensor in tensors:
            want = params.get(name, default)
            if tensor.is_floating_point() and want.is_floating_point and tensor.dtype != want:
                tensor = tensor.to(want)
            yield name, tensor

    def core_rl_weight_dtypes(self, payload: str = "") -> str:
        """What :meth:`_core_rl_in_model_dtypes` casts each floating weight to, as JSON:
        ``{"default": DTYPE, "params": {NAME: DTYPE}}``, the parameters whose dtype is not the
        model's default by name. The trainer sends each weight in that dtype (half the bytes of float32
        for a bfloat16 model), which this side would otherwise have cast it to on arrival."""
        try:
            model = self.model_runner.model
            default = self.model_runner.model_config.dtype
            params = {
                name: str(p.dtype).removeprefix("torch.")
                for name, p in model.named_parameters()
                if p.dtype.is_floating_point and p.dtype != default
            }
            return json.dumps({"default": str(default).removeprefix("torch."), "params": params})
        except Exception:
            return "error: " + traceback.format_exc()

    def core_rl_fingerprints(self, payload: str = "") -> str:
        """The sync check's fingerprints of the tensors the last update loaded, as received, as
        JSON: ``{"version": V, "prints": {NAME: FLOAT}}``; ``{"version": null, "prints": {}}`` when
        this worker has loaded none since it started (or its last load failed)."""
        try:
            log = getattr(self, "_core_rl_loaded", None)
            return json.dumps(log.to_json() if log is not None else {"version": None, "prints": {}})
        except Exception:
            return "error: " + traceback.format_exc()

    def core_rl_join_group(self, payload: str) -> str:
        """``payload``: address, port, rank_offset, world_size, backend, group_name, timeout_s."""
        try:
            args = json.loads(payload)
            self._core_rl_wg = _weight_group()
            previous = getattr(self, "_core_rl_group", None)
            if previous is not None:  # a new group after a server restart: the old one is gone
                self._core_rl_group = None
                self._core_rl_wg.destroy_group(previous)
            self._core_rl_group = self._core_rl_wg.init_group(
                args["address"],
                args["port"],
                args["world_size"],
                rank=args["rank_offset"] + self.rank,
                backend=args["backend"],
                group_name=args["group_name"],
                timeout_s=args["timeout_s"],
            )
            return "ok"
        except Exception:
            return "error: " + traceback.format_exc()

    def core_rl_receive_weights(self, payload: str) -> str:
        """``payload``: names, dtypes, shapes (the trainer broadcasts the tensors in this order) and
        the weight version (for the sync check's fingerprints)."""
        try:
            args = json.loads(payload)
            model = self.model_runner.model
            device = next(model.parameters()).device
            self._core_rl_loaded = None
            log = _fingerprint_log(args)
            names, dtypes, shapes = args["names"], args["dtypes"], args["shapes"]
            received = log.passing(self._core_rl_wg.receive_tensors(self._core_rl_group, names, dtypes, shapes, device))
            try:  # each tensor is received as vLLM's loader asks for it (one at a time on the device)
                self.reload_weights(weights_iterator=self._core_rl_in_model_dtypes(received))
            except Exception:
                with contextlib.suppress(Exception):
                    self._core_rl_wg.drain(received)  # the trainer waits on every tensor
                raise
            self._core_rl_wg.drain(received)
            self._core_rl_loaded = log
            self._core_rl_repack_tied_head()
            return "ok"
        except Exception:
            return "error: " + traceback.format_exc()


def _read_tensors(files):
    """``(name, tensor)`` of each safetensors file in turn, one tensor read at a time (host memory
    holds one, not the model)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
