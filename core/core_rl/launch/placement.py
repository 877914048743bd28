"""Whether a run's placement (``placement:``, :mod:`core_rl.config.placement`) is consistent with
its rollout engine (:func:`placement_config_problems`, on every configuration load) and fits what
a launcher offers (:func:`placement_problems`, :class:`ClusterResources`; a launcher's ``check``).

Sizes, per resource (GPUs, then CPU cores), with ``actor = placement.actor.<r> x nodes`` and
``rollout = placement.rollout.<r> x nodes``:

- ``colocate``: ``max(actor, rollout)`` (rollout runs on the trainer's devices);
- ``split``: ``actor + rollout``; and ``actor.nodes + rollout.nodes`` nodes unless one node holds
  a node's share of both;
- ``external``: ``actor`` (the servers are someone else's).

Each role's per-node share must fit one node and its ``nodes`` the nodes offered.

Whether the rollout engine sleeps while the trainer trains (``rollout.sleep_while_training``,
:func:`sleeps_while_training`) follows from the placement too: only an engine on the trainer's
GPUs (``colocate``, on CUDA) in a synchronous run has GPU memory to hand over and a time to do it;
:func:`sleep_problems` refuses ``true`` anywhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from core_rl.config.placement import RolePlacement

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig

#: the resources a placement asks for: (attribute of RolePlacement, of ClusterResources, word)
RESOURCES = (("gpus", "gpus_per_node", "GPUs"), ("cpus", "cpus_per_node", "CPU cores"))


@attrs.frozen
class ClusterResources:
    """What a launcher offers: ``nodes`` nodes of ``gpus_per_node`` GPUs and ``cpus_per_node`` CPU
    cores each. ``source`` says where the figures come from, as messages quote it (e.g.
    ``"launcher.nodes, launcher.gpus_per_node, launcher.cpus_per_node"`` or ``"this machine"``)."""

    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    source: str = ""

    def offer(self, per_node_attr: str) -> str:
        """``4 (1 node x 4 per node: this machine)``: the total of one resource and where it is from."""
        per_node = getattr(self, per_node_attr)
        nodes = f"{self.nodes} node{'s' if self.nodes != 1 else ''}"
        return f"{self.nodes * per_node} ({nodes} x {per_node} per node{': ' + self.source if self.source else ''})"


def server_options(cfg: RunConfig) -> Any:
    """The rollout engine's ``server`` subsection (a :class:`core_rl_server_kit.remote.options.ServerOptions`)
    when the selected engine runs inference servers, else ``None`` (e.g. ``hf``, in rank 0)."""
    return getattr(cfg.rollout.engine.config, "server", None)


def placement_mode(cfg: RunConfig) -> str:
    """``placement.mode`` with ``auto`` resolved: ``external`` when ``rollout.engine.server.urls``
    lists servers, else ``colocate``."""
    if cfg.placement.mode != "auto":
        return cfg.placement.mode
    server = server_options(cfg)
    return "external" if server is not None and server.urls else "colocate"


def placement_config_problems(cfg: RunConfig) -> list[str]:
    """The placement against the rest of the configuration, whatever the resources: ``external``
    exactly when ``rollout.engine.server.urls`` lists servers, ``split`` only for server-backed
    engines, and the other model roles in the trainer's ranks."""
    placement = cfg.placement
    mode = placement_mode(cfg)
    problems = []
    server = server_options(cfg)
    engine = cfg.rollout.engine.name
    if mode == "external":
        if server is None:
            problems.append(
                f"placement.mode: external needs a rollout engine that talks to inference servers (vllm, sglang) "
                f"with rollout.engine.server.urls; rollout engine {engine!r} runs inside trainer rank 0"
            )
        elif not server.urls:
            problems.append(
                "rollout.engine.server.urls: empty, but placement.mode is external; list the URLs of the running "
                "servers, or choose placement.mode colocate or split to have core-rl start them"
            )
        if placement.rollout != RolePlacement():
            problems.append(
                "placement.rollout: external servers are not placed by core-rl; remove placement.rollout "
                "(or choose placement.mode colocate or split)"
            )
    elif server is not None and server.urls:
        problems.append(
            f"rollout.engine.server.urls: servers someone else started make the rollout external, but "
            f"placement.mode is {mode}; set placement.mode: external (or auto), or empty the list to have "
            "core-rl start its own servers"
        )
    if mode == "split" and server is None:
        problems.append(
            f"placement.mode: split gives rollout servers GPUs or nodes of their own, but rollout engine {engine!r} "
            "runs inside trainer rank 0; choose colocate, or a server-backed engine (vllm, sglang)"
        )
    from core_rl.roles.build import OPTIONAL_ROLES

    for role in OPTIONAL_ROLES:
        given = getattr(placement, role)
        if given is None:
            continue
        if getattr(cfg, role) is None:
            problems.append(f"placement.{role}: there is no {role}: section to place; remove placement.{role}")
        elif given != placement.actor:
            problems.append(
                f"placement.{role}: every trainer rank holds the {role} beside the actor, so it is placed with "
                f"the actor; leave placement.{role} null or make it equal to placement.actor"
            )
    return problems


def _share_fits(actor: RolePlacement, rollout: RolePlacement, resources: ClusterResources) -> bool:
    """Whether one node holds a node's share of both the actor and the rollout."""
    return all(
        getattr(actor, attr) + getattr(rollout, attr) <= getattr(resources, per_node) for attr, per_node, _ in RESOURCES
    )


def placement_problems(cfg: RunConfig, resources: ClusterResources) -> list[str]:
    """What the placement of ``cfg`` asks for beyond ``resources`` (see the module docstring),
    each problem naming the key, what is needed and what is offered."""
    placement = cfg.placement
    mode = placement_mode(cfg)
    roles = {"actor": placement.actor}
    if mode != "external":
        roles["rollout"] = placement.rollout
    problems = []
    for role, given in roles.items():
        if given.nodes > resources.nodes:
            problems.append(
                f"placement.{role}.nodes: {given.nodes} nodes, but the launcher offers {resources.nodes} "
                f"({resources.source or 'nodes offered'})"
            )
        for attr, per_node, word in RESOURCES:
            if getattr(given, attr) > getattr(resources, per_node):
                problems.append(
                    f"placement.{role}.{attr}: {getattr(given, attr)} {word} per node, but a node has "
                    f"{getattr(resources, per_node)} ({resources.source or 'per node'})"
                )
    if problems:
        return problems
    actor, rollout = placement.actor, placement.rollout
    for attr, per_node, word in RESOURCES:
        need_actor = getattr(actor, attr) * actor.nodes
        need_rollout = getattr(rollout, attr) * rollout.nodes if mode != "external" else 0
        need = need_actor + need_rollout if mode == "split" else max(need_actor, need_rollout)
        offered = resources.nodes * getattr(resources, per_node)
        if need > offered:
            parts = f"{need_actor} {word} for the actor (placement.actor.{attr} x nodes = {getattr(actor, attr)} x "
            parts += f"{actor.nodes})"
            if mode != "external":
                parts += f" and {need_rollout} for rollout, {need} in all"
            key = "rollout" if mode != "external" and need_rollout else "actor"
            problems.append(
                f"placement.{key}.{attr}: {mode} placement needs {parts}; the launcher offers "
                f"{resources.offer(per_node)}"
            )
    if mode == "split" and actor.nodes + rollout.nodes > resources.nodes and not _share_fits(actor, rollout, resources):
        problems.append(
            f"placement.rollout.nodes: split placement needs {actor.nodes} nodes for the actor and {rollout.nodes} "
            f"for rollout ({actor.nodes + rollout.nodes} in all: one node cannot hold a node's share of both); the "
            f"launcher offers {resources.nodes} ({resources.source or 'nodes'})"
        )
    return problems


#: the option that puts the rollout engine to sleep while the trainer trains
SLEEP_KEY = "rollout.sleep_while_training"


def rollout_device(cfg: RunConfig, cuda_available: bool | None) -> tuple[str | None, str]:
    """The device type the rollout engine generates on (``cuda``, ``cpu``, ...) and what decided
    it, for messages: the server environment's variant (``rollout.engine.server.env_variant``) of
    a server-backed engine, else the engine's ``device`` option (``auto`` where it has none).
    Where the machine decides (``auto``, an empty variant), ``cuda`` if ``cuda_available``; the
    type is ``None`` while that is not known (``cuda_available`` ``None``)."""
    server = server_options(cfg)
    if server is not None:
        chosen, key = server.env_variant or "auto", "rollout.engine.server.env_variant"
    else:
        chosen, key = str(getattr(cfg.rollout.engine.config, "device", "auto")), "rollout.engine.device"
    if chosen != "auto":
        return chosen.split(":")[0], f"{key}: {chosen}"
    if cuda_available is None:
        return None, f"{key}: auto"
    return ("cuda", "a CUDA GPU") if cuda_available else ("cpu", "this machine has no CUDA GPU")


def sleep_problems(cfg: RunConfig, *, releases_memory: bool = True, cuda_available: bool | None = None) -> list[str]:
    """``rollout.sleep_while_training: true`` where it cannot work: placement ``split`` or
    ``external`` (no GPU shared with the trainer), an asynchronous run (generation overlaps
    training), an engine that cannot give back memory (``releases_memory``: its config class's
    ``releases_memory`` attribute), or one that generates on a CPU (known from the configuration,
    or from ``cuda_available`` where the machine decides; preflight checks that)."""
    if cfg.rollout.sleep_while_training is not True:
        return []
    problems = []
    mode = placement_mode(cfg)
    if mode != "colocate":
        why = "run on GPUs of their own" if mode == "split" else "are someone else's"
        problems.append(
            f"{SLEEP_KEY}: true, but placement.mode is {mode}: the rollout servers {why}, so no GPU memory is shared "
            "with the trainer; set it to auto or false"
        )
    bound = cfg.rollout.controller.max_head_offpolicyness
    if bound > 0:
        problems.append(
            f"{SLEEP_KEY}: true, but rollout.controller.max_head_offpolicyness is {bound}: generation goes on while "
            "the trainer trains, so the rollout engine cannot sleep then; set it to auto or false (or "
            "max_head_offpolicyness to 0)"
        )
    if not releases_memory:
        problems.append(
            f"{SLEEP_KEY}: true, but rollout engine {cfg.rollout.engine.name!r} cannot give back its memory; set it "
            "to auto or false"
        )
    device, why = rollout_device(cfg, cuda_available)
    if device is not None and device != "cuda":
        problems.append(
            f"{SLEEP_KEY}: true, but the rollout engine generates on {device} ({why}): only GPU memory is given "
            "back (vLLM's and SGLang's sleep modes run on CUDA alone); set it to auto or false"
        )
    return problems


def sleeps_while_training(cfg: RunConfig, *, releases_memory: bool, cuda_available: bool) -> bool:
    """``rollout.sleep_while_training`` resolved for a run on a machine with or without CUDA:
    ``auto`` is on for a server-backed engine that can give back memory (``releases_memory``),
    placed ``colocate``, on CUDA, in a synchronous run (``max_head_offpolicyness`` 0). An embedded
    engine (``hf``) holds little between steps (its decoding graphs' buffers), and giving that back
    costs a graph capture every step, so it sleeps only when asked (``true``)."""
    setting = cfg.rollout.sleep_while_training
    if setting != "auto":
        return bool(setting)
    return (
        releases_memory
        and server_options(cfg) is not None
        and placement_mode(cfg) == "colocate"
        and cfg.rollout.controller.max_head_offpolicyness == 0
        and rollout_device(cfg, cuda_available)[0] == "cuda"
    )
