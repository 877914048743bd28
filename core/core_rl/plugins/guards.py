"""Guards: the small tensor components a run builds from plugins (advantage estimators, sample
filters, policy losses, rejection samplers), wrapped so that every call's result is checked where
the core receives it, against the shapes and dtypes of :mod:`core_rl.protocol` and
:mod:`core_rl.interfaces`. A result that breaks the contract, or an exception from the plugin's
code, is a :class:`~core_rl.errors.PluginFault` naming the component, instead of a shape mismatch
deep in the core's arithmetic (:mod:`core_rl.ops`) or a silently wrong batch.

A guard is an instance of its interface; every other attribute is the wrapped component's
(``guard.inner``). :func:`check_tensor` and :func:`check_metrics` are the checks, also used for the
outputs of engines and workflows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from core_rl.errors import PluginFault
from core_rl.interfaces import (
    AdvantageEstimator,
    ImportanceCorrection,
    LossOutput,
    PolicyLoss,
    RejectionSampler,
    SampleFilter,
)
from core_rl.plugins.attribution import built_by, calling
from core_rl.plugins.kinds import ADVANTAGE, POLICY_LOSS, REJECTION_SAMPLER, SAMPLE_FILTER, PluginKind
from core_rl.reliability.progress import PROGRESS

if TYPE_CHECKING:
    import torch

    from core_rl.protocol import TensorBatch

#: the dtype families :func:`check_tensor` tells apart
FLOAT, BOOL, ANY = "float", "bool", "any"


def described(value: Any) -> str:
    """``a float32 tensor of shape [8]``, or the type of a value that is no tensor."""
    import torch  # here: building a component (config validation) imports this module, and no torch

    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return "None" if value is None else f"a {type(value).__name__}, not a tensor"


def check_tensor(value: Any, words: str, what: str, *, shape: Sequence[int], dtype: str, contract: str) -> None:
    """Raise :class:`PluginFault` unless ``value`` is a tensor of ``shape`` whose dtype is of the
    family ``dtype`` (:data:`FLOAT`, :data:`BOOL` or :data:`ANY`). ``words`` names the component,
    ``what`` the value (``advantages``), ``contract`` what is required, e.g.
    ``AdvantageEstimator.__call__ returns [B, T] = [8, 12], like the batch's response_mask``."""
    import torch

    ok = isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape)
    if ok and dtype == FLOAT:
        ok = value.is_floating_point()
    elif ok and dtype == BOOL:
        ok = value.dtype == torch.bool
    if not ok:
        family = {FLOAT: "a floating-point tensor", BOOL: "a bool tensor", ANY: "a tensor"}[dtype]
        raise PluginFault(f"{words} returned {what} as {described(value)}; {contract}: {family} {list(shape)}")


def check_metrics(value: Any, words: str, what: str, contract: str) -> dict[str, float]:
    """``value`` as ``{name: float}``; a :class:`PluginFault` unless it is a mapping of names to numbers."""
    if not isinstance(value, Mapping):
        raise PluginFault(f"{words} returned {what} as {described(value)}; {contract}: a mapping of names to numbers")
    out = {}
    for name, number in value.items():
        try:
            out[str(name)] = float(number)
        except (TypeError, ValueError):
            raise PluginFault(
                f"{words} returned {what} with {name!r}: {number!r:.80}; {contract}: a mapping of names to numbers"
            ) from None
    return out


def engine_tensor(engine: Any, method: str, what: str, part: TensorBatch, **kwargs: Any) -> torch.Tensor:
    """``engine.<method>(part, **kwargs)``: a train engine's log-probs or values of a batch, which
    must be floats [B, T] like the batch's ``input_ids`` (:class:`core_rl.interfaces.TrainEngine`)."""
    with PROGRESS.call(f"{built_by(engine)}: {method}"):
        out = getattr(engine, method)(part, **kwargs)
    shape = part["input_ids"].shape
    contract = f"TrainEngine.{method} returns [B, T] = {list(shape)}, the shape of the batch's input_ids"
    check_tensor(out, built_by(engine), what, shape=shape, dtype=FLOAT, contract=contract)
    return out


def engine_topk(
    engine: Any, part: TensorBatch, k: int, *, vocab_size: int | None = None, **kwargs: Any
) -> dict[str, torch.Tensor]:
    """``engine.compute_topk_logprobs(part, k, vocab_size=..., **kwargs)`` (``vocab_size`` passed
    only when set): a teacher's top-k ids and log-probs, which must be [B, T, k] (ids of any dtype
    below ``vocab_size``, log-probs floats), as ``teacher_topk_ids`` and ``teacher_topk_logprobs``."""
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    with PROGRESS.call(f"{built_by(engine)}: compute_topk_logprobs"):
        ids, values = engine.compute_topk_logprobs(part, k, **kwargs)
    shape = (*part["input_ids"].shape, k)
    contract = f"TrainEngine.compute_topk_logprobs returns two [B, T, k] = {list(shape)} tensors"
    check_tensor(ids, built_by(engine), "top-k token ids", shape=shape, dtype=ANY, contract=contract)
    check_tensor(values, built_by(engine), "top-k log-probs", shape=shape, dtype=FLOAT, contract=contract)
    if vocab_size is not None and ids.numel() and int(ids.max()) >= vocab_size:
        raise PluginFault(
            f"{built_by(engine)}: compute_topk_logprobs returned token id {int(ids.max())}, outside the vocabulary "
            f"of {vocab_size} tokens it was given (vocab_size); {contract}, among the first vocab_size tokens"
        )
    return {"teacher_topk_ids": ids.long(), "teacher_topk_logprobs": values}


def engine_metrics(engine: Any, method: str, *args: Any, **kwargs: Any) -> dict[str, float]:
    """``engine.<method>(*args, **kwargs)``: the metrics of a train engine's optimiser step, which
    must map names to numbers."""
    with PROGRESS.call(f"{built_by(engine)}: {method}"):
        out = getattr(engine, method)(*args, **kwargs)
    return check_metrics(out, built_by(engine), f"the metrics of {method}", f"TrainEngine.{method} returns")


class _Guard:
    """What every guard shares: the component (``inner``), its name in messages (``words``), and
    every attribute the guard does not define read from the component."""

    def __init__(self, inner: Any, words: str) -> None:
        self.inner = inner
        self.words = words

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "words"):  # not set yet (e.g. while copying): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class _StatefulGuard(_Guard):
    """A guard of a component whose state checkpoints keep (``state_dict``/``load_state_dict``)."""

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)


class GuardedAdvantage(_StatefulGuard, AdvantageEstimator):
    """An advantage estimator whose advantages must be floats [B, T], like ``response_mask``."""

    def __init__(self, inner: AdvantageEstimator, words: str) -> None:
        super().__init__(inner, words)
        self.requires_values = inner.requires_values
        self.requires_reference = inner.requires_reference

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        advantages = calling(self.words, "computing advantages", self.inner, batch)
        shape = batch["response_mask"].shape
        contract = f"AdvantageEstimator.__call__ returns [B, T] = {list(shape)}, the shape of the batch's response_mask"
        check_tensor(advantages, self.words, "advantages", shape=shape, dtype=FLOAT, contract=contract)
        return advantages


class GuardedFilter(_Guard, SampleFilter):
    """A sample filter whose keep-mask must be bool [B]."""

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        keep = calling(self.words, "filtering samples", self.inner, batch)
        shape = (batch.batch_size,)
        contract = f"SampleFilter.__call__ returns one flag per row, [B] = {list(shape)}"
        check_tensor(keep, self.words, "its keep-mask", shape=shape, dtype=BOOL, contract=contract)
        return keep


class GuardedLoss(_StatefulGuard, PolicyLoss):
    """A policy loss whose aggregation weights must be floats like the mask they are given,
    whose per-token loss and token metrics must be [b, T] like the log-probs, and whose
    preparation returns metrics."""

    def __init__(self, inner: PolicyLoss, words: str) -> None:
        super().__init__(inner, words)
        self.requires_reference = inner.requires_reference
        self.entropy_grad = getattr(inner, "entropy_grad", True)

    @property
    def requires_recompute(self) -> bool:  # read at every update: a rejection sampler may change it
        return bool(self.inner.requires_recompute)

    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
        weights = calling(self.words, "weighting the loss", self.inner.loss_weights, response_mask)
        shape = response_mask.shape
        contract = f"PolicyLoss.loss_weights returns [B, T] = {list(shape)}, the shape of the mask it is given"
        check_tensor(weights, self.words, "loss weights", shape=shape, dtype=FLOAT, contract=contract)
        return weights

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        metrics = calling(self.words, "preparing the batch", self.inner.prepare, batch)
        return check_metrics(metrics, self.words, "the metrics of prepare", "PolicyLoss.prepare returns")

    def set_rejection_sampler(self, sampler: RejectionSampler | None) -> None:
        calling(self.words, "receiving the rejection sampler", self.inner.set_rejection_sampler, sampler)

    def has_gradient(self, batch: TensorBatch) -> bool:
        out = calling(self.words, "telling whether a step has a gradient", self.inner.has_gradient, batch)
        if not isinstance(out, bool):
            raise PluginFault(
                f"{self.words} returned {described(out)} from has_gradient; PolicyLoss.has_gradient returns a bool"
            )
        return out

    def observe_step(self, metrics: Mapping[str, float]) -> dict[str, float]:
        out = calling(self.words, "observing an optimiser step", self.inner.observe_step, metrics)
        return check_metrics(out, self.words, "the metrics of observe_step", "PolicyLoss.observe_step returns")

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        out = calling(self.words, "computing the loss", self.inner, batch, logprobs, entropy)
        shape = logprobs.shape
        contract = f"PolicyLoss.__call__ returns a LossOutput whose tensors are [b, T] = {list(shape)}, like logprobs"
        per_token = getattr(out, "per_token_loss", out)
        check_tensor(per_token, self.words, "per_token_loss", shape=shape, dtype=FLOAT, contract=contract)
        metrics = getattr(out, "token_metrics", {})
        if not isinstance(metrics, Mapping):
            raise PluginFault(f"{self.words} returned token_metrics as {described(metrics)}; {contract}")
        for name, value in metrics.items():
            check_tensor(value, self.words, f"token metric {name!r}", shape=shape, dtype=ANY, contract=contract)
        return out


class GuardedRejectionSampler(_Guard, RejectionSampler):
    """A rejection sampler whose weights must be floats and whose masks bool, [b, T] like the log-probs."""

    def __call__(
        self, proximal_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> ImportanceCorrection:
        out = calling(self.words, "judging tokens", self.inner, proximal_logprobs, behave_logprobs, mask)
        shape = proximal_logprobs.shape
        contract = f"RejectionSampler.__call__ returns an ImportanceCorrection of [b, T] = {list(shape)} tensors"
        check_tensor(getattr(out, "weight", out), self.words, "weight", shape=shape, dtype=FLOAT, contract=contract)
        check_tensor(getattr(out, "keep", None), self.words, "keep", shape=shape, dtype=BOOL, contract=contract)
        clamped = getattr(out, "clamped", None)
        if clamped is not None:
            check_tensor(clamped, self.words, "clamped", shape=shape, dtype=BOOL, contract=contract)
        return out


_GUARDS: dict[str, type[_Guard]] = {
    ADVANTAGE.key: GuardedAdvantage,
    SAMPLE_FILTER.key: GuardedFilter,
    POLICY_LOSS.key: GuardedLoss,
    REJECTION_SAMPLER.key: GuardedRejectionSampler,
}


def guard(kind: PluginKind, component: Any, words: str) -> Any:
    """``component`` in the guard of its kind (itself, for kinds whose results the core checks
    where it receives them: rewards, engines, workflows)."""
    guard_class = _GUARDS.get(kind.key)
    return component if guard_class is None else guard_class(component, words)
