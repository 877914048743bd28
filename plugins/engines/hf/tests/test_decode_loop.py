"""The device-side decoding loop (``generate_batch`` with :class:`core_rl_hf.decode_state.DecodeState`)
against the loop it replaced, which read the number of finished rows back to the host every token
and kept its bookkeeping with boolean indexing, over random prompt lengths, stop sets,
``min_new_tokens`` and ``max_new_tokens`` on a CPU in float32:

- at ``sync_every: 1`` the batch loses its finished rows at the same tokens as the old loop's, so
  tokens, log-probs and finish reasons are equal bit for bit, greedy or sampled with the same seed;
- at a larger ``sync_every`` (greedy) finished rows stay in the batch for up to ``sync_every - 1``
  more tokens, so the live rows' steps run at another batch size, whose matrix kernels may round
  differently: the same tokens and finish reasons, log-probs equal to float32 rounding (a 4-row
  and a 2-row step differ by 2.4e-7 at -3.0 in the example pinned below)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import pytest
import torch
from core_rl.interfaces import SamplingParams
from core_rl_hf.decode import make_stepper
from core_rl_hf.decode_state import DecodeState
from core_rl_hf.generation import generate_batch, left_pad
from core_rl_hf.sampling import choose_tokens
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

VOCAB, PAD = 24, 0


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config).eval()


@torch.inference_mode()
def old_loop(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    counts: Sequence[int],
    sampling: SamplingParams,
    stop_ids: list[int],
    generator: torch.Generator | None,
) -> list[tuple[list[int], list[float], str]]:
    """The previous ``generate_batch`` loop (one host read of the finished count per token)."""
    input_ids, attention_mask, position_ids = left_pad(prompts, PAD, torch.device("cpu"))
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
    )
    rows = torch.repeat_interleave(torch.arange(len(prompts)), torch.as_tensor(counts))
    cache = out.past_key_values
    cache.reorder_cache(rows)
    steps = sampling.max_new_tokens
    stepper = make_stepper(
        model, cache, attention_mask[rows], position_ids[rows, -1:], input_ids.shape[1] + steps, lean=True
    )
    logits = out.logits[rows, -1].float()
    total = len(rows)
    stop_mask = torch.zeros(VOCAB, dtype=torch.bool)
    stop_mask[stop_ids] = True
    tokens = torch.full((total, steps), PAD, dtype=torch.long)
    logprobs = torch.zeros((total, steps))
    lengths = torch.full((total,), steps, dtype=torch.long)
    stopped = torch.zeros(total, dtype=torch.bool)
    sequence, done = torch.arange(total), torch.zeros(total, dtype=torch.bool)
    for t in range(steps):
        blocked = stop_mask if t < sampling.min_new_tokens else None
        next_tokens, next_logprobs = choose_tokens(logits, sampling, blocked=blocked, generator=generator)
        live = sequence[~done]
        tokens[live, t] = next_tokens[~done]
        logprobs[live, t] = next_logprobs[~done]
        new_stop = ~done & torch.isin(next_tokens, torch.tensor(stop_ids))
        lengths[sequence[new_stop]] = t + 1
        stopped[sequence[new_stop]] = True
        done |= new_stop
        n_done = int(done.sum())
        if t + 1 == steps or n_done == len(done):
            break
        if 4 * n_done >= len(done):
            keep = (~done).nonzero().squeeze(-1)
            stepper.keep(keep)
            sequence, next_tokens, done = sequence[keep], next_tokens[keep], done[keep]
        logits = stepper.step(next_tokens.masked_fill(done, PAD))
    return [
        (tokens[i, : lengths[i]].tolist(), logprobs[i, : lengths[i]].tolist(), "stop" if stopped[i] else "length")
        for i in range(total)
    ]


def new_loop(model, prompts, counts, sampling, stop_ids, generator, sync_every: int):
    groups = generate_batch(
        model,
        prompts,
        counts,
        sampling,
        eos_token_ids=stop_ids,
        pad_token_id=PAD,
        generator=generator,
        sync_every=sync_every,
    )
    return [(c.token_ids, c.logprobs, c.finish_reason) for group in groups for c in group]


cases = st.fixed_dictionaries(
    {
        "prompts": st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6), min_size=1, max_size=3),
        "count": st.integers(1, 3),
        "stops": st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=4, unique=True),
        "max_new": st.integers(1, 12),
        "min_new": st.integers(0, 5),
        "sync_every": st.integers(1, 6),
        "greedy": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


def assert_same_generation(got: list, expected: list, sync_every: int) -> None:
    """Equal bit for bit at ``sync_every`` 1; else the same tokens and finish reasons, and
    log-probs equal to float32 rounding (see the module docstring)."""
    if sync_every == 1:
        assert got == expected
        return
    assert [(ids, reason) for ids, _, reason in got] == [(ids, reason) for ids, _, reason in expected]
    for (_, got_lp, _), (_, expected_lp, _) in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(expected_lp), rtol=1e-6, atol=1e-6)


# a case where a 4-row step (sync_every 2 keeps the stopped rows) and the old loop's 2-row step round apart
PINNED = {"prompts": [[1], [2]], "count": 2, "stops": [2], "max_new": 2, "min_new": 0, "sync_every": 2, "greedy": True}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases)
@example(case={**PINNED, "seed": 0})
@example(case={**PINNED, "sync_every": 1, "seed": 0})
def test_new_loop_equals_the_old_one(model: torch.nn.Module, case: dict) -> None:
    sampling = SamplingParams(
        max_new_tokens=case["max_new"],
        min_new_tokens=case["min_new"],
        greedy=case["greedy"],
        temperature=0.7,
        top_k=10,
        top_p=0.95,
    )
    counts = [case["count"]] * len(case["prompts"])
    # with sampling, rows dropped at other tokens draw other noise: compare at sync_every 1 there
    sync_every = case["sync_every"] if case["greedy"] else 1
    expected = old_loop(
        model, case["prompts"], counts, sampling, case["stops"], torch.Generator().manual_seed(case["seed"])
    )
    got = new_loop(
        model, case["prompts"], counts, sampling, case["stops"], torch.Generator().manual_seed(case["seed"]), sync_every
    )
    assert_same_generation(got, expected, sync_every)


def test_stops_and_min_new_tokens_are_exercised(model: torch.nn.Module) -> None:
    """Guard the property test's inputs: greedy rows of one batch stop at different tokens, a
    stop id blocked by ``min_new_tokens`` is replaced, and the results still equal the old loop's
    at every ``sync_every``."""
    prompts, sampling = [[1, 2, 3], [5], [7, 8]], SamplingParams(max_new_tokens=10, greedy=True)
    free = new_loop(model, prompts, [1, 1, 1], sampling, [], None, 1)
    first = [ids[2] for ids, _, _ in free]  # the third token of each row, made a stop id
    got = new_loop(model, prompts, [1, 1, 1], sampling, first, None, 4)
    assert all(len(ids) <= 3 and reason == "stop" for ids, _, reason in got)
    assert_same_generation(got, old_loop(model, prompts, [1, 1, 1], sampling, first, None), 4)
    late = SamplingParams(max_new_tokens=10, greedy=True, min_new_tokens=4)
    blocked = new_loop(model, prompts, [1, 1, 1], late, first, None, 3)
    assert all(len(ids) >= 5 for ids, _, _ in blocked)
    assert blocked == old_loop(model, prompts, [1, 1, 1], late, first, None)


def test_host_reads_back_only_every_sync_every_tokens(model: torch.nn.Module, monkeypatch) -> None:
    """The finished count is the only value read back while decoding: once per ``sync_every`` tokens."""
    reads: list[int] = []
    finished = DecodeState.finished
    monkeypatch.setattr(DecodeState, "finished", lambda self: reads.append(1) or finished(self))
    sampling = SamplingParams(max_new_tokens=20, greedy=True)
    new_loop(model, [[1, 2, 3]], [4], sampling, [], None, 8)
    assert len(reads) == 2  # before tokens 8 and 16 of 20


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_graph_path_wiring_on_cpu(make_engine, tiny_state_dict, monkeypatch, autocast: str | None) -> None:
    """The engine's CUDA graph path run on a CPU with the capture replaced by the eager step (CUDA
    graphs themselves are tested in test_gpu.py): static buffers of a bucketed capacity, reused
    by a second call (one entry), reloaded per call and following weight updates (in place,
    including the bf16 weight copies, which every kept graph shares), give the tokens of the
    engine without graphs."""
    from core_rl_hf.graphs import DecodeGraphs, GraphedDecoder

    monkeypatch.setattr(GraphedDecoder, "_capture", lambda self: type("Eager", (), {"replay": self._advance})())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    graphed, plain = make_engine(autocast_dtype=autocast), make_engine(autocast_dtype=autocast)
    graphed.graphs = DecodeGraphs()
    prompts, sampling = [[1, 5, 6], [1, 7, 8, 9, 10]], SamplingParams(n=2, greedy=True, max_new_tokens=12)

    def outputs(engine):
        return [(s.response_ids, s.finish_reason, s.logprobs) for g in engine.generate(prompts, sampling) for s in g]

    def same(a, b) -> None:
        assert [x[:2] for x in a] == [y[:2] for y in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(torch.tensor(x[2]), torch.tensor(y[2]), atol=1e-5, rtol=0)

    first = outputs(graphed)
    same(first, outputs(plain))
    same(outputs(graphed), first)
    graphed.generate(prompts, SamplingParams(n=2, greedy=True, max_new_tokens=12, temperature=0.5, top_k=3))
    assert graphed.graphs.captures == 1 and len(graphed.graphs._entries) == 1  # greedy reads neither
    changed = {k: v * 1.5 if "mlp" in k else v for k, v in tiny_state_dict.items()}
    for engine in (graphed, plain):
        engine.update_weights(changed, 1)
    after = outputs(graphed)
    same(after, outputs(plain))
    assert [x[2] for x in after] != [x[2] for x in first]
    # a graph of other rows, captured after the update, and the first one after another update:
    # every kept graph reads one copy of the weights (of the compute dtype), kept up to date
    more = [[1, 4], *prompts]

    def outputs_of(engine, batch):
        return [(r.response_ids, r.finish_reason, r.logprobs) for g in engine.generate(batch, sampling) for r in g]

    same(outputs_of(graphed, more), outputs_of(plain, more))
    for engine in (graphed, plain):
        engine.update_weights({k: v * 0.5 if "self_attn" in k else v for k, v in changed.items()}, 2)
    same(outputs(graphed), outputs(plain))
    entries = list(graphed.graphs._entries.values())
    assert len(entries) == 2 and len({id(e.stepper.shared) for e in entries}) == 1
    assert entries[0].stepper.shared.head.dtype == (torch.bfloat16 if autocast else torch.float32)


def test_batches_of_other_sizes_reuse_the_captured_graphs(make_engine, monkeypatch) -> None:
    """With the capture replaced by the eager step (on a CPU): a batch's rows are padded to a power
    of two and it is replayed by a kept graph of those rows with at least its tokens and positions,
    so batches of varying sizes (an asynchronous rollout's, a continuation's) capture only when no
    kept graph fits; each batch gives the greedy tokens of the engine without graphs, and the
    padding rows give nothing back."""
    from core_rl_hf.graphs import DecodeGraphs, GraphedDecoder, bucketed_rows

    monkeypatch.setattr(GraphedDecoder, "_capture", lambda self: type("Eager", (), {"replay": self._advance})())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    graphed, plain = make_engine(), make_engine()
    graphed.graphs = DecodeGraphs()
    prompts = [[1, 5, 6], [1, 7, 8, 9, 10], [1, 4], [1, 3, 3, 3], [1, 9, 8]]
    calls = [  # (prompts, n, max_new_tokens) -> the captures made so far
        ((3, 2, 12), 1),  # 6 rows -> 8: the first capture
        ((5, 1, 12), 1),  # 5 rows -> 8, 12 tokens: the same graph
        ((3, 2, 6), 1),  # fewer tokens to generate (a continuation's): the same graph
        ((1, 2, 12), 2),  # 2 rows: a graph of its own
        ((4, 2, 20), 3),  # 8 rows, more tokens than any kept graph of 8 rows: a new one
        ((3, 2, 12), 3),  # the smallest kept graph that fits, the first
    ]
    for (count, n, tokens), captures in calls:
        sampling = SamplingParams(n=n, greedy=True, max_new_tokens=tokens)
        got = graphed.generate(prompts[:count], sampling)
        expected = plain.generate(prompts[:count], sampling)
        assert [[(s.response_ids, s.finish_reason) for s in g] for g in got] == [
            [(s.response_ids, s.finish_reason) for s in g] for g in expected
        ]
        for g, e in zip(got, expected):
            assert len(g) == n
            for a, b in zip(g, e):
                assert len(a.response_ids) <= tokens and len(a.logprobs) == len(a.response_ids)
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        assert graphed.graphs.captures == captures, (count, n, tokens)
    assert sorted((key[1], steps) for key, steps, _capacity in graphed.graphs._entries) == [(2, 12), (8, 12), (8, 20)]
    assert [bucketed_rows(r) for r in (1, 2, 3, 5, 8, 9, 200)] == [1, 2, 4, 8, 8, 16, 256]
    # never beyond the engine's max_batch_size (the memory a batch may take), unless the batch is
    assert [bucketed_rows(r, 160) for r in (5, 100, 129, 160, 200)] == [8, 128, 160, 160, 200]
    capped = make_engine(max_batch_size=6)
    capped.graphs = DecodeGraphs()
    capped.generate(prompts[:3], SamplingParams(n=2, greedy=True, max_new_tokens=5))  # 6 rows: not 8
    assert [key[1] for key, _steps, _capacity in capped.graphs._entries] == [6]


def test_a_failed_capture_decodes_eagerly_or_fails_naming_the_setting(make_engine, monkeypatch, caplog) -> None:
    """A capture that raises (on a GPU: an operation a CUDA graph cannot hold), injected here on a
    CPU: with ``cuda_graphs: null`` the engine says so once and samples exactly what an engine
    without graphs samples (same seed: the warm-up took no draws that count), and never tries to
    capture again; with ``cuda_graphs: true`` (``required``) the call fails naming the setting."""
    from core_rl_hf.graphs import DecodeGraphs, GraphedDecoder

    attempts = []

    def failing_capture(self, device):
        attempts.append(device)
        self._advance()  # the warm-up draws, as on a GPU, before the capture fails
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedDecoder, "_capture_on", failing_capture)
    monkeypatch.setattr(torch.cuda, "device", lambda _device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    graphed, plain = make_engine(seed=5), make_engine(seed=5)
    graphed.graphs = DecodeGraphs()
    prompts, sampling = [[1, 5, 6], [1, 7, 8, 9, 10]], SamplingParams(n=3, temperature=1.0, max_new_tokens=10)

    def outputs(engine):
        return [(s.response_ids, s.logprobs) for g in engine.generate(prompts, sampling) for s in g]

    with caplog.at_level("WARNING", logger="core_rl_hf.graphs"):
        assert outputs(graphed) == outputs(plain)
        assert outputs(graphed) == outputs(plain)
    assert len(attempts) == 1 and not graphed.graphs.usable and graphed.graphs.captures == 0
    assert "operation not permitted when stream is capturing" in graphed.graphs.failure
    (warning,) = [r.getMessage() for r in caplog.records if "capturing the decoding step failed" in r.getMessage()]
    assert warning.endswith("decoding eagerly from now")

    strict = make_engine(seed=5)
    strict.graphs = DecodeGraphs(required=True)
    with pytest.raises(RuntimeError, match=r"rollout.engine.cuda_graphs: true, but capturing the decoding step failed"):
        strict.generate(prompts, sampling)
