"""The CUDA path of the hf engine's decoding (skipped without a GPU): CUDA graphs of the decoding
step against the same step run eagerly, no host synchronisation per token, graphs reused across
calls and following weight updates, and the behaviour log-probs against the model's forward.

Speed is measured by ``benchmarks/hf_generation.py``, not here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from core_rl.interfaces import SamplingParams
from core_rl_hf.config import HFRolloutConfig
from core_rl_hf.decode import LeanStepper
from core_rl_hf.decode_state import DecodeState
from core_rl_hf.engine import HFRolloutEngine
from core_rl_hf.generation import _decode, left_pad
from core_rl_hf.graphs import GraphedDecoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB, PAD, STEPS = 512, 0, 40
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
#: behaviour log-probs of bf16 generation against the bf16 forward over the whole sequence
BF16_LOGPROB_TOLERANCE = 0.05


def _model(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(config).to("cuda", dtype).eval()


@pytest.fixture(scope="module")
def bf16_model() -> torch.nn.Module:
    return _model(torch.bfloat16)


def _decoding(model: torch.nn.Module, sampling: SamplingParams, seed: int) -> tuple[LeanStepper, DecodeState, tuple]:
    """A static stepper and a state for ``PROMPTS`` x 2 samples, with the prefill to load them."""
    input_ids, mask, positions = left_pad(PROMPTS, PAD, torch.device("cuda"))
    rows = torch.arange(len(PROMPTS), device="cuda").repeat_interleave(2)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    out.past_key_values.reorder_cache(rows)
    prefill = (out.past_key_values, mask[rows], positions[rows, -1:])
    stepper = LeanStepper(model, *prefill, input_ids.shape[1] + STEPS + 8, static=True)
    generator = torch.Generator("cuda").manual_seed(seed)
    state = DecodeState(len(rows), STEPS, VOCAB, sampling, stop_ids=[1], pad_token_id=PAD, device=rows.device)
    state.generator = generator
    return stepper, state, (prefill, out.logits[rows, -1].float())


def _eager(stepper: LeanStepper, state: DecodeState) -> Callable[[], None]:
    """One decoding step launched from Python (what a graph replays)."""
    return lambda: state.choose(stepper.step(state.feed))


@pytest.mark.parametrize("greedy", [True, False])
@torch.inference_mode()
def test_graph_replay_equals_the_eager_steps(bf16_model: torch.nn.Module, greedy: bool) -> None:
    """The same static step replayed from a graph and run eagerly: the same kernels on the same
    shapes, so the same tokens and log-probs bit for bit, sampled ones too (the same seed: a replay
    advances the generator as an eager step does, and the capture's draws are undone)."""
    sampling = SamplingParams(greedy=greedy, temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=STEPS)
    results = []
    for graphed in (False, True):
        stepper, state, (prefill, logits) = _decoding(bf16_model, sampling, seed=7)
        if graphed:
            decoder = GraphedDecoder(stepper, state)
            stepper.load(*prefill)
            state.reset()
            advance = decoder.replay
        else:
            advance = _eager(stepper, state)
        state.choose(logits)
        _decode(state, advance, STEPS, sync_every=8, keep=None, interrupted=None)
        results.append(state.results())
    (tokens_a, lps_a, len_a, stop_a), (tokens_b, lps_b, len_b, stop_b) = results
    assert (tokens_a, len_a, stop_a) == (tokens_b, len_b, stop_b)
    assert lps_a == lps_b
    assert len({tuple(t) for t in tokens_a}) > 1  # rows differ (not a degenerate run)


@torch.inference_mode()
def test_no_host_synchronisation_between_checks(bf16_model: torch.nn.Module) -> None:
    """``torch.cuda.set_sync_debug_mode("error")`` raises on any host synchronisation (``.item()``,
    ``.tolist()``, ``nonzero``, a device-to-host copy): none happens while decoding, eagerly (static
    and not) or from the graph, when no check of the finished rows falls inside."""
    sampling = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=STEPS, min_new_tokens=2)
    for mode in ("eager", "static", "graph"):
        stepper, state, (prefill, logits) = _decoding(bf16_model, sampling, seed=1)
        if mode == "eager":
            stepper = LeanStepper(bf16_model, *prefill, stepper.capacity)
        advance = _eager(stepper, state)
        if mode == "graph":
            advance = GraphedDecoder(stepper, state).replay
            stepper.load(*prefill)
            state.reset()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            state.choose(logits)
            _decode(state, advance, STEPS, sync_every=STEPS + 1, keep=None, interrupted=lambda: False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert state.t.item() == STEPS, mode  # every token was decoded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from core_rl.testing.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("hf_gpu") / "model"
    return build_tiny_model(
        path, seed=0, architecture="llama", hidden_size=128, num_layers=3, num_heads=4, intermediate_size=256
    )


def _engine(model_dir: Path, **options: object) -> HFRolloutEngine:
    return HFRolloutEngine(model_dir, HFRolloutConfig(device="cuda", seed=3, **options))


def test_engine_graphs_match_eager_and_follow_weight_updates(model_dir: Path) -> None:
    """float32: the graphed engine gives the eager engine's greedy tokens (log-probs to 1e-4: the
    graph attends over all positions, masked), captures once for repeated calls of one shape, and
    a weight update (in place) reaches the graph."""
    prompts = [[1, 5, 6, 7], [1, 8], [1, 3, 4, 5, 6]]
    greedy = SamplingParams(n=2, greedy=True, max_new_tokens=24)
    graphed, eager = _engine(model_dir, cuda_graphs=True), _engine(model_dir, cuda_graphs=False)
    try:
        assert graphed.graphs is not None and eager.graphs is None
        for _ in range(2):
            a, b = graphed.generate(prompts, greedy), eager.generate(prompts, greedy)
            for ga, gb in zip(a, b):
                for sa, sb in zip(ga, gb):
                    assert (sa.response_ids, sa.finish_reason) == (sb.response_ids, sb.finish_reason)
                    torch.testing.assert_close(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-4, rtol=0)
        assert graphed.graphs.captures == 1 and graphed.graphs.capture_seconds > 0
        scaled = {k: v * 1.5 if "mlp" in k else v for k, v in eager.model.state_dict().items()}
        before = graphed.generate(prompts, greedy)
        graphed.update_weights(scaled, 1)
        eager.update_weights(scaled, 1)
        after, expected = graphed.generate(prompts, greedy), eager.generate(prompts, greedy)
        assert [[s.response_ids for s in g] for g in after] == [[s.response_ids for s in g] for g in expected]
        assert [[s.logprobs for s in g] for g in after] != [[s.logprobs for s in g] for g in before]
    finally:
        graphed.close()
        eager.close()


def test_bf16_graphed_logprobs_match_the_forward(model_dir: Path) -> None:
    """bf16 weights, sampled with CUDA graphs: each behaviour log-prob is the bf16 forward's over the
    whole sequence to :data:`BF16_LOGPROB_TOLERANCE`; a seeded engine repeats its samples."""
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=32)
    engine = _engine(model_dir, dtype="bfloat16", cuda_graphs=True)
    try:
        state = engine.state_dict()
        first = engine.generate(prompts, sampling)
        engine.load_state_dict(state)
        again = engine.generate(prompts, sampling)
        assert [[s.response_ids for s in g] for g in first] == [[s.response_ids for s in g] for g in again]
        worst = 0.0
        with torch.inference_mode():
            for group in first:
                for s in group:
                    ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
                    logits = engine.model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
                    expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(s.prompt_ids) :, None])[:, 0]
                    worst = max(worst, (expected.cpu() - torch.tensor(s.logprobs)).abs().max().item())
        assert worst < BF16_LOGPROB_TOLERANCE
    finally:
        engine.close()


def test_engine_graphs_with_penalties_match_eager(model_dir: Path) -> None:
    """float32, greedy with repetition and presence penalties: the graphed engine gives the eager
    engine's tokens for two batches of different prompts replayed by one captured step (the
    penalties' per-row record is reloaded from each batch's prompts)."""
    sampling = SamplingParams(n=2, greedy=True, max_new_tokens=16, repetition_penalty=1.8, presence_penalty=0.5)
    batches = [[[1, 5, 6, 7], [1, 8], [1, 3, 4, 5, 6]], [[1, 9, 9, 10], [1, 11], [1, 12, 13, 12, 13]]]
    graphed, eager = _engine(model_dir, cuda_graphs=True), _engine(model_dir, cuda_graphs=False)
    try:
        for prompts in batches:
            a, b = graphed.generate(prompts, sampling), eager.generate(prompts, sampling)
            assert [[s.response_ids for s in g] for g in a] == [[s.response_ids for s in g] for g in b]
            for ga, gb in zip(a, b):
                for sa, sb in zip(ga, gb):
                    torch.testing.assert_close(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-4, rtol=0)
        assert graphed.graphs.captures == 1
    finally:
        graphed.close()
        eager.close()
