"""The ``actor.moe`` section: mixture-of-experts training and routing replay (:mod:`core_rl.roles.moe`)."""

from __future__ import annotations

import attrs

from core_rl.config.validators import non_negative, one_of

#: ``actor.moe.routing_replay`` values
ROUTING_REPLAY_MODES = ("none", "rollout", "first_forward")
#: ``actor.moe.router_dtype`` values
ROUTER_DTYPES = ("auto", "float32")


@attrs.define
class MoEConfig:
    """Options for a mixture-of-experts actor (ignored by a dense model, except ``routing_replay``,
    which needs an MoE model's routers).

    - ``routing_replay``: which experts the training forwards (log-probs, reference, update) route
      each token to:

      - ``none``: the training model's own routers choose (the default);
      - ``rollout`` (R3): the experts the rollout engine chose when it generated the sample
        (``Sample.routed_experts``; the rollout engine is asked to return them, and must be able
        to: ``hf``); a token without a rollout route (the last response token, a token a multi-turn
        workflow inserted without running the model) is routed by the training router;
      - ``first_forward`` (R2): the experts of the step's first training forward over the batch
        (the log-prob forward where the algorithm recomputes log-probs, else the first update
        forward), replayed in every later forward of the step (the other micro-steps, PPO epochs).

      Replayed experts take their weights from the training router's own softmax at those experts,
      so the router still trains.
    - ``router_dtype``: ``float32`` computes the routers' logits in float32 whatever the model's
      dtype or autocast (AReaL's ``moe_router_dtype``); ``auto`` leaves them in the model's precision.
    - ``router_aux_loss_coef``: weight of the routers' load-balancing loss (Switch Transformer's
      ``E * sum_e f_e * P_e`` per layer, Hugging Face's ``load_balancing_loss_func``) added to the
      policy loss; ``null`` takes the model config's ``router_aux_loss_coef`` (0 turns it off).
    - ``load_metrics``: log per-expert load each step (``moe/tokens_per_expert/layer<l>/expert<e>``
      fractions and ``moe/imbalance`` = max/mean tokens per expert, mean over layers).
    """

    routing_replay: str = attrs.field(default="none", validator=one_of(ROUTING_REPLAY_MODES))
    router_dtype: str = attrs.field(default="auto", validator=one_of(ROUTER_DTYPES))
    router_aux_loss_coef: float | None = attrs.field(default=None, validator=non_negative())
    load_metrics: bool = True

    @property
    def replays(self) -> bool:
        """Whether the training forwards replay routes."""
        return self.routing_replay != "none"
