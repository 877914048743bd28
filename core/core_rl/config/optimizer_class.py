"""``actor.optimizer.name: class``: the optimizer class ``class_path`` names, loaded and checked
(:func:`load_optimizer_class`), and the keyword arguments it is built with
(:func:`constructor_kwargs`). The configuration load runs :func:`optimizer_class_problems`, so a
class that cannot be imported, is no ``torch.optim.Optimizer`` or cannot take its arguments stops
``core-rl config validate``, not the run."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from core_rl.config.model_sections import OptimizerConfig
from core_rl.plugins.callables import LoadFailed, load_callable

#: the constructor arguments core-rl passes itself (``kwargs`` cannot set them)
OWN_ARGUMENTS = ("params", "lr", "weight_decay")


def load_optimizer_class(class_path: str) -> type[torch.optim.Optimizer]:
    """The class ``class_path`` (``module:Class`` or ``file.py:Class``) names. Raises
    :class:`~core_rl.plugins.callables.LoadFailed` with one line when it cannot be loaded or is not a
    ``torch.optim.Optimizer`` subclass."""
    found = load_callable(class_path)
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise LoadFailed(f"{class_path!r} is {found!r}, not a torch.optim.Optimizer subclass")
    return found


def _accepts(cls: type, name: str) -> bool:
    """Whether ``cls``'s constructor takes the keyword argument ``name``."""
    params = inspect.signature(cls).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in params) or any(
        p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params
    )


def kwargs_problems(cls: type, kwargs: dict[str, Any], weight_decay: float) -> list[tuple[str, str]]:
    """What stops ``cls(groups, lr=..., [weight_decay=...,] **kwargs)``: ``(key, problem)`` pairs,
    ``key`` relative to the optimizer section."""
    name = cls.__name__
    problems = []
    for key in kwargs:
        if key in OWN_ARGUMENTS:
            problems.append(
                (f"kwargs.{key}", f"{key!r} is set by core-rl itself (from the section's own keys); remove it")
            )
        elif not _accepts(cls, key):
            problems.append((f"kwargs.{key}", f"{name} takes no argument {key!r}; remove it"))
    if weight_decay > 0 and not _accepts(cls, "weight_decay"):
        problems.append(("weight_decay", f"{weight_decay}, but {name} takes no weight_decay argument; set 0"))
    return problems


def constructor_kwargs(cls: type, config: OptimizerConfig) -> dict[str, Any]:
    """``lr``, ``weight_decay`` when ``cls`` takes it, and ``config.kwargs``."""
    decay = {"weight_decay": config.weight_decay} if _accepts(cls, "weight_decay") else {}
    return {"lr": config.lr, **decay, **config.kwargs}


def optimizer_class_problems(config: OptimizerConfig, path: str) -> list[str]:
    """The optimizer section at ``path`` (``actor.optimizer``) against the class it builds: for
    ``class``, ``class_path`` must load (:func:`load_optimizer_class`); for ``class`` and
    ``adafactor`` the constructor must take ``kwargs`` (:func:`kwargs_problems`)."""
    if config.name == "adafactor":
        cls: type = torch.optim.Adafactor
    elif config.name == "class":
        if config.class_path is None:
            return [f"{path}.class_path: required with {path}.name: class; write 'package.module:ClassName'"]
        try:
            cls = load_optimizer_class(config.class_path)
        except LoadFailed as exc:
            return [f"{path}.class_path: {exc}"]
    else:
        return []
    return [f"{path}.{key}: {problem}" for key, problem in kwargs_problems(cls, config.kwargs, config.weight_decay)]
