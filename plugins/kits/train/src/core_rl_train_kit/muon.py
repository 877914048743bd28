"""``actor.optimizer.name: muon``: torch's Muon for the hidden weight matrices, AdamW for the rest,
as one optimizer (:class:`MuonWithAdamW`) so engines step, clip, schedule and checkpoint it like
any other.

Muon orthogonalises each matrix's momentum (Newton-Schulz iterations), which is meaningful only
for the weight matrices inside the network: the embeddings and the output head (a lookup table
and a classifier over the vocabulary) and every parameter of fewer than two dimensions take AdamW
(Keller Jordan's and Moonlight's recipe). :func:`muon_split` draws that line.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch
from core_rl.config.model_sections import OptimizerConfig
from torch import nn

#: the parameter-group key that marks Muon's groups (saved with the optimizer state)
MUON_GROUP = "muon"
#: the parameter-group key scaling the schedule's learning rate (``muon_lr / lr`` for Muon's groups;
#: :func:`core_rl_train_kit.optim.set_lr`)
LR_RATIO = "lr_ratio"


def embeddings_and_head(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon leaves to AdamW although they are matrices: those of every
    ``nn.Embedding`` and of the output head (a causal LM's ``get_output_embeddings()``, a value or
    score model's ``score`` layer, or ``classifier`` where a model family names it so)."""
    found: list[nn.Parameter] = []
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            found.extend(module.parameters())
        if hasattr(module, "get_output_embeddings"):
            head = (
                module.get_output_embeddings() or getattr(module, "score", None) or getattr(module, "classifier", None)
            )
            if isinstance(head, nn.Module):
                found.extend(head.parameters())
    return found


def muon_split(
    params: Iterable[nn.Parameter], adamw_only: Collection[nn.Parameter]
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(hidden matrices, others)``: the two-dimensional parameters not in ``adamw_only`` (by
    identity), then every other parameter, each in the order of ``params``."""
    excluded = {id(p) for p in adamw_only}
    params = list(params)
    hidden = [p for p in params if p.dim() == 2 and id(p) not in excluded]
    taken = {id(p) for p in hidden}
    return hidden, [p for p in params if id(p) not in taken]


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over Muon's groups (marked ``muon: True``) and AdamW's: ``step`` runs
    ``torch.optim.Muon`` and ``torch.optim.AdamW`` on their own groups, both reading and writing
    this optimizer's ``state`` and ``param_groups``, so ``state_dict``/``load_state_dict`` (and
    torch's distributed checkpoint helpers) see one ordinary optimizer. Loading a state keeps this
    run's Muon settings (``lr_ratio``, ``momentum``), not the saving run's."""

    def __init__(
        self,
        muon_groups: list[dict[str, Any]],
        adamw_groups: list[dict[str, Any]],
        config: OptimizerConfig,
        adamw_kernel: dict[str, bool],
    ) -> None:
        self._muon_settings = {
            LR_RATIO: (config.muon_lr if config.muon_lr is not None else config.lr) / config.lr,
            "momentum": config.muon_momentum,
        }
        inner: dict[bool, torch.optim.Optimizer] = {}
        if muon_groups:
            inner[True] = torch.optim.Muon(
                [{**g, MUON_GROUP: True, **self._muon_settings} for g in muon_groups],
                lr=config.lr,
                weight_decay=config.weight_decay,
                momentum=config.muon_momentum,
            )
        if adamw_groups:
            inner[False] = torch.optim.AdamW(
                [{**g, MUON_GROUP: False} for g in adamw_groups],
                lr=config.lr,
                betas=tuple(config.betas),
                eps=config.eps,
                weight_decay=config.weight_decay,
                **adamw_kernel,
            )
        super().__init__([g for optimizer in inner.values() for g in optimizer.param_groups], {})
        self._inner = inner

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for marked, inner in self._inner.items():
            inner.param_groups = [g for g in self.param_groups if g[MUON_GROUP] is marked]
            inner.state = self.state
            if inner.param_groups:
                inner.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if group[MUON_GROUP]:
                group.update(self._muon_settings)
