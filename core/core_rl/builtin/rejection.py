"""Built-in rejection samplers (``algorithm.rejection_sampling``): ``ratio``, ``kl_k1``, ``kl_k2``,
``kl_k3``, ``tis`` and ``mis`` (see :mod:`core_rl.ops.rejection`). Registration only: no torch import."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl
from core_rl.ops.rejection import (
    ImportanceSamplingConfig,
    RatioRejectionConfig,
    RejectionSamplingConfig,
    make_kl,
    make_mis,
    make_ratio,
    make_tis,
)


@hookimpl
def core_rl_register_rejection_samplers(register: Register) -> None:
    register(
        "ratio",
        make_ratio,
        description="Importance ratio pi_prox/pi_behave (log-space at sequence level): mask or clamp",
        config_cls=RatioRejectionConfig,
    )
    for name, formula in (("kl_k1", "log r"), ("kl_k2", "(log r)^2 / 2"), ("kl_k3", "r - log r - 1")):
        register(
            name,
            make_kl(name),
            description=f"KL estimate {formula} between proximal and behaviour policy: mask out of bounds",
            config_cls=RejectionSamplingConfig,
        )
    register(
        "tis",
        make_tis,
        description="Truncated importance sampling: clamp pi_prox/pi_behave to [lower, upper]",
        config_cls=ImportanceSamplingConfig,
    )
    register(
        "mis",
        make_mis,
        description="Masked importance sampling: drop tokens whose pi_prox/pi_behave leaves [lower, upper]",
        config_cls=ImportanceSamplingConfig,
    )
