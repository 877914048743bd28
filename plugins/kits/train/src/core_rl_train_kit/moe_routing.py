"""Mixture-of-experts routing in a train engine's forwards: replay, metrics, load-balancing loss.

:class:`MoERouting` keeps a :class:`core_rl_train_kit.moe.RouteReplay` on the model's routers for the
engine's life and, per forward of a micro-batch ``[b, width]`` (the padded layout: its tokens are the
routers' ``N = b * width`` rows), replays the routes ``actor.moe.routing_replay`` asks for:

- ``rollout``: the batch's ``routed_experts`` (the rollout's, :func:`core_rl.protocol.samples_to_batch`);
- ``first_forward``: :data:`FIRST_FORWARD_ROUTES`, which a trainable engine's log-prob forward writes
  into the batch it was given (the routers' own choices there); every later forward of those rows
  (the update's micro-steps, later PPO epochs, minibatches cut from that batch) replays them;
- ``none``: no replay.

A token whose route is -1 is routed by the training router. In every update forward it also
counts, over the micro-batch's real tokens:

- ``moe/routing_agreement/layer<l>`` and ``moe/routing_agreement`` (mean over layers): the fraction
  of tokens whose training router's own top-k set equals the rollout's (tokens with a rollout
  route; with replay on this is what the router would have chosen, not what was replayed). Only
  in the padded layout, which replay forces; without replay a ``packed`` layout (the routers see
  the real tokens concatenated) leaves it out, and load and loss count every token the routers saw;
- ``moe/imbalance`` (mean over layers) and ``moe/imbalance/layer<l>``: max/mean tokens per expert of
  the experts the forward used, ``moe/expert_load/layer<l>/expert<e>`` their fractions (with
  ``actor.moe.load_metrics``);
- ``moe/aux_loss``: the load-balancing loss (:func:`core_rl_train_kit.moe.load_balancing_loss`), added to
  the loss with weight ``router_aux_loss_coef`` (each micro-batch's share by its real tokens on its
  rank, the ranks averaged). Like Hugging Face's and Megatron's, it is a per-micro-batch quantity: it
  changes with how the rows are split over ranks and micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from core_rl.config.model_sections import MoEConfig
from core_rl.errors import ConfigError
from core_rl.launch import distributed as dist_utils
from core_rl.protocol import TensorBatch
from torch import nn

from core_rl_train_kit.moe import (
    NO_ROUTE,
    ROUTE_DTYPE,
    RouteReplay,
    expert_load,
    find_routers,
    load_balancing_loss,
    load_imbalance,
    replaying,
    route_shape,
    router_float32,
    same_sets,
)

#: the batch key of the routes a log-prob forward recorded for ``routing_replay: first_forward``
FIRST_FORWARD_ROUTES = "first_forward_routes"
#: the batch key of the rollout's routes
ROLLOUT_ROUTES = "routed_experts"


class MoERouting:
    """See the module docstring. ``aux_coef``: the load-balancing loss's weight (resolved: the
    section's, else the model config's); ``records``: this engine writes :data:`FIRST_FORWARD_ROUTES`
    (the trainable actor; a frozen reference only replays them)."""

    def __init__(self, model: nn.Module, config: MoEConfig, *, aux_coef: float, records: bool) -> None:
        self.config = config
        self.mode = config.routing_replay
        self.aux_coef = aux_coef
        self.records = records and self.mode == "first_forward"
        self.layers, self.top_k = route_shape(model)
        self.num_experts = int(find_routers(model)[0].num_experts)
        if config.router_dtype == "float32":
            router_float32(model)
        self.replay = RouteReplay(model, observe=True)
        self.replay.__enter__()
        self._reset()

    @classmethod
    def build(
        cls, model: nn.Module, config: MoEConfig, *, role: str = "actor", records: bool = True
    ) -> MoERouting | None:
        """The routing of ``model``; ``None`` for a dense model (a :class:`ConfigError` when
        ``routing_replay`` or ``router_dtype`` asks for routers it does not have)."""
        if not find_routers(model):
            if config.replays or config.router_dtype != "auto":
                key = f"{role}.moe.routing_replay" if config.replays else f"{role}.moe.router_dtype"
                raise ConfigError(
                    f"{key}: {type(model).__name__} has no mixture-of-experts routers; "
                    "set routing_replay: none and router_dtype: auto for a dense model"
                )
            return None
        coef = config.router_aux_loss_coef
        if coef is None:
            coef = float(getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0) or 0.0)
        return cls(model, config, aux_coef=coef, records=records)

    def close(self) -> None:
        self.replay.__exit__(None, None, None)

    # ------------------------------------------------------------------ replay

    def routes_for(self, batch: TensorBatch) -> torch.Tensor | None:
        """The routes ``[b, width, L, K]`` to replay for ``batch``'s rows (``None``: route freely)."""
        if self.mode == "rollout":
            return batch.get(ROLLOUT_ROUTES)
        if self.mode == "first_forward":
            return batch.get(FIRST_FORWARD_ROUTES)
        return None

    @contextlib.contextmanager
    def forward(self, routes: torch.Tensor | None) -> Iterator[None]:
        """One forward of a micro-batch, replaying ``routes`` (``[b, width, L, K]``, or ``None``)."""
        self.replay.clear()
        with replaying(self.replay, routes):
            yield

    def own_routes(self, shape: torch.Size) -> torch.Tensor:
        """The routers' own choices of the last forward, ``[b, width, L, K]`` (:data:`ROUTE_DTYPE`, CPU)."""
        return self.replay.observed("own").to(ROUTE_DTYPE).reshape(*shape[:2], self.layers, self.top_k).cpu()

    def record_first_forward(self, batch: TensorBatch, recorded: torch.Tensor) -> None:
        """Write ``recorded`` (``[B, T, L, K]``: the log-prob forward's own routes) into ``batch`` as
        :data:`FIRST_FORWARD_ROUTES` (``first_forward`` on a trainable engine only)."""
        if self.records:
            batch[FIRST_FORWARD_ROUTES] = recorded

    # ------------------------------------------------------------------ metrics and loss

    def _reset(self) -> None:
        self._agree = torch.zeros(self.layers, dtype=torch.float64)
        self._compared = torch.zeros((), dtype=torch.float64)
        self._load = torch.zeros(self.layers, self.num_experts, dtype=torch.float64)
        self._aux = torch.zeros((), dtype=torch.float64)
        self._micro_batches = torch.zeros((), dtype=torch.float64)

    def observe(self, batch: TensorBatch, token_share: float) -> torch.Tensor | None:
        """After an update forward of micro-batch ``batch``: count the metrics of its real tokens
        and return its load-balancing loss times ``aux_coef * token_share`` (``None`` when the
        coefficient is 0). ``token_share``: its real tokens over the rank's."""
        own = self.replay.observed("own").cpu()
        used = self.replay.observed("used").cpu()
        real = batch["attention_mask"].reshape(-1).bool()
        padded = own.shape[0] == real.numel()  # else packed: the routers saw the real tokens alone, in another order
        real = real.cpu() if padded else torch.ones(own.shape[0], dtype=torch.bool)
        rollout = batch.get(ROLLOUT_ROUTES) if padded else None
        if rollout is not None:
            rollout = rollout.reshape(-1, self.layers, self.top_k).cpu()
            has = real & (rollout >= 0).all(dim=-1).all(dim=-1)
            self._agree += same_sets(own[has], rollout[has].to(own.dtype)).double().sum(dim=0)
            self._compared += has.sum()
        self._load += expert_load(used, self.num_experts, real).double()
        self._micro_batches += 1
        if self.aux_coef == 0:
            return None
        logits = [self.replay.logits[layer] for layer in range(self.layers)]
        experts = [self.replay.used[layer] for layer in range(self.layers)]
        aux = load_balancing_loss(logits, experts, real.to(logits[0].device))
        self._aux += float(aux.detach()) * token_share
        return aux * (self.aux_coef * token_share)

    def metrics(self, world_size: int) -> dict[str, float]:
        """The step's metrics (reduced over ranks: a collective), then start counting afresh."""
        packed = torch.cat([self._agree, self._compared.reshape(1), self._load.reshape(-1), self._aux.reshape(1)])
        packed = dist_utils.all_reduce(packed.float()).double()
        layers, experts = self.layers, self.num_experts
        agree, compared = packed[:layers], float(packed[layers])
        load = packed[layers + 1 : layers + 1 + layers * experts].reshape(layers, experts).float()
        aux = float(packed[-1]) / max(world_size, 1)
        out: dict[str, float] = {}
        if compared > 0:
            fractions = agree / compared
            out["moe/routing_agreement"] = float(fractions.mean())
            out.update({f"moe/routing_agreement/layer{layer}": float(v) for layer, v in enumerate(fractions)})
        imbalance = load_imbalance(load)
        if not torch.isnan(imbalance).all():
            out["moe/imbalance"] = float(imbalance.nanmean())
            if self.config.load_metrics:
                out.update({f"moe/imbalance/layer{layer}": float(v) for layer, v in enumerate(imbalance)})
                share = load / load.sum(dim=-1, keepdim=True).clamp(min=1)
                for layer in range(layers):
                    for expert in range(experts):
                        out[f"moe/expert_load/layer{layer}/expert{expert}"] = float(share[layer, expert])
        if self.aux_coef > 0:
            out["moe/aux_loss"] = aux
        self._reset()
        return out


def no_route_like(input_ids: torch.Tensor, layers: int, top_k: int) -> torch.Tensor:
    """``[B, T, L, K]`` of -1: rows without routes."""
    return torch.full((*input_ids.shape[:2], layers, top_k), NO_ROUTE, dtype=ROUTE_DTYPE)
