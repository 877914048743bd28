"""Mixture-of-experts routers of Hugging Face models: find them, record their routes, replay routes.

One place for what the ``hf`` rollout engine and the train engines share about MoE routing
(routing replay, "R3": the training forward uses the experts the rollout chose).

A *router* is a module whose class name ends in ``TopKRouter`` (transformers 5.x: Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE, ...) with ``top_k`` and ``num_experts`` attributes. Its forward takes the
flattened hidden states ``[N, hidden]`` and returns ``(router_logits [N, E], routing_weights [N, K],
selected_experts [N, K])`` where ``probs = softmax(router_logits)`` (in float32),
``selected_experts = topk(probs, K)``, ``routing_weights = probs[selected_experts]``, divided by
their sum by some families (Qwen3-MoE with ``norm_topk_prob``, Mixtral, Qwen3.5-MoE and Qwen3-VL-MoE
always) and not by others: which a router does is read from its own output
(:func:`divides_weights`), and a router whose weights are neither (a sigmoid or grouped router) is
refused by name. Routers are numbered by their order in the
model (layer order): that number is the *layer* of a route.

*Routes* of ``N`` tokens: an integer tensor ``[N, L, K]`` (``L`` routers, ``K`` = top-k), the
experts each token went to in each layer, :data:`NO_ROUTE` (-1) in all ``K`` slots where a token
has none (it is then routed by the router itself). Compact storage is :data:`ROUTE_DTYPE` (int16:
up to 32,767 experts).

- :class:`RouteRecorder`: forward hooks that keep each router's ``selected_experts`` of every
  forward, read back with :meth:`RouteRecorder.take` as ``[N, L, K]``;
- :class:`RouteReplay`: forward hooks that make each router return given experts instead of its
  top-k, with weights gathered from its own softmax at those experts (:func:`weights_at`), so the
  gradient still reaches the router's weights;
- :func:`router_float32`: the router's logits computed in float32 whatever the autocast or the
  weights' dtype (``moe_router_dtype: float32``);
- :func:`routing_agreement` and :func:`expert_load`: the metrics.
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

#: the route of a token that has none (routed by the router itself)
NO_ROUTE = -1
#: the dtype routes are stored and carried in
ROUTE_DTYPE = torch.int16


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model); see the module docstring."""
    return [
        module
        for module in model.modules()
        if type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k") and hasattr(module, "num_experts")
    ]


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` has top-k routers (:func:`find_routers`)."""
    return bool(find_routers(model))


def route_shape(model: nn.Module) -> tuple[int, int]:
    """``(layers, top_k)`` of ``model``'s routes; ``ValueError`` for a dense model or routers that
    disagree on top-k."""
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts routers")
    top_ks = {int(r.top_k) for r in routers}
    if len(top_ks) != 1:
        raise ValueError(f"the routers of {type(model).__name__} disagree on top-k: {sorted(top_ks)}")
    return len(routers), top_ks.pop()


def weights_at(router_logits: torch.Tensor, experts: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Routing weights ``[N, K]`` of the chosen ``experts`` ``[N, K]``: ``softmax(router_logits)``
    (float32) gathered at ``experts``, divided by their sum over ``K`` when ``normalize``
    (:func:`divides_weights`), cast to the logits' dtype. Differentiable in ``router_logits``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(-1, experts.long())
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


def divides_weights(router: nn.Module, output: Any) -> bool:
    """Whether ``router`` divides its softmax weights at the chosen experts by their sum (``True``)
    or returns them as they are (``False``), read from one of its outputs ``(logits, weights,
    experts)`` and remembered on the router. transformers' routers say it in different ways (an
    attribute ``norm_topk_prob`` in some families, always in others), so the output is what is
    trusted. A router whose weights are neither is a :class:`ValueError` naming its class: routing
    replay and float32 routers support softmax-then-top-k routers."""
    known = getattr(router, "_core_rl_divides_weights", None)
    if known is not None:
        return bool(known)
    logits, weights, experts = output
    if weights.numel() == 0:
        return True  # nothing to weigh yet: decided by the first forward with tokens
    raw = torch.softmax(logits.detach().float(), dim=-1).gather(-1, experts.long())
    given = weights.detach().float()
    exact = weights.dtype == torch.float32 and logits.dtype == torch.float32
    tolerance = {"rtol": 1e-4, "atol": 1e-6} if exact else {"rtol": 2e-2, "atol": 1e-3}
    for divides, expected in ((True, raw / raw.sum(dim=-1, keepdim=True)), (False, raw)):
        if torch.allclose(given, expected, **tolerance):
            router._core_rl_divides_weights = divides
            return divides
    raise ValueError(
        f"the router {type(router).__name__} does not weight its experts by its softmax at them (divided by "
        "their sum or not): routing replay and actor.moe.router_dtype support softmax-then-top-k routers only; "
        "set actor.moe.routing_replay: none and router_dtype: auto for this model"
    )


class _Hooks(ABC):
    """Forward hooks on every router of a model, removed on exit; :meth:`_hook` is what each does
    with a router's output (its return value, unless ``None``, replaces the output)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts routers to record or replay")
        self._handles: list[Any] = []

    @abstractmethod
    def _hook(self, layer: int, router: nn.Module, output: Any) -> Any: ...

    def __enter__(self) -> _Hooks:
        for layer, router in enumerate(self.routers):
            hook = functools.partial(self._layer_hook, layer)
            self._handles.append(router.register_forward_hook(hook))
        return self

    def _layer_hook(self, layer: int, router: nn.Module, _args: Any, output: Any) -> Any:
        return self._hook(layer, router, output)

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class RouteRecorder(_Hooks):
    """Within ``with RouteRecorder(model) as recorder:`` each router's ``selected_experts`` of every
    forward is kept; :meth:`take` returns those of the forward(s) since the last call. Works with
    :class:`RouteReplay` on the same model (a replayed route is what the router returned)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._kept: list[list[torch.Tensor]] = [[] for _ in self.routers]

    def _hook(self, layer: int, router: nn.Module, output: Any) -> Any:
        self._kept[layer].append(output[2].detach().to(ROUTE_DTYPE))
        return None

    def take(self) -> torch.Tensor:
        """Routes ``[N, L, K]`` (:data:`ROUTE_DTYPE`, on the model's device) of the tokens every
        router saw since the last call (several forwards: their tokens in order), then forget them."""
        if any(len(kept) != len(self._kept[0]) for kept in self._kept):
            raise RuntimeError("the routers ran different numbers of forwards; cannot line their routes up")
        if not self._kept[0]:
            raise RuntimeError("no forward ran since the last take()")
        routes = torch.stack([torch.cat(kept) for kept in self._kept], dim=1)
        self._kept = [[] for _ in self.routers]
        return routes


class RouteReplay(_Hooks):
    """Within ``with RouteReplay(model) as replay:``, after ``replay.routes = routes`` (``[N, L, K]``
    for the ``N`` tokens of the next forward, in the model's flattened ``[batch * sequence]`` order),
    each router returns those experts with :func:`weights_at` its own logits; a token whose route is
    :data:`NO_ROUTE` keeps the router's own choice. ``routes = None``: routers choose freely.

    With ``observe``, each forward also leaves, per layer, the router's own choice (its top-k,
    whatever was replayed) in :attr:`own` and the experts it returned in :attr:`used` (both
    ``[N, K]``, detached), and its logits (with their gradient) in :attr:`logits`, for the
    agreement and load metrics and the load-balancing loss; :meth:`clear` forgets them."""

    def __init__(self, model: nn.Module, *, observe: bool = False) -> None:
        super().__init__(model)
        self.routes: torch.Tensor | None = None
        self.observe = observe
        self.own: dict[int, torch.Tensor] = {}
        self.used: dict[int, torch.Tensor] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        self.own.clear()
        self.used.clear()
        self.logits.clear()

    def observed(self, which: str = "own") -> torch.Tensor:
        """The observed routes ``[N, L, K]`` of the last forward: the routers' own choices
        (``own``) or the experts they returned (``used``)."""
        kept = self.own if which == "own" else self.used
        if len(kept) != len(self.routers):
            raise RuntimeError(f"{len(kept)} of {len(self.routers)} routers ran since the last clear()")
        return torch.stack([kept[layer] for layer in range(len(self.routers))], dim=1)

    def _hook(self, layer: int, router: nn.Module, output: Any) -> Any:
        logits, _weights, chosen = output
        if self.observe:
            self.own[layer] = chosen.detach()
            self.logits[layer] = logits
            self.used[layer] = chosen.detach()
        if self.routes is None:
            return None
        if self.routes.shape[0] != logits.shape[0] or self.routes.shape[1] != len(self.routers):
            raise ValueError(
                f"routes to replay have shape {tuple(self.routes.shape)}, the router of layer {layer} saw "
                f"{logits.shape[0]} tokens of {len(self.routers)} layers"
            )
        given = self.routes[:, layer].to(device=chosen.device, dtype=chosen.dtype)
        if given.shape[-1] != chosen.shape[-1]:
            raise ValueError(f"routes to replay have top-k {given.shape[-1]}, the router chooses {chosen.shape[-1]}")
        has_route = (given >= 0).all(dim=-1, keepdim=True)
        experts = torch.where(has_route, given, chosen)
        if self.observe:
            self.used[layer] = experts.detach()
        return logits, weights_at(logits, experts, divides_weights(router, output)), experts


@contextlib.contextmanager
def replaying(replay: RouteReplay | None, routes: torch.Tensor | None) -> Iterator[None]:
    """Set ``replay.routes`` to ``routes`` (flattened to ``[N, L, K]``) for the block, ``None``
    after it; nothing without ``replay``."""
    if replay is None:
        yield
        return
    replay.routes = None if routes is None else routes.reshape(-1, *routes.shape[-2:])
    try:
        yield
    finally:
        replay.routes = None


def router_float32(model: nn.Module) -> int:
    """Make every router of ``model`` compute its logits in float32 (``F.linear`` of the hidden
    states and its weight both cast to float32, outside autocast), then route as before; the
    returned weights keep float32. Returns the number of routers changed (0 for a dense model)."""
    routers = find_routers(model)
    for router in routers:
        if getattr(router, "_core_rl_float32", False):
            continue
        original = router.forward

        def forward(hidden_states: torch.Tensor, _router: nn.Module = router, _original: Any = original) -> Any:
            divides = getattr(_router, "_core_rl_divides_weights", None)
            if divides is None:  # the router's own rule, read from its own forward once
                with torch.no_grad():
                    divides = divides_weights(_router, _original(hidden_states))
            with torch.autocast(hidden_states.device.type, enabled=False):
                hidden = hidden_states.reshape(-1, _router.weight.shape[-1]).float()
                logits = nn.functional.linear(hidden, _router.weight.float())
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
                _top, experts = torch.topk(probs, int(_router.top_k), dim=-1)
                weights = weights_at(logits, experts, divides)
            return logits, weights, experts

        router.forward = forward
        router._core_rl_float32 = True
    return len(routers)


def same_sets(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """bool ``[..., L]``: whether two routes ``[..., L, K]`` chose the same set of experts (order of
    the ``K`` slots ignored)."""
    return (first.sort(dim=-1).values == second.sort(dim=-1).values).all(dim=-1)


def routing_agreement(first: torch.Tensor, second: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per layer, the fraction of tokens whose top-k *set* of experts is the same in both routes
    ``[..., L, K]``: ``mean over tokens of [set(first[t, l]) == set(second[t, l])]``, over the tokens
    where ``mask`` ``[...]`` is true and both routes have a route (not :data:`NO_ROUTE`). Returns
    float32 ``[L]`` (NaN where no token counts)."""
    valid = (first >= 0).all(dim=-1).all(dim=-1) & (second >= 0).all(dim=-1).all(dim=-1)
    if mask is not None:
        valid = valid & mask.bool()
    agree = same_sets(first, second)[valid].float()  # [n, L]
    if agree.shape[0] == 0:
        return torch.full((first.shape[-2],), float("nan"))
    return agree.mean(dim=0)


def expert_load(routes: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens routed to each expert, per layer: float32 ``[L, E]``, counting each of a token's
    ``K`` experts once, over the tokens where ``mask`` ``[...]`` is true and a route exists."""
    flat = routes.reshape(-1, *routes.shape[-2:]).long()  # [N, L, K]
    valid = (flat >= 0).all(dim=-1).all(dim=-1)
    if mask is not None:
        valid = valid & mask.reshape(-1).bool()
    flat = flat[valid]
    layers = flat.shape[1]
    load = torch.zeros(layers, num_experts, dtype=torch.float32)
    for layer in range(layers):
        load[layer] = torch.bincount(flat[:, layer].reshape(-1), minlength=num_experts)[:num_experts].float()
    return load


def load_balancing_loss(
    logits: list[torch.Tensor], experts: list[torch.Tensor], mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The Switch Transformer load-balancing loss, averaged over layers: per layer
    ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the tokens' ``K`` expert slots that went to
    expert ``e`` and ``P_e`` the mean router probability of ``e`` (``softmax`` of ``logits``
    ``[N, E]``), over the tokens where ``mask`` ``[N]`` is true (all without). 1 when perfectly
    balanced; differentiable through ``P``. (Hugging Face's ``load_balancing_loss_func`` pools the
    layers' tokens before the product instead of averaging per layer.)"""
    losses = []
    for layer_logits, layer_experts in zip(logits, experts, strict=True):
        num_experts = layer_logits.shape[-1]
        probs = torch.softmax(layer_logits, dim=-1, dtype=torch.float32)
        slots = nn.functional.one_hot(layer_experts.long(), num_experts).float()  # [N, K, E]
        if mask is not None:
            keep = mask.reshape(-1).bool()
            probs, slots = probs[keep], slots[keep]
        if probs.shape[0] == 0:
            losses.append(layer_logits.sum() * 0.0)
            continue
        fraction = slots.mean(dim=(0, 1))  # [E]
        losses.append(num_experts * (fraction * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def load_imbalance(load: torch.Tensor) -> torch.Tensor:
    """Per layer, ``max(tokens per expert) / mean(tokens per expert)`` of :func:`expert_load`'s
    ``[L, E]`` (1 = perfectly balanced, ``E`` = every token to one expert); NaN for a layer with no
    tokens."""
    mean = load.mean(dim=-1)
    return torch.where(mean > 0, load.max(dim=-1).values / mean.clamp(min=1e-12), torch.nan)
