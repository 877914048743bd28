"""The verified weight sync (:mod:`core_rl.sync.check`) in real training runs (fsdp trainer,
embedded ``hf`` rollout engine, in this process): a correct sync passes the check in every mode the
engine has, and each fault the test hook (:mod:`core_rl.sync.faults`) injects is caught at
the step it happens, naming the engine, the mode, the tensor and the version; from the command
line the run exits with 1 and one line. The fingerprint itself: which changes it sees."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from core_rl.sync.check import WeightSyncMismatch
from core_rl.sync.faults import VARIABLE
from core_rl.sync.fingerprint import fingerprint, first_difference
from core_rl.testing import preloaded
from core_rl.testing.launch import cpu_ranks_env
from fault_helpers import build_task, cli_command, cli_env, cli_train, merged, run_dir, train_here, write_config
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    return build_task(tmp_path_factory.mktemp("sync_check"))


def _config(base: dict, name: str, mode: str, **rollout) -> dict:
    return merged(
        base,
        experiment={"name": name},
        rollout={"weight_sync": mode, "engine": {"name": "hf", "dtype": "float32"}, **rollout},
        trainer={"total_steps": 3},
        saver={"every_n_steps": 0},
    )


def _steps(config: dict) -> list[dict]:
    return [json.loads(line) for line in (run_dir(config) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_a_correct_sync_passes_the_check_every_step(base, host, mode, monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    config = _config(base, f"ok-{mode}", mode)
    train_here(config, host)
    steps = _steps(config)
    assert [s["step"] for s in steps] == [1, 2, 3]
    tensors = {s["weight_sync/checked_tensors"] for s in steps}
    assert len(tensors) == 1 and tensors.pop() > 5  # every synced tensor, every step
    assert all(0 < s["timing/sync_check_s"] < s["timing/weight_sync_s"] for s in steps)


def test_every_n_syncs_thins_the_check_and_enabled_false_turns_it_off(base, host, monkeypatch):
    monkeypatch.setenv(VARIABLE, "swap:3")  # a fault in a sync the check skips goes unseen
    thinned = _config(base, "thinned", "memory", sync_check={"every_n_syncs": 2})
    train_here(thinned, host)
    assert ["timing/sync_check_s" in s for s in _steps(thinned)] == [False, True, False]
    off = _config(base, "off", "memory", sync_check={"enabled": False})
    train_here(off, host)
    assert not any("timing/sync_check_s" in s for s in _steps(off))


@pytest.mark.parametrize(
    ("mode", "fault", "tensor"),
    [
        ("memory", "swap", "model.layers.0.self_attn.q_proj.weight"),  # two shards joined the wrong way round
        ("disk", "swap", "model.layers.0.input_layernorm.weight"),
        ("memory", "bf16", "model.embed_tokens.weight"),  # bfloat16 values where float32 was expected
        ("disk", "bf16", None),
    ],
)
def test_an_injected_fault_stops_the_run_at_its_step(base, host, mode, fault, tensor, monkeypatch):
    monkeypatch.setenv(VARIABLE, f"{fault}:2")
    config = _config(base, f"{fault}-{mode}", mode)
    with pytest.raises(WeightSyncMismatch) as caught:
        train_here(config, host)
    message = str(caught.value)
    assert "weight version 2" in message and "rollout engine 'hf'" in message
    assert f"rollout.weight_sync: {mode}:" in message
    assert "first tensor that differs is " + (tensor or "") in message
    assert [s["step"] for s in _steps(config)] == [1]  # step 1 was logged; step 2 stopped at its sync


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_a_skipped_tensor_is_refused_by_the_hf_engine_naming_it(base, host, mode, monkeypatch):
    """(a) a tensor skipped: the ``hf`` engine refuses an update that lacks one of its model's
    tensors before the check runs; the refusal is the same one-line stop, naming the engine, the
    mode, the version and the tensor."""
    monkeypatch.setenv(VARIABLE, "skip:2")
    config = _config(base, f"skip-{mode}", mode)
    with pytest.raises(WeightSyncMismatch) as caught:
        train_here(config, host)
    message = str(caught.value)
    assert message.startswith(
        f"weight sync of weight version 2 refused: rollout engine 'hf', rollout.weight_sync: {mode}: "
        "weights do not match the rollout model: missing "
    )
    assert SKIPPED[mode] in message and "\n" not in message
    assert [s["step"] for s in _steps(config)] == [1]


#: the tensor the ``skip`` fault leaves out: the first of the memory buckets; the first of the file
SKIPPED = {"memory": "model.embed_tokens.weight", "disk": "lm_head.weight"}


@pytest.mark.parametrize(("fault", "says"), [("swap", "weight sync check failed"), ("skip", "refused")])
def test_a_mismatch_exits_1_with_one_line(base, tmp_path, monkeypatch, fault, says):
    monkeypatch.setenv(VARIABLE, f"{fault}:2")
    done = cli_train(_config(base, f"cli-{fault}", "memory"))
    assert done.returncode == 1, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, done.stderr[-2000:]
    assert says in errors[0] and "weight version 2" in errors[0] and "rollout engine 'hf'" in errors[0]
    assert "Traceback" not in done.stderr


def _two_ranks(config: dict, fault: str | None) -> subprocess.CompletedProcess:
    """``core-rl train --nproc-per-node 2`` (fsdp over two CPU processes, gloo) on ``config``, with
    the test hook's ``fault`` (``KIND:VERSION``) or none."""
    path = write_config(
        config, Path(config["experiment"]["output_dir"]).parent / f"{config['experiment']['name']}.yaml"
    )
    env = cli_env()
    env.pop(VARIABLE, None)
    if fault is not None:
        env[VARIABLE] = fault
    return preloaded.run(
        cli_command("train", "--nproc-per-node", "2", str(path)),
        capture_output=True,
        text=True,
        env=cpu_ranks_env(env),
        timeout=600,
    )


def test_two_ranks_check_every_sync_and_stop_together_at_a_swap(base):
    """Two fsdp ranks (torchrun): the main rank, which holds the rollout engine, checks every sync
    of the gathered weights and the run completes; a shard order swapped at version 2 stops both
    ranks at that step with exit status 1 and the check's one line, no traceback."""
    ok = _config(base, "ranks-ok", "memory")
    done = _two_ranks(ok, None)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = _steps(ok)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["weight_sync/checked_tensors"] > 5 for s in steps)

    bad = _config(base, "ranks-swap", "memory")
    done = _two_ranks(bad, "swap:2")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "weight sync check failed at weight version 2: rollout engine 'hf'" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert [s["step"] for s in _steps(bad)] == [1]


def test_the_fingerprint_sees_a_swap_a_rounding_and_a_missing_tensor():
    tensor = torch.randn(64, 8)
    sent = {"w": fingerprint("w", tensor, 5)}
    halves = torch.cat(tensor.chunk(2)[::-1])
    assert first_difference(sent, {"w": fingerprint("w", halves, 5)}) is not None
    rounded = tensor.to(torch.bfloat16).float()
    assert first_difference(sent, {"w": fingerprint("w", rounded, 5)}) is not None
    # folded in the dtype it travels in, a bfloat16 copy agrees with what was sent
    assert fingerprint("w", tensor, 5, torch.bfloat16) == fingerprint("w", tensor.to(torch.bfloat16), 5)
    assert first_difference(sent, {}) == ("w", "not loaded")
    assert first_difference(sent, {"w": sent["w"], "x": 1.0}) == ("x", "loaded but not sent")
    assert first_difference(sent, {"w": fingerprint("w", tensor, 5)}) is None
    assert fingerprint("w", tensor, 5) != fingerprint("w", tensor, 6)  # other positions each version
    # an engine that read back a share of the tensors: NaN is received but unread, not compared
    two = {"w": sent["w"], "v": fingerprint("v", tensor, 5)}
    assert first_difference(two, {"w": math.nan, "v": two["v"]}) is None
    assert first_difference(two, {"v": two["v"]}) == ("w", "not loaded")  # never received
    assert first_difference(two, {"w": math.nan, "v": sent["w"]})[0] == "v"


def test_a_prefix_draws_the_samples_from_the_first_rows_alone(tmp_path):
    """``fingerprint_prefix`` (an engine that reads back only each tensor's first rows): the samples
    come from the fewest leading rows holding that many elements, from a tensor and from its file
    alike, so a change there shows and one in a later row does not."""
    from core_rl.sync.fingerprint import file_samples, prefix_numel, sample
    from safetensors.torch import save_file

    assert prefix_numel((100, 30), 64) == 90 and prefix_numel((1000,), 64) == 64
    assert prefix_numel((3, 30), 64) == 90 and prefix_numel((100, 30), None) == 3000
    tensor = torch.randn(100, 30)
    save_file({"w": tensor}, tmp_path / "model.safetensors")
    assert torch.equal(file_samples(tmp_path, 7, prefix=64)["w"], sample("w", tensor, 7, prefix=64))
    later, first = tensor.clone(), tensor.clone()
    later[3:] += 1
    first[:3] += 1
    assert fingerprint("w", later, 7, prefix=64) == fingerprint("w", tensor, 7, prefix=64)
    assert fingerprint("w", first, 7, prefix=64) != fingerprint("w", tensor, 7, prefix=64)
    assert fingerprint("w", later, 7) != fingerprint("w", tensor, 7)  # without one, every row counts


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=1, max_size=8),
    picks=st.lists(st.tuples(st.sampled_from(_DTYPES), st.sampled_from([None, *_DTYPES]), st.booleans()), min_size=8),
    prefix=st.sampled_from([None, 1, 5, 40]),
    version=st.integers(0, 50),
    seed=st.integers(0, 2**16),
)
def test_sampling_and_folding_many_tensors_gives_each_ones_numbers(shapes, picks, prefix, version, seed):
    """:func:`sample_all` and :func:`fold_all` (one copy, cast and read per dtype) against
    each tensor sampled alone and its fold written out (``sum((i + 1) * x_i)`` in order): the
    same numbers, exactly, for tensors of mixed dtypes, transposed (not contiguous), empty, and a
    name seen twice (its last tensor, at its first place); :class:`FingerprintLog` likewise."""
    from core_rl.sync.fingerprint import FingerprintLog, fold_all, sample, sample_all

    generator = torch.Generator().manual_seed(seed)
    items, targets = [], []
    for i, (shape, (dtype, target, transposed)) in enumerate(zip(shapes, picks)):
        tensor = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) * 10
        if transposed and tensor.dim() > 1:
            tensor = tensor.transpose(0, -1)
        items.append((f"layers.{i % 5}.w", tensor))  # names repeat past 5
        targets.append(target)
    last = dict(items)
    together = sample_all(items, version, prefix)
    assert list(together) == list(last)
    for name, tensor in last.items():
        assert torch.equal(together[name], sample(name, tensor, version, prefix))
        assert together[name].dtype == tensor.dtype
    alone = [sample(name, tensor, version, prefix) for name, tensor in items]

    def written_out(samples: torch.Tensor, dtype: torch.dtype | None) -> float:
        values = samples.to(dtype or samples.dtype).to(torch.float64).tolist()
        total = 0.0
        for rank, value in enumerate(values):
            total += (rank + 1) * value
        return total

    assert fold_all(alone, targets) == [written_out(s, d) for s, d in zip(alone, targets)]
    log, logged_alone = FingerprintLog(version), FingerprintLog(version)
    log.add_all(items)
    for name, tensor in items:
        logged_alone.add(name, tensor)
    want = {name: written_out(sample(name, tensor, version), None) for name, tensor in last.items()}
    assert log.prints == logged_alone.prints == want
    assert list(log.prints) == list(want)
