"""Distillation over the teacher's top-k distribution (``teacher.loss: topk_forward_kl``): the loss
against hand values, against the full forward KL from whole logits (k = the vocabulary), its
gradient (``pi - q`` on the policy's logits, and autograd of a second formulation), the teacher's
top-k and the policy's log-probs of given ids through a real model in both layouts, the
configuration's refusals, and real fsdp engines where the policy's forward KL to another tiny model
falls."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from core_rl import ops
from core_rl_train_kit import logprobs as logprobs_module
from core_rl_train_kit.topk_logprobs import logprobs_at, topk_logprobs
from hypothesis import given, settings
from hypothesis import strategies as st


def test_the_loss_on_a_hand_example() -> None:
    # teacher top-2 probabilities 0.5 and 0.25 -> q = (2/3, 1/3); the policy gives them 0.4 and 0.1
    teacher = torch.tensor([[math.log(0.5), math.log(0.25)]])
    student = torch.tensor([[math.log(0.4), math.log(0.1)]], requires_grad=True)
    want = 2 / 3 * (math.log(2 / 3) - math.log(0.4)) + 1 / 3 * (math.log(1 / 3) - math.log(0.1))
    loss = ops.topk_forward_kl_loss(teacher, student)
    assert loss.shape == (1,)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.sum().backward()
    assert student.grad is not None
    torch.testing.assert_close(student.grad, torch.tensor([[-2 / 3, -1 / 3]]))  # -q
    # the teacher's side carries no gradient
    teacher.requires_grad_(True)
    ops.topk_forward_kl_loss(teacher, student).sum().backward()
    assert teacher.grad is None


def _full_forward_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    log_t = torch.log_softmax(teacher_logits.double() / temperature, -1)
    log_s = torch.log_softmax(student_logits.double() / temperature, -1)
    return (log_t.exp() * (log_t - log_s)).sum(-1)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(2, 12),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    seed=st.integers(0, 10**6),
)
def test_with_k_the_vocabulary_it_is_the_full_forward_kl(rows: int, vocab: int, temperature: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    teacher_logits, student_logits = (torch.randn(rows, vocab, generator=gen) * 3 for _ in range(2))
    ids, teacher_lp = topk_logprobs(teacher_logits, vocab, temperature)
    loss = ops.topk_forward_kl_loss(teacher_lp, logprobs_at(student_logits, ids, temperature))
    want = _full_forward_kl(teacher_logits, student_logits, temperature)
    torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 9),
    vocab=st.integers(3, 16),
    k_fraction=st.floats(0.1, 0.9),
    temperature=st.sampled_from([0.6, 1.0, 1.3]),
    chunk_rows=st.integers(1, 4),
    seed=st.integers(0, 10**6),
)
def test_the_gradient_is_the_policy_minus_the_renormalised_teacher(
    rows: int, vocab: int, k_fraction: float, temperature: float, chunk_rows: int, seed: int
) -> None:
    """Through the chunked log-probs at the teacher's ids (chunks of ``chunk_rows`` rows): the
    gradient with respect to the policy's logits is ``(pi - q) / temperature``, ``q`` the teacher
    renormalised over its top k (0 elsewhere), and equals autograd's through a direct
    ``log_softmax(...).gather(...)``."""
    k = max(1, int(k_fraction * vocab))
    gen = torch.Generator().manual_seed(seed)
    teacher_logits = torch.randn(rows, vocab, generator=gen) * 2
    student_logits = (torch.randn(rows, vocab, generator=gen) * 2).requires_grad_(True)
    ids, teacher_lp = topk_logprobs(teacher_logits, k, temperature)
    old = logprobs_module.CHUNK_ELEMENTS
    logprobs_module.CHUNK_ELEMENTS = chunk_rows * vocab
    try:
        loss = ops.topk_forward_kl_loss(teacher_lp, logprobs_at(student_logits, ids, temperature))
        (grad,) = torch.autograd.grad(loss.sum(), student_logits)
    finally:
        logprobs_module.CHUNK_ELEMENTS = old

    p_student = torch.softmax(student_logits.detach() / temperature, -1)
    q = torch.zeros(rows, vocab).scatter(-1, ids, torch.softmax(teacher_lp, -1))
    torch.testing.assert_close(grad, (p_student - q) / temperature, atol=1e-6, rtol=1e-5)

    direct = torch.log_softmax(student_logits / temperature, -1).gather(-1, ids)
    (want,) = torch.autograd.grad(ops.topk_forward_kl_loss(teacher_lp, direct).sum(), student_logits)
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-5)


def test_the_teacher_top_k_is_sorted_and_the_vocabulary_bounds_k() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    ids, lp = topk_logprobs(logits, 2)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[:, [1, 2]])
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        topk_logprobs(logits, 5)


def test_the_top_k_is_taken_among_the_students_vocabulary() -> None:
    """A teacher whose embedding pads past the student's vocabulary: with ``vocab_size`` its top k
    are ids the student has, their log-probs those of the softmax over the shared tokens."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 9.0, 8.0], [3.0, -1.0, 0.5, 0.0, 7.0]])  # ids 3, 4: padding rows
    ids, lp = topk_logprobs(logits, 2, vocab_size=3)
    assert ids.tolist() == [[1, 2], [0, 2]]
    shared = torch.log_softmax(logits[:, :3], -1)
    torch.testing.assert_close(lp, shared.gather(-1, ids))
    with pytest.raises(ValueError, match=r"k must be in \[1, 3\]"):
        topk_logprobs(logits, 4, vocab_size=3)


def test_log_probs_at_given_ids_keep_the_logits_not_a_copy() -> None:
    """What backward keeps of the whole logits is the logits' own storage (a sliced copy of a
    [b, T, V] tensor would double the largest activation of the step)."""
    logits = torch.randn(3, 5, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5, 2))
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        logprobs_at(logits, ids, 0.9).sum().backward()
    large = [t for t in kept if t.numel() == logits.numel()]
    assert large and all(t.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr() for t in large)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A policy and a different teacher (other random weights), sharing the char tokenizer."""
    from core_rl.testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("topk")
    small = {"alphabet": "ab=", "hidden_size": 16, "num_heads": 2, "intermediate_size": 32}
    return build_tiny_model(root / "student", seed=0, **small), build_tiny_model(root / "teacher", seed=7, **small)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_models_top_k_and_log_probs_of_given_ids_in_the_token_alignment(
    two_models: tuple[Path, Path], layout: str
) -> None:
    from core_rl_train_kit.packed import forward_logprobs, forward_logprobs_at, forward_topk
    from transformers import AutoModelForCausalLM

    student, teacher = (AutoModelForCausalLM.from_pretrained(p).float() for p in two_models)
    ids = torch.tensor([[3, 4, 5, 3, 4, 0], [4, 4, 3, 0, 0, 0]])
    mask = (torch.arange(6)[None] < torch.tensor([[5], [3]])).long()
    with torch.no_grad():
        top_ids, top_lp = forward_topk(teacher, ids, mask, 3, temperature=0.7, layout=layout)
        lp, ent, at = forward_logprobs_at(
            student, ids, mask, top_ids, temperature=0.7, with_entropy=True, layout=layout
        )
        want_lp, want_ent = forward_logprobs(student, ids, mask, temperature=0.7, with_entropy=True, layout=layout)
        teacher_logp = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits / 0.7, -1)
        student_logp = torch.log_softmax(student(input_ids=ids, attention_mask=mask).logits / 0.7, -1)
    torch.testing.assert_close(lp, want_lp)
    torch.testing.assert_close(ent, want_ent)
    for row, length in enumerate((5, 3)):
        for t in range(1, length):  # token t is predicted at t - 1
            want_vals, want_ids = teacher_logp[row, t - 1].topk(3)
            assert top_ids[row, t].tolist() == want_ids.tolist()
            torch.testing.assert_close(top_lp[row, t], want_vals, atol=1e-5, rtol=0)
            torch.testing.assert_close(at[row, t], student_logp[row, t - 1, top_ids[row, t]], atol=1e-5, rtol=0)
        # among the first 4 tokens only (a student with a smaller vocabulary): the softmax over those
        shared_ids, shared_lp = forward_topk(
            teacher, ids[row : row + 1], mask[row : row + 1], 2, temperature=0.7, vocab_size=4, layout=layout
        )
        for t in range(1, length):
            shared = torch.log_softmax(teacher_logp[row, t - 1, :4], -1)
            want_vals, want_ids = shared.topk(2)
            assert shared_ids[0, t].tolist() == want_ids.tolist()
            torch.testing.assert_close(shared_lp[0, t], want_vals, atol=1e-5, rtol=0)
        # column 0 (no prediction) and padding hold 0
        for t in [0, *range(length, 6)]:
            assert (
                top_ids[row, t].tolist() == [0, 0, 0]
                and top_lp[row, t].abs().sum() == 0
                and at[row, t].abs().sum() == 0
            )


def _config(tmp_path: Path, model: Path, *overrides: str):
    from core_rl.config import load_config
    from core_rl.plugins.host import PluginHost
    from core_rl.testing.launch import write_grpo_config

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in ("ab", "ba")))
    teacher = {"model_path": str(model), "engine": {"name": "fsdp"}}
    return load_config(
        write_grpo_config(tmp_path, model, [str(data)], teacher=teacher), list(overrides), host=PluginHost()
    )


def test_the_configuration_refuses_what_top_k_distillation_cannot_run_with(
    tmp_path: Path, two_models: tuple[Path, Path]
) -> None:
    from importlib.util import find_spec

    from core_rl.errors import ConfigError

    pytest.importorskip("core_rl_fsdp")
    model = two_models[0]
    default = _config(tmp_path, model)
    assert default.teacher is not None and (default.teacher.loss, default.teacher.top_k) == ("reverse_kl", 20)
    topk = ("teacher.loss=topk_forward_kl", "teacher.top_k=5")
    assert _config(tmp_path, model, *topk).teacher.loss == "topk_forward_kl"

    def problems(*overrides: str) -> list[str]:
        with pytest.raises(ConfigError) as info:
            _config(tmp_path, model, *overrides)
        return info.value.problems

    assert problems("teacher.loss=kl") == ["teacher.loss: must be one of 'reverse_kl', 'topk_forward_kl', got 'kl'"]
    assert problems("teacher.top_k=0") == ["teacher.top_k: must be in [1, 1048576], got 0"]
    assert problems(*topk, "actor.fused_head=true", "teacher.fused_head=true") == [
        f"{role}.fused_head: teacher.loss: topk_forward_kl needs the {role}'s whole logits, which the fused head "
        "never forms; set it to false"
        for role in ("actor", "teacher")
    ]
    assert problems("teacher.loss=topk_forward_kl", "teacher.top_k=8") == [
        "teacher.top_k: 8, more than the 7 tokens of the teacher's and the actor's vocabulary (the top k are taken "
        "among the tokens both models have); set it to at most 7"
    ]
    # the same settings with the default loss are fine
    _config(tmp_path, model, "teacher.top_k=8", "actor.fused_head=true")
    sp = problems(*topk, "teacher.engine.sequence_parallel_size=2")
    assert any(p.startswith("teacher.engine.sequence_parallel_size: 2; teacher.loss: topk_forward_kl") for p in sp)
    if find_spec("core_rl_megatron") is not None:
        assert any(
            p.startswith(
                "teacher.engine.name: train engine 'megatron' (distribution core-rl-megatron) does not compute"
            )
            and p.endswith("use fsdp or deepspeed, or set teacher.loss: reverse_kl")
            for p in problems(*topk, "teacher.engine.name=megatron")
        )


def _topk_run(tmp_path: Path, two_models: tuple[Path, Path], rl_coef: float) -> Path:
    """A GRPO run's config with a top-k teacher of other weights than the policy's (fsdp engines)."""
    from core_rl.testing.launch import write_grpo_config

    pytest.importorskip("core_rl_fsdp")
    student, teacher = two_models
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in ("ab", "ba", "aa", "bb")))
    sections = {
        "teacher": {"model_path": str(teacher), "loss": "topk_forward_kl", "top_k": 4, "rl_coef": rl_coef},
        "data": {"train_files": [str(data)], "batch_size": 4},
        "loggers": [],
        "saver": {"export_hf": False, "every_n_steps": 0, "at_end": False},
    }
    return write_grpo_config(tmp_path, student, [], **sections)


def test_a_run_distils_the_teachers_top_k_and_the_forward_kl_falls(
    tmp_path: Path, two_models: tuple[Path, Path]
) -> None:
    """``core-rl train`` with real fsdp engines for the policy and a teacher of other weights, the
    distillation term alone: the policy's forward KL to the teacher over its top k falls."""
    from core_rl import cli
    from core_rl.builtin.loggers import read_metrics

    config = _topk_run(tmp_path, two_models, rl_coef=0.0)
    overrides = ["trainer.total_steps=8", "actor.optimizer.lr=0.02", "rollout.sampling.max_new_tokens=6"]
    assert cli.main(["train", str(config), *overrides]) == 0
    rows = read_metrics(tmp_path / "runs" / "run" / "metrics.jsonl")
    kl = [row["actor/distill_kl"] for row in rows]
    assert len(kl) == 8 and all(value > 0 for value in kl)
    assert sum(kl[-2:]) < 0.7 * sum(kl[:2]), kl


def test_two_data_parallel_ranks_distil_as_one(tmp_path: Path, two_models: tuple[Path, Path]) -> None:
    """The teacher's top-k ids and log-probs are computed on each rank's rows and gathered into the
    global batch like the other log-probs: 2 CPU ranks give the metrics of 1 (with the RL term on)."""
    from core_rl import cli
    from core_rl.builtin.loggers import read_metrics
    from core_rl.testing.launch import run_torchrun

    config = _topk_run(tmp_path, two_models, rl_coef=0.5)
    command = ["train", str(config), "trainer.total_steps=2", "actor.optimizer.lr=0.02"]
    for ranks in (1, 2):  # CPU ranks both (in this process, a GPU machine's run would compute on its GPU)
        run_torchrun(Path(cli.__file__), ranks, *command, f"experiment.name=dp{ranks}", timeout=300)
    one, two = (read_metrics(tmp_path / "runs" / f"dp{ranks}" / "metrics.jsonl") for ranks in (1, 2))
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        for key in ("actor/loss", "actor/distill_kl", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert one[1]["actor/distill_kl"] != one[0]["actor/distill_kl"]  # the first step moved the policy


def test_the_distillation_loss_adds_the_top_k_term_to_the_algorithms() -> None:
    """``rl_coef * base + distill_coef * KL_topk * response_mask``; the policy's log-probs of the
    teacher's ids are asked for by ``logprobs_at_key`` (also through the ptx wrapper), and no
    sampled-token teacher log-probs are needed."""
    from core_rl.config.schema import TeacherConfig
    from core_rl.interfaces import LOGPROBS_AT, LossOutput, PolicyLoss
    from core_rl.loops.rl.distill import DistillationLoss
    from core_rl.loops.rl.ptx import PTXLoss
    from core_rl.protocol import TensorBatch

    class Base(PolicyLoss):
        def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
            return response_mask

        def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
            return LossOutput(per_token_loss=-2 * logprobs, token_metrics={"base": logprobs.detach()})

    teacher = TeacherConfig(model_path="t", loss="topk_forward_kl", top_k=2, rl_coef=0.5, distill_coef=3.0)
    loss = DistillationLoss(Base(), teacher)
    assert loss.logprobs_at_key == "teacher_topk_ids" and PTXLoss(loss).logprobs_at_key == "teacher_topk_ids"
    assert DistillationLoss(Base(), TeacherConfig(model_path="t")).logprobs_at_key is None
    half, quarter = math.log(0.5), math.log(0.25)
    batch = TensorBatch(
        {
            "response_mask": torch.tensor([[0.0, 1.0]]),
            "loss_mask": torch.tensor([[0.0, 1.0]]),
            "teacher_topk_logprobs": torch.tensor([[[half, quarter], [half, quarter]]]),
            LOGPROBS_AT: torch.tensor([[[half, half], [math.log(0.4), math.log(0.1)]]]),
        }
    )
    assert loss.prepare(batch) == {}
    logprobs = torch.tensor([[-1.0, -0.5]])
    out = loss(batch, logprobs, torch.zeros(1, 2))
    kl = 2 / 3 * (math.log(2 / 3) - math.log(0.4)) + 1 / 3 * (math.log(1 / 3) - math.log(0.1))
    torch.testing.assert_close(out.per_token_loss, torch.tensor([[0.5 * 2.0, 0.5 * 1.0 + 3.0 * kl]]))
    torch.testing.assert_close(out.token_metrics["distill_kl"], torch.tensor([[0.0, kl]]))
    assert "base" in out.token_metrics


def test_an_engine_that_ignores_the_vocabulary_cut_is_named() -> None:
    """A teacher engine returning an id at or past the ``vocab_size`` it was given (injected) is a
    plugin fault naming it, before the policy's gather could index out of range; without a cut the
    keyword is not passed at all (engines written without it keep working)."""
    from core_rl.errors import PluginFault
    from core_rl.plugins.guards import engine_topk
    from core_rl.protocol import TensorBatch

    seen: list[dict] = []

    class Padded:
        def compute_topk_logprobs(self, batch, k, **kwargs):
            seen.append(kwargs)
            shape = (*batch["input_ids"].shape, k)
            return torch.full(shape, 9, dtype=torch.long), torch.zeros(shape)

    part = TensorBatch({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    assert engine_topk(Padded(), part, 2, temperature=1.0)["teacher_topk_ids"].max() == 9
    with pytest.raises(PluginFault, match=r"returned token id 9, outside the vocabulary of 8 tokens"):
        engine_topk(Padded(), part, 2, vocab_size=8, temperature=1.0)
    assert seen == [{"temperature": 1.0}, {"temperature": 1.0, "vocab_size": 8}]
