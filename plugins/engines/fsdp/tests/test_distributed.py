"""Two ranks vs one: ``torchrun`` on CPU (gloo) runs ``dist_train.py`` with 2 and with 1 process.

The same global batches, split unevenly over 2 ranks (4/3, 6/1 and 7/0 rows, so ranks need
different numbers of micro-batches and one has no rows at all), must give the same losses, metrics,
gradient norms, log-probs and final weights as 1 rank; resuming from a checkpoint must reproduce
training exactly, and a 2-rank checkpoint must resume on 1 rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("dist_train.py")
# AdamW divides by sqrt(second moment), which magnifies the last-bit differences of a different
# reduction order for parameters with tiny gradients: a few elements differ by ~1e-5 after 3 steps
# (one element of 16384 by 6.2e-5 under sequence parallelism on a 16-core machine's CPU kernels).
WEIGHT_ATOL = 1e-4


def _run(torchrun: Callable[..., None], nproc: int, model: Path, out: Path, *extra: str) -> dict:
    out.mkdir(parents=True)
    torchrun(SCRIPT, nproc, "--model", str(model), "--out", str(out), *extra)
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def runs(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, torchrun: Callable[..., None]
) -> dict[int, tuple[dict, Path]]:
    root = tmp_path_factory.mktemp("dist")
    two = _run(torchrun, 2, tiny_model, root / "two")
    one = _run(torchrun, 1, tiny_model, root / "one", "--cross-ckpt", str(root / "two" / "ckpt"))
    return {2: (two, root / "two"), 1: (one, root / "one")}


def _same_metrics(a: list[dict], b: list[dict], *, exact: bool = False) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), step
        for key in x:
            if key == "num_micro_batches":
                continue
            if exact:
                assert x[key] == y[key], (step, key)
            else:
                assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (step, key)


def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def test_two_ranks_match_one(runs: dict[int, tuple[dict, Path]]) -> None:
    (two, d2), (one, d1) = runs[2], runs[1]
    assert (two["world"], one["world"]) == (2, 1)
    _same_metrics(two["metrics_a"], one["metrics_a"])
    # one rank packs 7 rows of width <= 10 into 20-token micro-batches: 4 of them; with 2 ranks the
    # rank with more rows sets the count and the other pads (6/1 rows: 3 each; 7/0 rows: 4 each)
    assert [m["num_micro_batches"] for m in one["metrics_a"]] == [4.0, 4.0, 4.0]
    assert [m["num_micro_batches"] for m in two["metrics_a"]] == [2.0, 3.0, 4.0]
    assert [m["lr"] for m in one["metrics_a"]] == pytest.approx([0.01, 0.01, 0.007])
    w1, w2 = _load(d1 / "final_a.pt"), _load(d2 / "final_a.pt")
    assert w1.keys() == w2.keys()
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], atol=WEIGHT_ATOL, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    lp1, lp2 = _load(d1 / "logprobs.pt"), _load(d2 / "logprobs.pt")
    torch.testing.assert_close(lp2["ref"], lp1["ref"], atol=1e-6, rtol=0)
    torch.testing.assert_close(lp2["trained"], lp1["trained"], atol=1e-4, rtol=0)


def test_bf16_autocast_two_ranks_match_one(runs: dict[int, tuple[dict, Path]]) -> None:
    """``autocast_dtype: bfloat16`` (FSDP-wrapped on 2 ranks, the plain module on 1): the same
    losses and gradient norms up to bfloat16 kernels' blocking over different row splits."""
    (two, _), (one, _) = runs[2], runs[1]
    for m2, m1 in zip(two["metrics_bf16"], one["metrics_bf16"], strict=True):
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-3)
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-3)
    assert two["metrics_bf16"][0]["loss"] != pytest.approx(two["metrics_a"][0]["loss"], rel=1e-7)  # autocast is on


@pytest.mark.parametrize("world", [1, 2])
def test_shared_layout_trains_as_the_padded_one(runs: dict[int, tuple[dict, Path]], world: int) -> None:
    """Rows sharing prompts (2 ranks: rank 0 with groups to share, rank 1 with few or none, each
    choosing its own layout per plan): the ``shared`` layout's 2 steps give the ``padded`` one's
    metrics, weights and log-probs, and so does the other world size."""
    result, out = runs[world]
    _same_metrics(result["metrics_shared"], result["metrics_shared_padded"])
    _same_metrics(result["metrics_shared"], runs[1][0]["metrics_shared_padded"])
    got, want = _load(out / "layouts.pt"), _load(runs[1][1] / "layouts.pt")
    for key in want["padded"]:
        torch.testing.assert_close(got["shared"][key], got["padded"][key], atol=WEIGHT_ATOL, rtol=1e-5, msg=key)
        torch.testing.assert_close(got["shared"][key], want["padded"][key], atol=WEIGHT_ATOL, rtol=1e-5, msg=key)
    torch.testing.assert_close(got["shared_lp"], got["padded_lp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(got["shared_lp"], want["padded_lp"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("world", [1, 2])
def test_fused_head_trains_as_the_logits_do(runs: dict[int, tuple[dict, Path]], world: int) -> None:
    """``fused_head: true`` (log-probs from the hidden states and the head's weight, sharded over
    2 ranks or not): the same 3 steps' metrics and final weights as the plain head's."""
    result, out = runs[world]
    _same_metrics(result["metrics_fused"], result["metrics_a"])
    plain, fused = _load(out / "final_a.pt"), _load(out / "final_fused.pt")
    assert plain.keys() == fused.keys()
    for key in plain:
        torch.testing.assert_close(
            fused[key], plain[key], atol=WEIGHT_ATOL, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )


def test_a_sequence_parallel_group_trains_as_one_rank(runs: dict[int, tuple[dict, Path]]) -> None:
    """``sequence_parallel_size: 2`` on 2 ranks (their rows pooled, each rank half of every
    micro-batch's positions, attention over all of them through the all-to-alls): the same 3
    steps' metrics, final weights and log-probs as one rank without it; with the fused head in the
    packed layout, the same as one rank's fused head."""
    (two, d2), (one, d1) = runs[2], runs[1]
    _same_metrics(two["metrics_sp"], one["metrics_a"])
    _same_metrics(two["metrics_sp_fused_packed"], one["metrics_fused"])
    # the budget counts one rank's slice: 7 pooled rows of <= 10 tokens in 40-token micro-batches
    assert [m["num_micro_batches"] for m in two["metrics_sp"]] == [2.0, 2.0, 2.0]
    w1, w2 = _load(d1 / "final_a.pt"), _load(d2 / "final_sp.pt")
    assert w1.keys() == w2.keys()
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], atol=WEIGHT_ATOL, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    torch.testing.assert_close(_load(d2 / "logprobs_sp.pt"), _load(d1 / "logprobs.pt")["trained"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_reproduces_training_exactly(runs: dict[int, tuple[dict, Path]], world: int) -> None:
    result, out = runs[world]
    _same_metrics(result["metrics_b"], result["metrics_a"][1:], exact=True)
    a, b = _load(out / "final_a.pt"), _load(out / "final_b.pt")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    meta = json.loads((out / "ckpt" / "meta.json").read_text())
    assert meta["step"] == 1 and meta["world_size"] == world
    rng_files = sorted(p.name for p in (out / "ckpt" / "rng").iterdir())
    assert rng_files == sorted(f"rank{r}.{ext}" for r in range(world) for ext in ("json", "safetensors"))
    assert not list((out / "ckpt").rglob("*.pt")), "nothing in a checkpoint may need unpickling"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no partial dirs left


def test_two_rank_checkpoint_resumes_on_one_rank(runs: dict[int, tuple[dict, Path]]) -> None:
    one, d1 = runs[1]
    _same_metrics(one["metrics_c"], one["metrics_a"][1:])
    a, c = _load(d1 / "final_a.pt"), _load(d1 / "final_c.pt")
    for key in a:
        torch.testing.assert_close(c[key], a[key], atol=WEIGHT_ATOL, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


def test_two_rank_export_loads_in_transformers(runs: dict[int, tuple[dict, Path]]) -> None:
    from transformers import AutoModelForCausalLM

    _two, d2 = runs[2]
    model = AutoModelForCausalLM.from_pretrained(d2 / "export", dtype=torch.float32)
    final = _load(d2 / "final_a.pt")
    state = model.state_dict()
    assert state.keys() == final.keys()
    for key in final:
        assert torch.equal(state[key], final[key]), key
