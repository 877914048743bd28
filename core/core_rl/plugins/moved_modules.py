"""The module paths of earlier layouts (the one before the core's concept folders and kits, release
0.1, and the config fragments folded since into the module of their section): each old path still
imports, as the module that replaced it, with a :class:`DeprecationWarning` naming the new path;
they go in the next release. Installed on ``import core_rl`` (:func:`install`).

An old package (``core_rl.trainer``, ``core_rl.remote``, ``core_rl.engine_utils``) imports as a
module of its own whose attributes come from its replacement, so that importing an old child never
rebinds an attribute of a new package. A module that moved into a plugin distribution (a kit,
core-rl-gguf) imports by its old path where that distribution is installed."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

#: old module -> the module that replaced it
MOVED: dict[str, str] = {
    "core_rl.atomic_files": "core_rl.checkpoint.atomic",
    "core_rl.attribution": "core_rl.plugins.attribution",
    "core_rl.built_engines": "core_rl.roles.built_engines",
    "core_rl.callables": "core_rl.plugins.callables",
    "core_rl.chat_template": "core_rl.rollout.chat_template",
    "core_rl.chat_template_override": "core_rl.rollout.chat_template_override",
    "core_rl.checkpointing": "core_rl.checkpoint.files",
    "core_rl.components": "core_rl.plugins.components",
    "core_rl.data_sources": "core_rl.data.sources",
    "core_rl.deadlines": "core_rl.reliability.deadlines",
    "core_rl.config.mismatch_budget": "core_rl.config.schema",
    "core_rl.config.moe_config": "core_rl.config.model_sections",
    "core_rl.config.ptx": "core_rl.config.schema",
    "core_rl.config.replay_config": "core_rl.config.schema",
    "core_rl.config.sync_check_config": "core_rl.config.schema",
    "core_rl.engine_utils": "core_rl_train_kit",
    "core_rl.engine_utils.attention": "core_rl_train_kit.attention",
    "core_rl.engine_utils.buckets": "core_rl.sync.buckets",
    "core_rl.engine_utils.distributed": "core_rl.launch.distributed",
    "core_rl.engine_utils.export": "core_rl_train_kit.export",
    "core_rl.engine_utils.fused_head": "core_rl_train_kit.fused_head",
    "core_rl.engine_utils.hf": "core_rl.roles.hf",
    "core_rl.engine_utils.logprobs": "core_rl_train_kit.logprobs",
    "core_rl.engine_utils.lora": "core_rl.roles.lora",
    "core_rl.engine_utils.metrics": "core_rl.loops.step_metrics",
    "core_rl.engine_utils.microbatch": "core_rl_train_kit.microbatch",
    "core_rl.engine_utils.muon": "core_rl_train_kit.muon",
    "core_rl.engine_utils.optim": "core_rl_train_kit.optim",
    "core_rl.engine_utils.optimizer_class": "core_rl.config.optimizer_class",
    "core_rl.engine_utils.packed": "core_rl_train_kit.packed",
    "core_rl.engine_utils.packing": "core_rl_train_kit.packing",
    "core_rl.engine_utils.row_pool": "core_rl_train_kit.row_pool",
    "core_rl.engine_utils.runner": "core_rl_train_kit.runner",
    "core_rl.engine_utils.sharded_forward": "core_rl_train_kit.sharded_forward",
    "core_rl.engine_utils.shared_prefix": "core_rl_train_kit.shared_prefix",
    "core_rl.engine_utils.state": "core_rl_train_kit.state",
    "core_rl.engine_utils.token_budget": "core_rl.loops.token_budget",
    "core_rl.engine_utils.topk_logprobs": "core_rl_train_kit.topk_logprobs",
    "core_rl.engine_utils.topk_runner": "core_rl_train_kit.topk_runner",
    "core_rl.engine_utils.ulysses": "core_rl_train_kit.ulysses",
    "core_rl.environments": "core_rl.rollout.environments",
    "core_rl.exit_note": "core_rl.reliability.exit_note",
    "core_rl.freezing": "core_rl.roles.freezing",
    "core_rl.gguf": "core_rl_gguf.conversion",
    "core_rl.guards": "core_rl.plugins.guards",
    "core_rl.kinds": "core_rl.plugins.kinds",
    "core_rl.kl_reward": "core_rl.ops.kl_reward",
    "core_rl.launchers": "core_rl.launch.launchers",
    "core_rl.lazy_exports": "core_rl.plugins.lazy_exports",
    "core_rl.loop_watch": "core_rl.reliability.loop_watch",
    "core_rl.lora_sync": "core_rl.sync.lora",
    "core_rl.model_dir_checks": "core_rl.roles.model_dir_checks",
    "core_rl.model_overrides": "core_rl.roles.model_overrides",
    "core_rl.own_loop": "core_rl.reliability.own_loop",
    "core_rl.pip_as_uv": "core_rl_server_kit.pip_as_uv",
    "core_rl.placement": "core_rl.launch.placement",
    "core_rl.plugin_tally": "core_rl.plugins.tally",
    "core_rl.preflight": "core_rl.loops.preflight",
    "core_rl.progress": "core_rl.reliability.progress",
    "core_rl.registry": "core_rl.plugins.registry",
    "core_rl.rejection": "core_rl.ops.rejection",
    "core_rl.remote": "core_rl_server_kit.remote",
    "core_rl.remote.engine": "core_rl_server_kit.remote.engine",
    "core_rl.remote.generation": "core_rl_server_kit.remote.generation",
    "core_rl.remote.gpus": "core_rl.launch.gpus",
    "core_rl.remote.memory": "core_rl_server_kit.remote.memory",
    "core_rl.remote.options": "core_rl_server_kit.remote.options",
    "core_rl.remote.recovery": "core_rl_server_kit.remote.recovery",
    "core_rl.remote.weights": "core_rl_server_kit.remote.weights",
    "core_rl.remote.wire": "core_rl_server_kit.remote.wire",
    "core_rl.remote_code": "core_rl.roles.remote_code",
    "core_rl.rendezvous": "core_rl.launch.rendezvous",
    "core_rl.reward_contract": "core_rl.interfaces.rewards",
    "core_rl.roles.gguf": "core_rl_gguf.conversion",
    "core_rl.roles.moe": "core_rl_train_kit.moe",
    "core_rl.roles.tiny": "core_rl.testing.tiny",
    "core_rl.roles.tiny_vlm": "core_rl.testing.tiny_vlm",
    "core_rl.rollout_controller": "core_rl.rollout.controller",
    "core_rl.run_made_dirs": "core_rl.roles.derived_dirs",
    "core_rl.run_records": "core_rl.interfaces.loggers",
    "core_rl.sampling_params": "core_rl.interfaces.sampling",
    "core_rl.server_env": "core_rl_server_kit.env",
    "core_rl.servers": "core_rl_server_kit.processes",
    "core_rl.stop_strings": "core_rl.rollout.stop_strings",
    "core_rl.supervise": "core_rl_server_kit.supervise",
    "core_rl.tiny": "core_rl.testing.tiny",
    "core_rl.tool_parsers": "core_rl.rollout.tool_parsers",
    "core_rl.trainer": "core_rl.loops",
    "core_rl.trainer.auto_budget": "core_rl.loops.auto_budget",
    "core_rl.trainer.batching": "core_rl.loops.rl.batching",
    "core_rl.trainer.behave_noise": "core_rl.loops.rl.behave_noise",
    "core_rl.trainer.building": "core_rl.loops.building",
    "core_rl.trainer.checkpoint_policy": "core_rl.checkpoint.policy",
    "core_rl.trainer.checkpoints": "core_rl.checkpoint.store",
    "core_rl.trainer.colocated_memory": "core_rl.rollout.colocated_memory",
    "core_rl.trainer.colocation": "core_rl.rollout.colocation",
    "core_rl.trainer.cpu_threads": "core_rl.loops.cpu_threads",
    "core_rl.trainer.critic": "core_rl.loops.rl.critic",
    "core_rl.trainer.data": "core_rl.data.prompts",
    "core_rl.trainer.data_files": "core_rl.data.files",
    "core_rl.trainer.difficulty": "core_rl.loops.rl.difficulty",
    "core_rl.trainer.distill": "core_rl.loops.rl.distill",
    "core_rl.trainer.errors": "core_rl.loops.errors",
    "core_rl.trainer.eval_command": "core_rl.eval.command",
    "core_rl.trainer.eval_metrics": "core_rl.eval.metrics",
    "core_rl.trainer.evaluation": "core_rl.eval.evaluator",
    "core_rl.trainer.failed_steps": "core_rl.loops.rl.failed_steps",
    "core_rl.trainer.filtering": "core_rl.loops.rl.filtering",
    "core_rl.trainer.hf_exports": "core_rl.checkpoint.hf_exports",
    "core_rl.trainer.launch": "core_rl.launch.local",
    "core_rl.trainer.length_bound": "core_rl.loops.supervised.length_bound",
    "core_rl.trainer.logger_deadline": "core_rl.reliability.logger_deadline",
    "core_rl.trainer.loops": "core_rl.loops.run",
    "core_rl.trainer.memory": "core_rl.loops.memory",
    "core_rl.trainer.mismatch_budget": "core_rl.loops.rl.mismatch_budget",
    "core_rl.trainer.mismatch_probe": "core_rl.loops.rl.mismatch_probe",
    "core_rl.trainer.mixture": "core_rl.data.mixture",
    "core_rl.trainer.numerics": "core_rl.loops.numerics",
    "core_rl.trainer.preference": "core_rl.loops.supervised.pairwise",
    "core_rl.trainer.profiling": "core_rl.loops.profiling",
    "core_rl.trainer.ptx": "core_rl.loops.rl.ptx",
    "core_rl.trainer.ranks": "core_rl.launch.ranks",
    "core_rl.trainer.recover": "core_rl.loops.run",
    "core_rl.trainer.reference_mix": "core_rl.loops.rl.reference_mix",
    "core_rl.trainer.reference_reset": "core_rl.loops.rl.reference_reset",
    "core_rl.trainer.resume": "core_rl.checkpoint.resume",
    "core_rl.trainer.reward_role": "core_rl.loops.rl.reward_model",
    "core_rl.trainer.rewards": "core_rl.loops.rl.reward_runner",
    "core_rl.trainer.rollout_dump": "core_rl.rollout.dump",
    "core_rl.trainer.rollout_flow": "core_rl.loops.rl.rollout_flow",
    "core_rl.trainer.rollout_replay": "core_rl.rollout.replay",
    "core_rl.trainer.rollout_scoring": "core_rl.loops.rl.scoring",
    "core_rl.trainer.run": "core_rl.loops.run",
    "core_rl.trainer.run_config": "core_rl.loops.run_config",
    "core_rl.trainer.run_progress": "core_rl.loops.run_progress",
    "core_rl.trainer.sample_log": "core_rl.loops.rl.sample_log",
    "core_rl.trainer.scaffold": "core_rl.loops.scaffold",
    "core_rl.trainer.sequence_batches": "core_rl.loops.supervised.batches",
    "core_rl.trainer.sequences": "core_rl.loops.supervised.sequences",
    "core_rl.trainer.signals": "core_rl.loops.signals",
    "core_rl.trainer.streaks": "core_rl.loops.streaks",
    "core_rl.trainer.summary": "core_rl.loops.run",
    "core_rl.trainer.supervised": "core_rl.loops.supervised.loop",
    "core_rl.trainer.sync": "core_rl.loops.rl.loop",
    "core_rl.trainer.sync_check": "core_rl.sync.check",
    "core_rl.trainer.sync_faults": "core_rl.sync.faults",
    "core_rl.trainer.update": "core_rl.loops.rl.update",
    "core_rl.trainer.watchdog": "core_rl.reliability.watchdog",
    "core_rl.trainer.weight_load": "core_rl.sync.background_load",
    "core_rl.trainer.weight_sync": "core_rl.sync.weight_sync",
    "core_rl.trainer.wrapping_loss": "core_rl.loops.rl.wrapping_loss",
    "core_rl.vision.wire": "core_rl_server_kit.media_wire",
    "core_rl.weight_fingerprint": "core_rl.sync.fingerprint",
    "core_rl.weight_group": "core_rl_server_kit.weight_group",
    "core_rl.workflows": "core_rl.rollout.workflows",
}
#: the old names that were packages
OLD_PACKAGES = frozenset({"core_rl.engine_utils", "core_rl.remote", "core_rl.trainer"})


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str, package: bool) -> None:
        self.new = new
        self.package = package

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if not self.package:
            return importlib.import_module(self.new)
        stand_in = types.ModuleType(spec.name, f"Moved to {self.new}.")
        stand_in.__path__ = []  # a package, so that its old children import through this finder
        new = self.new

        def __getattr__(name: str) -> Any:
            return getattr(importlib.import_module(new), name)

        stand_in.__getattr__ = __getattr__  # type: ignore[method-assign]
        return stand_in

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds the old module paths (:data:`MOVED`), warning once per path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(
            f"{fullname} moved to {new}; the old path goes in the next release", DeprecationWarning, stacklevel=2
        )
        package = fullname in OLD_PACKAGES
        return importlib.util.spec_from_loader(fullname, _Alias(new, package), is_package=package)


def install() -> None:
    """Put the finder of old paths last on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
