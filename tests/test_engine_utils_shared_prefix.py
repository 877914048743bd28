"""The ``shared`` micro-batch layout (:mod:`core_rl_train_kit.shared_prefix`): the stream of
hand-built rows, the planner keeping groups together within the budget, and parity with the padded
layout (log-probs, entropies, values, the fused head, the gradient and an AdamW step) on a tiny
model and on SmolLM2 with chat-templated prompts."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from core_rl.config.schema import MicroBatchConfig
from core_rl.errors import ConfigError
from core_rl.protocol import TensorBatch
from core_rl.testing import make_grouped_rl_batch, make_rl_batch
from core_rl.testing.helpers import right_padded
from core_rl_train_kit.microbatch import micro_batch_width
from core_rl_train_kit.packed import forward_logprobs, forward_values, resolve_layout, unpack
from core_rl_train_kit.runner import MicroBatchRunner
from core_rl_train_kit.shared_prefix import (
    Planned,
    Unit,
    attention_span,
    best_unit_rows,
    find_units,
    plan_cost,
    plan_units,
    probe,
    share_rows,
    shared_unsupported,
)

# -- the stream of hand-built rows ---------------------------------------------------------------

IDS = torch.tensor(
    [
        [5, 6, 7, 8, 9, 0],  # prompt 5 6 7 (p = 3), response 8 9
        [5, 6, 7, 10, 0, 0],  # the same prompt, response 10
        [3, 4, 11, 12, 13, 14],  # alone
    ]
)
MASK = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])


def test_share_rows_by_hand() -> None:
    s = share_rows(IDS, MASK, [(2, 2), (1, 0)])
    # [5 6 | 7 8 9 | 7 10]: the prompt's last token heads each segment; the lone row as it is, padded
    assert s.input_ids.tolist() == [[5, 6, 7, 8, 9, 7, 10], [3, 4, 11, 12, 13, 14, 3]]
    assert s.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3], [0, 1, 2, 3, 4, 5, 0]]
    # no prediction at a stream row's start, at the second segment's head, on padding
    assert s.continues.tolist() == [[0, 1, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1, 0]]
    # row 1's prompt columns read the shared part and the first segment's head (stream 0, 1, 2)
    assert s.index.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 6, 0, 0], [7, 8, 9, 10, 11, 12]]
    assert torch.equal(s.valid, MASK.bool())
    want0 = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 0],  # the second segment sees the shared part and itself
        [1, 1, 0, 0, 0, 1, 1],
    ]
    want1 = [[int(k <= q) for k in range(7)] for q in range(6)] + [[0, 0, 0, 0, 0, 0, 1]]  # padding: itself
    assert s.attention.shape == (2, 1, 7, 7) and s.attention.dtype == torch.bool
    assert s.attention[0, 0].int().tolist() == want0
    assert s.attention[1, 0].int().tolist() == want1
    additive = share_rows(IDS, MASK, [(2, 2), (1, 0)], additive=True).attention
    assert additive.dtype == torch.float32
    assert torch.equal(additive == 0, s.attention) and (additive[~s.attention] == torch.finfo(torch.float32).min).all()
    values = torch.arange(14, dtype=torch.float32).view(2, 7) + 1
    assert unpack(values, s).tolist() == [[1, 2, 3, 4, 5, 0], [1, 2, 3, 7, 0, 0], [8, 9, 10, 11, 12, 13]]


def test_share_rows_refuses_what_it_cannot_lay_out() -> None:
    with pytest.raises(ValueError, match="right-padded"):
        share_rows(IDS, torch.tensor([[1, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1] * 6]), [(2, 2), (1, 0)])
    with pytest.raises(ValueError, match="cover"):
        share_rows(IDS, MASK, [(2, 2)])
    with pytest.raises(ValueError, match="not more than"):
        share_rows(IDS[:2], MASK[:2], [(2, 4)])


# -- grouping and planning ------------------------------------------------------------------------


def response_mask(prompts: list[int], lengths: list[int], width: int) -> torch.Tensor:
    out = torch.zeros(len(prompts), width)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        out[i, p:n] = 1.0
    return out


def test_find_units_groups_rows_with_the_same_prompt() -> None:
    resp = response_mask([3, 3, 2], [5, 4, 6], 6)
    assert find_units(IDS, MASK, resp, budget=100) == [Unit((0, 1), 2, 5 + 4 - 2), Unit((2,), 0, 6)]
    # nothing shared: no response mask, different prompt lengths, a mask with holes, one row
    assert find_units(IDS, MASK, None, budget=100) is None
    assert find_units(IDS, MASK, response_mask([3, 4, 2], [5, 4, 6], 6), budget=100) is None
    holes = MASK.clone()
    holes[2, 1] = 0
    assert find_units(IDS, holes, resp, budget=100) is None
    assert find_units(IDS[:1], MASK[:1], resp[:1], budget=100) is None
    # a response from column 0 or 1 shares nothing (p >= 2)
    ids = torch.tensor([[5, 6, 7], [5, 8, 9]])
    assert find_units(ids, torch.ones_like(ids), response_mask([1, 1], [3, 3], 3), budget=100) is None


def test_find_units_cuts_groups_to_the_budget_and_the_best_size() -> None:
    ids = torch.tensor([[1, 2, 3, 4, 10 + i, 20 + i, 0] for i in range(5)])
    mask = torch.tensor([[1] * 6 + [0]] * 5)
    resp = response_mask([4] * 5, [6] * 5, 7)
    # shared 3, segments of 3: streams 3 + 3k
    assert [u.rows for u in find_units(ids, mask, resp, budget=9)] == [(0, 1), (2, 3), (4,)]
    assert [u.length for u in find_units(ids, mask, resp, budget=9)] == [9, 9, 6]
    assert [u.rows for u in find_units(ids, mask, resp, budget=100)] == [(0, 1, 2, 3, 4)]
    # a short prompt before long responses is not worth a long stream: one row per unit
    assert best_unit_rows(shared=44, segment=33, span=4275) == 13
    assert best_unit_rows(shared=100, segment=1000, span=4275) == 1
    assert best_unit_rows(shared=3, segment=0, span=100) == 1
    assert find_units(ids, mask, resp, budget=100, span=0.1) is None


def test_plan_units_keeps_groups_together_within_the_budget() -> None:
    rng = random.Random(0)
    for trial in range(40):
        rows, prompts, lengths = 0, [], []
        ids_rows = []
        for _ in range(rng.randint(1, 8)):
            p, n = rng.randint(2, 9), rng.randint(1, 5)
            prompt = [rng.randint(4, 50) for _ in range(p)]
            for _ in range(n):
                length = p + rng.randint(1, 8)
                ids_rows.append(prompt + [rng.randint(4, 50) for _ in range(length - p)])
                prompts.append(p)
                lengths.append(length)
            rows += n
        order = list(range(rows))
        rng.shuffle(order)  # a group's rows need not be adjacent
        width = max(lengths)
        ids = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, width, dtype=torch.long)
        for slot, i in enumerate(order):
            ids[slot, : lengths[i]] = torch.tensor(ids_rows[i])
            mask[slot, : lengths[i]] = 1
        resp = response_mask([prompts[i] for i in order], [lengths[i] for i in order], width)
        budget = rng.choice([20, 40, 80, 400])
        units = find_units(ids, mask, resp, budget)
        if units is None:
            continue
        real = [lengths[i] for i in order]
        min_num = rng.randint(1, 4)
        plan = plan_units(units, real, budget, min_num, algorithm=rng.choice(["ffd", "kk", "greedy"]))
        assert sorted(r for mb in plan for r in mb.rows) == list(range(rows)), trial
        assert len(plan) >= min(min_num, rows)
        for mb in plan:
            assert mb.units is not None and sum(c for c, _ in mb.units) == len(mb.rows)
            streams, at = [], 0
            for count, shared in mb.units:
                members = mb.rows[at : at + count]
                at += count
                # a unit's rows share their first shared + 1 tokens; its stream is within the budget
                assert all(torch.equal(ids[r, : shared + 1], ids[members[0], : shared + 1]) for r in members)
                streams.append(shared + sum(real[r] - shared for r in members))
            assert len(streams) == 1 or len(streams) * max(streams) <= budget, (trial, mb)
        # with room for every group (and no minimum count to split them for) a group is never cut
        if budget == 400 and min_num == 1:
            where: dict[tuple[int, bytes], set[int]] = {}
            for slot, i in enumerate(order):
                key = (prompts[i], ids[slot, : prompts[i]].numpy().tobytes())
                where.setdefault(key, set()).add(next(k for k, mb in enumerate(plan) if slot in mb.rows))
            assert all(len(mbs) == 1 for mbs in where.values()), trial


def test_plan_units_halves_units_to_reach_the_minimum() -> None:
    units = [Unit((0, 1, 2, 3), 3, 3 + 4 * 2), Unit((4,), 0, 4)]
    lengths = [5, 5, 5, 5, 4]
    plan = plan_units(units, lengths, budget=100, min_num=3)
    assert len(plan) == 3
    assert sorted(mb.units for mb in plan) == sorted([((2, 3),), ((2, 3),), ((1, 0),)])


def test_plan_cost_counts_tokens_and_attention_pairs() -> None:
    lengths = [5, 4, 6]
    padded = [Planned([0, 1, 2])]
    shared = [Planned([0, 1, 2], ((2, 2), (1, 0)))]
    assert plan_cost(padded, lengths, span=math.inf) == 3 * 6
    assert plan_cost(shared, lengths, span=math.inf) == 2 * 7
    assert plan_cost(shared, lengths, span=7.0) == 2 * 7 * 2
    assert plan_cost([Planned([])], lengths, span=1.0) == 0


# -- the model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from core_rl.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("shared") / "model", seed=5)


def load(path: Path, attn: str = "sdpa", value: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if value:
        model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, attn_implementation=attn)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    return model.float()


def grouped_batch(seed: int = 0) -> TensorBatch:
    """Groups of 4 rows sharing prompts of 5, 9 and 3 tokens (responses of 1-7 tokens), a group of
    one and a row whose prompt matches no other's, right-padded, shuffled."""
    return make_grouped_rl_batch(seed=seed)


def stream_of(batch: TensorBatch) -> tuple[torch.Tensor, torch.Tensor, list[int], tuple[tuple[int, int], ...]]:
    """The whole batch as one shared micro-batch: its rows in unit order and the units."""
    units = find_units(batch["input_ids"], batch["attention_mask"], batch["response_mask"], budget=10_000)
    assert units is not None and sorted(len(u.rows) for u in units) == [1, 1, 4, 4, 4]
    rows = [r for u in units for r in u.rows]
    return (
        batch["input_ids"][rows],
        batch["attention_mask"][rows],
        rows,
        tuple((len(u.rows), u.shared) for u in units),
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("fused", [False, True])
def test_shared_forward_equals_padded_with_the_same_gradient(tiny_path: Path, attn: str, fused: bool) -> None:
    model = load(tiny_path, attn)
    batch = grouped_batch()
    ids, mask, rows, units = stream_of(batch)
    weight = batch["loss_weight"][rows]
    stream = share_rows(ids, mask, units, additive=attn == "eager")
    assert stream.input_ids.shape[0] == 5
    results = {}
    for layout in ("padded", "shared"):
        model.zero_grad()
        lp, ent = forward_logprobs(
            model,
            ids,
            mask,
            temperature=0.7,
            with_entropy=True,
            fused=fused,
            stream=stream if layout == "shared" else None,
        )
        assert ent is not None and lp.shape == ids.shape
        ((-lp - 0.1 * ent) * weight).sum().backward()
        results[layout] = (lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results["padded"], results["shared"]
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=0)
    assert (lp_b[:, 0] == 0).all() and (lp_b[mask == 0] == 0).all()
    assert (lp_b[:, 1:][mask[:, 1:] != 0] != 0).all()  # every prompt token too, in every row of a group
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], atol=1e-5, rtol=1e-4, msg=name)


def test_shared_values_equal_padded(tiny_path: Path) -> None:
    model = load(tiny_path, value=True)
    batch = grouped_batch(seed=1)
    ids, mask, _, units = stream_of(batch)
    with torch.no_grad():
        want = forward_values(model, ids, mask)
        got = forward_values(model, ids, mask, stream=share_rows(ids, mask, units))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got[:, 1:][mask[:, 1:] != 0] != 0).all()


def test_a_mask_the_model_ignored_would_be_caught(tiny_path: Path) -> None:
    """The parity above can fail: the same stream with a plain causal mask (a segment seeing the
    segments before it) gives other log-probs."""
    model = load(tiny_path)
    batch = grouped_batch()
    ids, mask, _, units = stream_of(batch)
    stream = share_rows(ids, mask, units)
    causal = torch.ones_like(stream.attention).tril()
    leaky = type(stream)(stream.input_ids, stream.position_ids, stream.continues, causal, stream.index, stream.valid)
    with torch.no_grad():
        want, _ = forward_logprobs(model, ids, mask, temperature=1.0, with_entropy=False)
        got, _ = forward_logprobs(model, ids, mask, temperature=1.0, with_entropy=False, stream=leaky)
    assert (got - want).abs().max() > 1e-2


class Ignores(torch.nn.Module):
    """A model that drops a 4D attention mask (attending causally over the whole stream) or the
    ``position_ids``, as an architecture the configuration checks miss might."""

    def __init__(self, inner: torch.nn.Module, what: str) -> None:
        super().__init__()
        self.inner, self.what, self.config = inner, what, inner.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        if self.what == "mask" and attention_mask is not None and attention_mask.ndim == 4:
            attention_mask = None
        if self.what == "positions":
            position_ids = None
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


@pytest.mark.parametrize("what", ["mask", "positions"])
def test_the_probe_catches_a_model_that_ignores_the_layout(tiny_path: Path, what: str) -> None:
    model = load(tiny_path)
    assert probe(model, torch.device("cpu")) is None
    assert probe(load(tiny_path, "eager"), torch.device("cpu"), additive=True) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert probe(model, torch.device("cpu")) is None
    broken = Ignores(model, what)
    follow = {"mask": "4D attention mask", "positions": "position_ids"}[what]
    assert f"it does not follow the {follow}" in str(probe(broken, torch.device("cpu")))
    if what == "mask":  # a tiny random model's positions move its 16-bit outputs by less than 16-bit noise
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert f"it does not follow the {follow}" in str(probe(broken, torch.device("cpu")))
    assert broken.training  # left as it was


# -- the runner ----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def process_group(request: pytest.FixtureRequest) -> None:
    """The runner's plan is collective: a group of one process for the tests that run one."""
    from core_rl.launch.distributed import ensure_process_group

    if "runner" in request.node.name or "smollm2" in request.node.name:
        ensure_process_group("gloo", torch.device("cpu"))


def make_runner(
    model: torch.nn.Module, layout: str, budget: int = 10_000, attn: str | None = "sdpa", **kwargs
) -> MicroBatchRunner:
    config = MicroBatchConfig(max_tokens_per_mb=budget, layout=layout)
    return MicroBatchRunner(model, config, torch.device("cpu"), pad_token_id=0, attn_implementation=attn, **kwargs)


def test_layout_resolution_and_refusals(tiny_path: Path) -> None:
    assert resolve_layout("auto", "sdpa") == "shared"
    assert resolve_layout("auto", "eager") == "shared"
    assert resolve_layout("auto", "sdpa", "it uses a sliding window (8)") == "padded"
    assert resolve_layout("auto", "flash_attention_2") == "packed"
    assert resolve_layout("auto", None) == "padded"
    assert resolve_layout("shared", "sdpa") == "shared"
    with pytest.raises(ConfigError, match="shared cannot run on this model: its attention 'flash_attention_2'"):
        resolve_layout("shared", "flash_attention_2")
    model = load(tiny_path)
    assert shared_unsupported(model, None) is None
    assert make_runner(model, "auto", attn=None).layout == "shared"  # the model's own sdpa
    assert "flex_attention" in str(shared_unsupported(model, "flex_attention"))
    model.config.sliding_window = 8
    assert "sliding window" in str(shared_unsupported(model, "sdpa"))
    with pytest.raises(ConfigError, match="sliding window"):
        make_runner(model, "shared")
    assert make_runner(model, "auto").layout == "padded"
    model.config.sliding_window = None
    model.config.layer_types = ["full_attention", "linear_attention"]
    assert "not all full attention" in str(shared_unsupported(model, "sdpa"))
    del model.config.layer_types
    # the tiny model: hidden 64, intermediate 256, 2 layers
    assert attention_span(model) == (4 * 64 + 3 * 256 + model.config.vocab_size / 2) / 2


@pytest.mark.parametrize("what", ["mask", "positions"])
def test_runner_runs_padded_where_the_probe_fails(tiny_path: Path, what: str) -> None:
    broken = Ignores(load(tiny_path), what)
    batch = grouped_batch()
    runner = make_runner(broken, "auto")
    assert runner.layout == "shared"  # the configuration looks fine
    assert all(mb.units is None for mb in runner.plan(batch)[1])
    assert runner.layout == runner.base_layout == "padded"
    with pytest.raises(ConfigError, match="shared cannot run on this model: .* it does not follow"):
        make_runner(broken, "shared").plan(batch)


def test_runner_plans_shared_where_it_pays(tiny_path: Path) -> None:
    model = load(tiny_path)
    batch = grouped_batch()
    lengths, plan = make_runner(model, "auto").plan(batch)
    assert len(plan) == 1 and plan[0].units is not None
    # shared asked for, but nothing to share: padded
    plain = make_rl_batch(batch_size=6)
    _, plan = make_runner(model, "shared").plan(plain)
    assert all(mb.units is None for mb in plan)
    _, plan = make_runner(model, "shared").plan(batch, share=False)
    assert all(mb.units is None for mb in plan)
    _, plan = make_runner(model, "padded").plan(batch)
    assert all(mb.units is None for mb in plan)
    # auto leaves a plan that would save too little padded; shared runs it shared all the same
    few = TensorBatch({k: batch[k][[0, 1, 2]] for k in batch.keys()})
    few["response_mask"][:, 1:] = 1.0  # prompts of one token: every row alone
    assert make_runner(model, "auto").plan(few)[1][0].units is None
    # a budget of a few rows: every micro-batch within it, a group's rows in one
    budget = 40
    lengths, plan = make_runner(model, "shared", budget=budget).plan(batch)
    assert len(plan) > 1 and all(mb.units is not None for mb in plan)
    for mb in plan:
        streams, at = [], 0
        for count, shared in mb.units or ():
            streams.append(shared + sum(lengths[r] - shared for r in mb.rows[at : at + count]))
            at += count
        assert len(streams) == 1 or len(streams) * max(streams) <= budget
    assert micro_batch_width(lengths, plan[0].rows) <= batch["input_ids"].shape[1]


def runner_step(
    path: Path, layout: str, batch: TensorBatch, budget: int, attn: str = "sdpa"
) -> tuple[dict[str, float], dict, list]:
    """One AdamW step of the runner's gradients: its metrics, ``{name: (before, gradient, after)}``
    and ``[log-probs after it, micro-batch sizes]``."""
    model = load(path, attn)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    runner = make_runner(model, layout, budget, attn=attn)
    # eps well above the gradients' rounding noise (~3e-9 here): with torch's 1e-8 the step of an entry
    # whose gradient is noise, lr * g / (|g| + eps), moved with the noise by up to 2.6e-4 between the
    # layouts on an AVX-512 machine; every real gradient is still far above eps
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    calls: list[int] = []

    def loss_fn(mb: TensorBatch, lp: torch.Tensor, ent: torch.Tensor):
        from core_rl.interfaces import LossOutput

        calls.append(mb.batch_size)
        return LossOutput(per_token_loss=-lp * mb["response_mask"] - 0.1 * ent * mb["response_mask"])

    acc, count = runner.accumulate_gradients(batch, loss_fn, 0.8, lambda loss: loss.backward(), 1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    metrics = acc.reduce()
    metrics["num_micro_batches"] = count
    logprobs = runner.logprobs(batch, 0.8)
    weights = {n: (before[n], grads[n], p.detach().clone()) for n, p in model.named_parameters()}
    return metrics, weights, [logprobs, calls]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_runner_train_step_shared_equals_padded(tiny_path: Path, attn: str) -> None:
    batch = grouped_batch(seed=2)
    padded = runner_step(tiny_path, "padded", batch, budget=60, attn=attn)
    shared = runner_step(tiny_path, "shared", batch, budget=60, attn=attn)
    assert shared[0]["num_micro_batches"] >= 2
    for key in ("loss", "entropy", "tokens"):
        assert shared[0][key] == pytest.approx(padded[0][key], rel=1e-5), key
    assert sum(shared[2][1]) == sum(padded[2][1]) == batch.batch_size
    for name, (before, grad, after) in shared[1].items():
        _, want_grad, want_after = padded[1][name]
        torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-4, msg=name)
        # AdamW's first step is about lr x sign(gradient): compared as whole updates (an entry whose
        # gradient is rounding noise may move either way in either layout)
        update, want = after - before, want_after - before
        assert (update - want).norm() <= 1e-3 * want.norm() + 1e-7, name
        assert (update - want).abs().max() <= 2e-4, name
    torch.testing.assert_close(shared[2][0], padded[2][0], atol=1e-5, rtol=0)


def test_runner_values_shared_equal_padded(tiny_path: Path) -> None:
    model = load(tiny_path, value=True).eval()
    batch = grouped_batch(seed=3)
    want = make_runner(model, "padded", head="value").logprobs(batch, 1.0)
    runner = make_runner(model, "shared", head="value", budget=50)
    assert any(mb.units for mb in runner.plan(batch)[1])
    torch.testing.assert_close(runner.logprobs(batch, 1.0), want, atol=1e-5, rtol=0)


# -- the real model ------------------------------------------------------------------------------


def test_smollm2_shared_logprobs_equal_padded_on_chat_prompts(real_model: Path) -> None:
    """SmolLM2-135M-Instruct, two chat-templated prompts x 3 sampled-like responses (random tokens of
    different lengths): the shared forward's log-probs are the padded one's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    rows: list[tuple[list[int], int]] = []
    for question in ("What is 17 * 23?", "Name three prime numbers greater than 50 and explain why."):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        for r in (12, 5, 9):
            rows.append((prompt + torch.randint(100, 40_000, (r,), generator=g).tolist(), len(prompt)))
    batch = right_padded(rows, tokenizer.pad_token_id)
    want = make_runner(model, "padded").logprobs(batch, 1.0)
    runner = make_runner(model, "auto")
    assert runner.layout == "shared" and all(mb.units for mb in runner.plan(batch)[1])
    got = runner.logprobs(batch, 1.0)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=0)
    # the probe passes the model and fails it where it would ignore the mask or the positions, in
    # float32 and under bfloat16 autocast
    cpu = torch.device("cpu")
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            assert probe(model, cpu) is None
            assert "4D attention mask" in str(probe(Ignores(model, "mask"), cpu))
            assert "position_ids" in str(probe(Ignores(model, "positions"), cpu))
