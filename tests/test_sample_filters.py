"""Sample filters in real runs (core_rl.loops.rl.filtering): a step whose filters drop every group is
a warning naming the filter and what it dropped, counted in the metrics, and a limit of such steps
in a row ends the run with one message; a filter that keeps part of a prompt's group is refused,
naming it and its distribution. Tiny model, real trainer, the ``core-rl train`` command in-process."""

from __future__ import annotations

from pathlib import Path

import torch
from core_rl import cli
from core_rl.builtin.loggers import read_metrics
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import SampleFilter
from core_rl.protocol import TensorBatch
from core_rl.testing.faults import build_task, merged, run_dir
from fault_helpers import write_config


def _config(tmp_path: Path, filters: list, **algorithm) -> tuple[dict, Path]:
    base = build_task(tmp_path)
    config = merged(
        base,
        algorithm={"name": "grpo", "filters": filters, **algorithm},
        trainer={"total_steps": 3, "torch_threads": 1},
        saver={"every_n_steps": 0, "at_end": False, "export_hf": False},
    )
    return config, write_config(config, tmp_path / "run.yaml")


def test_steps_whose_filter_drops_every_group_are_warned_counted_and_limited(tmp_path: Path, capsys) -> None:
    # min_std above any reward spread: drop_uniform_groups drops every group of every step
    drop_all = [{"name": "drop_uniform_groups", "min_std": 100.0}]
    config, path = _config(tmp_path, drop_all, max_consecutive_empty_steps=2)
    assert cli.main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert (
        "core-rl: warning: step 1 has nothing to train on: sample filter 'drop_uniform_groups' (algorithm.filters[0], "
        "distribution core-rl-grpo) dropped every sample: 2 group(s), 8 samples; the policy was not updated (1 such "
        "step(s) in a row, 1 in all). To train on every step, draw more prompts to refill what the filters drop "
        "(algorithm.max_num_gen_batches above 1), or loosen the filters\n"
    ) in err, err
    assert (
        "core-rl: error: step 2 has nothing to train on: sample filter 'drop_uniform_groups' (algorithm.filters[0], "
        "distribution core-rl-grpo) dropped every sample: 2 group(s), 8 samples; the policy was not updated (2 such "
        "step(s) in a row, 2 in all); that reaches algorithm.max_consecutive_empty_steps=2, so the run ends: draw more "
        "prompts to refill what the filters drop (algorithm.max_num_gen_batches above 1), or loosen the filters, or "
        "raise the limit (0: none)\n"
    ) in err, err
    assert "Traceback" not in err
    [step1] = read_metrics(run_dir(config) / "metrics.jsonl")
    assert step1["filter/empty_step"] == 1.0 and step1["filter/empty_steps_total"] == 1.0
    assert step1["filter/drop_uniform_groups/dropped_fraction"] == 1.0 and step1["actor/skipped"] == 1.0
    assert "actor/loss" not in step1

    # no limit: the run goes on, every step counted, the count kept in checkpoints
    config, path = _config(tmp_path / "nolimit", drop_all, max_consecutive_empty_steps=0)
    assert cli.main(["train", str(path), "trainer.total_steps=2"]) == 0
    out, err = capsys.readouterr()
    assert err.count("core-rl: warning: step ") == 2
    assert "\ncheckpoint: none saved (saver.every_n_steps=0, saver.at_end=false)\n" in out  # not "None"
    config, path = _config(tmp_path / "resumed", drop_all, max_consecutive_empty_steps=0)
    assert cli.main(["train", str(path), "trainer.total_steps=2", "saver.every_n_steps=1"]) == 0
    assert cli.main(["train", str(path), "recover.mode=resume"]) == 0
    assert "step 3 has nothing to train on" in capsys.readouterr().err
    rows = read_metrics(run_dir(config) / "metrics.jsonl")
    assert [r["filter/empty_steps_total"] for r in rows] == [1.0, 2.0, 3.0]


class FirstOfEachGroup(SampleFilter):
    """Keeps the first sample of each prompt's group, cutting every group."""

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        first = torch.ones_like(batch["group_index"], dtype=torch.bool)
        first[1:] = batch["group_index"][1:] != batch["group_index"][:-1]
        return first


class CuttingFilters:
    @hookimpl
    def core_rl_register_sample_filters(self, register: Register) -> None:
        register("first_of_group", lambda config: FirstOfEachGroup(), description="keeps one sample per group")


def test_a_filter_that_keeps_part_of_a_group_is_refused_naming_it(tmp_path: Path, host, monkeypatch, capsys) -> None:
    host.register_plugin(CuttingFilters(), distribution="my-filters", version="0.1")
    monkeypatch.setattr("core_rl.plugins.host.PluginHost", lambda: host)
    _, path = _config(tmp_path, [{"name": "first_of_group"}])
    assert cli.main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        "core-rl: error: sample filter 'first_of_group' (algorithm.filters[0], distribution my-filters) kept 1 of the "
        "4 samples of a prompt's group (2 of 2 groups were cut); a sample filter must keep or drop whole groups (all "
        "the samples of one prompt, the rows with equal group_index): group-relative advantages and normalisation "
        "compare each sample with the rest of its group, so a partial group would shift the baseline of the samples "
        "that stay. Make the filter decide per group (core_rl.ops.group_ids_to_dense numbers the groups), or remove "
        "it from algorithm.filters; to leave single samples out of the loss use algorithm.mask_no_eos_with_zero or "
        "algorithm.rejection_sampling\n"
    ), err
