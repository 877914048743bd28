"""Routes as data (``Sample.routed_experts``, the ``routed_experts`` batch key, stop-string cuts,
saved rollouts) and the routing metrics' formulas (:mod:`core_rl_train_kit.moe`) on hand-made values."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl.config.model_sections import MoEConfig
from core_rl.config.validators import FieldValueError
from core_rl.protocol import Sample, TensorBatch, concat_padded, samples_to_batch
from core_rl.rollout.stop_strings import cut_sample
from core_rl_train_kit import moe


def routes(rows: list[list[list[int]]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int16)


def sample(prompt: int, response: int, route: torch.Tensor | None) -> Sample:
    return Sample(
        prompt_ids=list(range(1, prompt + 1)),
        response_ids=list(range(10, 10 + response)),
        logprobs=[-0.5] * response,
        weight_version=0,
        finish_reason="stop",
        routed_experts=route,
    )


def test_a_sample_refuses_routes_of_another_length() -> None:
    with pytest.raises(ValueError, match=r"routed_experts of shape \(2, 1, 2\); expected \[3, layers, top_k\]"):
        sample(2, 1, routes([[[0, 1]], [[1, 2]]]))


def test_samples_to_batch_lays_routes_out_per_position_with_minus_one_elsewhere() -> None:
    first = routes([[[0, 1]], [[2, 3]], [[4, 5]], [[-1, -1]]])  # 2 prompt + 2 response tokens, 1 layer
    batch = samples_to_batch([sample(2, 2, first), sample(1, 1, None)], [0, 1], pad_token_id=0)
    got = batch["routed_experts"]
    assert got.shape == (2, 4, 1, 2) and got.dtype == torch.int16
    assert torch.equal(got[0], first)
    assert (got[1] == -1).all()  # a sample without routes is routed by the trainer
    assert "routed_experts" not in samples_to_batch([sample(1, 1, None)], [0], pad_token_id=0)


def test_samples_with_routes_of_different_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="disagree on"):
        samples_to_batch(
            [sample(1, 1, routes([[[0, 1]], [[-1, -1]]])), sample(1, 1, routes([[[0]], [[-1]]]))], [0, 1], 0
        )


def test_concat_padded_pads_routes_with_minus_one() -> None:
    short = samples_to_batch([sample(1, 1, routes([[[0, 1]], [[-1, -1]]]))], [0], 0)
    long = samples_to_batch([sample(2, 2, routes([[[1, 2]]] * 3 + [[[-1, -1]]]))], [0], 0)
    both = concat_padded([short, long], pad_token_id=0)
    assert both["routed_experts"].shape == (2, 4, 1, 2)
    assert (both["routed_experts"][0, 2:] == -1).all()


def test_a_stop_string_cut_keeps_the_routes_of_what_is_left() -> None:
    full = routes([[[0, 1]], [[1, 2]], [[2, 3]], [[3, 4]], [[-1, -1]]])  # 1 prompt + 4 response tokens
    cut = cut_sample(sample(1, 4, full), 2)
    assert cut.routed_experts is not None
    assert torch.equal(cut.routed_experts, routes([[[0, 1]], [[1, 2]], [[-1, -1]]]))  # the new last token: no route


def test_routing_agreement_compares_sets_per_layer() -> None:
    first = routes([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [-1, -1]]])  # 3 tokens, 2 layers
    second = routes([[[1, 0], [2, 4]], [[4, 5], [6, 7]], [[0, 2], [0, 1]]])
    got = moe.routing_agreement(first, second)
    # token 2 has no route in layer 1 of ``first``: it counts nowhere; layer 0: tokens 0, 1 agree (order ignored)
    assert torch.allclose(got, torch.tensor([1.0, 0.5]))
    assert torch.allclose(moe.routing_agreement(first, second, torch.tensor([False, True, True])), torch.ones(2))


def test_expert_load_and_imbalance() -> None:
    route = routes([[[0, 1]], [[0, 2]], [[0, 1]], [[-1, -1]]])  # 1 layer, 4 experts
    load = moe.expert_load(route, 4)
    assert torch.equal(load, torch.tensor([[3.0, 2.0, 1.0, 0.0]]))
    assert torch.allclose(moe.load_imbalance(load), torch.tensor([3.0 / 1.5]))


def test_load_balancing_loss_is_e_sum_f_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]]))
    experts = torch.tensor([[0], [1]])
    # f = (1/2, 1/2, 0), P = (0.375, 0.375, 0.25): 3 * (0.1875 + 0.1875) = 1.125
    got = moe.load_balancing_loss([logits], [experts])
    assert math.isclose(float(got), 1.125, rel_tol=1e-6)


def test_weights_at_are_the_softmax_at_the_given_experts() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).requires_grad_()
    weights = moe.weights_at(logits, torch.tensor([[0, 2]]), normalize=True)
    assert torch.allclose(weights, torch.tensor([[0.25, 0.75]]))
    weights.sum().backward()
    assert logits.grad is not None  # the router keeps training under replay


def test_moe_section_validates_its_keys() -> None:
    assert MoEConfig().routing_replay == "none" and not MoEConfig().replays
    assert MoEConfig(routing_replay="first_forward").replays
    with pytest.raises(FieldValueError):
        MoEConfig(routing_replay="always")
    with pytest.raises(FieldValueError):
        MoEConfig(router_aux_loss_coef=-1.0)


def test_saved_rollouts_keep_routes(tmp_path) -> None:
    from core_rl.loops.rl.batching import Generation
    from core_rl.rollout.dump import FORMAT, read_step, write_step

    route = routes([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[-1, -1], [-1, -1]]])
    samples = [sample(1, 2, route), sample(1, 1, None)]
    gen = Generation(samples=samples, group_index=[0, 0], rewards=[1.0, 0.0], metrics={})
    write_step(tmp_path / "step_00000001.parquet", {"format": FORMAT}, [gen])
    _header, (back,) = read_step(tmp_path / "step_00000001.parquet")
    assert torch.equal(back.samples[0].routed_experts, route)
    assert back.samples[1].routed_experts is None
    batch = samples_to_batch(back.samples, back.group_index, 0)
    assert isinstance(batch, TensorBatch) and batch["routed_experts"].shape == (2, 3, 2, 2)


def test_multi_turn_inserted_tokens_have_no_route_and_a_turn_brings_its_own() -> None:
    from core_rl.rollout.workflows import append_observation, extend_turn

    first = sample(1, 2, routes([[[0, 1]], [[1, 2]], [[-1, -1]]]))
    observed = append_observation(first, [30, 31])
    assert torch.equal(observed.routed_experts[3:], routes([[[-1, -1]], [[-1, -1]]]))  # routed by the trainer
    context = [*observed.prompt_ids, *observed.response_ids]
    turn_routes = routes([[[e, e + 1]] for e in range(len(context))] + [[[5, 6]], [[-1, -1]]])
    turn = Sample(
        prompt_ids=context,
        response_ids=[40, 41],
        logprobs=[-0.1, -0.2],
        weight_version=0,
        finish_reason="stop",
        routed_experts=turn_routes,
    )
    joined = extend_turn(observed, turn)
    assert torch.equal(joined.routed_experts, turn_routes)  # the turn's prefill routed the whole context


def _tiny(family: str, **extra: object) -> torch.nn.Module:
    """A random tiny causal MoE of a transformers family (4 experts, top-2, 2 layers)."""
    import transformers

    shape = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2}
    shape |= {"vocab_size": 40, "intermediate_size": 32, "num_experts_per_tok": 2, **extra}
    configs = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=16, **shape),
        "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, **shape),
        "phimoe": lambda: transformers.PhimoeConfig(num_local_experts=4, **shape),
    }
    config = configs[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for router in moe.find_routers(model):
            router.weight.normal_(0.0, 1.0)
    return model


@pytest.mark.parametrize(
    ("family", "extra", "divides"),
    [
        ("qwen3_moe", {"norm_topk_prob": True}, True),
        ("qwen3_moe", {"norm_topk_prob": False}, False),
        ("mixtral", {}, True),
    ],
    ids=["qwen3_moe-norm", "qwen3_moe-raw", "mixtral"],
)
def test_replaying_a_models_own_routes_leaves_its_forward_unchanged(family: str, extra: dict, divides: bool) -> None:
    """Each family's own weight rule (Mixtral divides by the top-k sum with no attribute saying so),
    read from the router's output: the replayed forward is the free one, exactly, in float32."""
    model = _tiny(family, **extra)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    with torch.no_grad(), moe.RouteRecorder(model) as recorder:
        free = model(input_ids=ids).logits
        routes = recorder.take()
    assert [getattr(r, "_core_rl_divides_weights", None) for r in moe.find_routers(model)] == [None, None]
    with torch.no_grad(), moe.RouteReplay(model) as replay, moe.replaying(replay, routes):
        replayed = model(input_ids=ids).logits
    assert torch.equal(replayed, free)
    assert [r._core_rl_divides_weights for r in moe.find_routers(model)] == [divides, divides]
    moe.router_float32(model)  # the float32 router keeps the family's rule
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, free, atol=1e-5)


def test_a_router_that_is_not_softmax_top_k_is_refused_by_name() -> None:
    model = _tiny("phimoe")  # sparsemixer: weights that are not the softmax at the chosen experts
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad(), moe.RouteRecorder(model) as recorder:
        model(input_ids=ids)
        routes = recorder.take()
    with pytest.raises(ValueError, match=r"the router PhimoeTopKRouter does not weight its experts by its softmax"):
        with torch.no_grad(), moe.RouteReplay(model) as replay, moe.replaying(replay, routes):
            model(input_ids=ids)
