"""The ``rollout.engine`` section of the ``hf`` engine (validated by the core config loader)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from core_rl.config.schema import DTYPES
from core_rl.config.validators import MAX_COUNT, FieldValueError, in_range, one_of

from core_rl_hf.memory import HOST_MEMORY_POLICIES

if TYPE_CHECKING:  # torch is imported when a device is checked or resolved, not when the plugin registers
    import torch
    from core_rl.config.checks import EnvironmentContext


#: dtypes accepted by ``autocast_dtype`` (``None``: off)
AUTOCAST_DTYPES = ("bfloat16",)
#: tokens between the host's checks for finished rows on a GPU (``sync_every: null``)
GPU_SYNC_EVERY = 16
#: device types the engine generates on
DEVICE_TYPES = ("cpu", "cuda", "mps")


def _valid_device(_inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    """``auto``, or a :class:`torch.device` string of a type in :data:`DEVICE_TYPES` (``cpu``,
    ``cuda``, ``cuda:1``, ``mps``)."""
    if value == "auto":
        return
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise FieldValueError(attribute.name, value, "must be 'auto', 'cpu', 'cuda', 'cuda:<index>' or 'mps'")


@attrs.define
class HFRolloutConfig:
    """Options of the ``hf`` rollout engine.

    - ``dtype``: the weights' dtype for generation (sampling itself runs in float32).
    - ``device``: ``auto`` (``cuda`` when available, else ``cpu``) or a torch device string.
    - ``max_batch_size``: at most this many sequences (prompts x ``n``) are generated together;
      larger requests are split into chunks of sequences of similar prompt length.
    - ``seed``: seeds the engine's own ``torch.Generator`` so a sequence of ``generate`` calls is
      reproducible; ``None`` samples from torch's global RNG (seeded by the trainer).
    - ``decoder``: how each one-token decoding step runs: ``auto`` takes the lean path of
      :mod:`core_rl_hf.decode` for Llama and Qwen2 models (the same logits, less per-step work)
      and the model's own forward for other architectures; ``transformers`` always uses the forward.
    - ``autocast_dtype``: generate in mixed precision, the arithmetic of the train engines'
      ``autocast_dtype``: matrix products in ``bfloat16`` on the stored weights (rounded once per
      ``generate`` call), embeddings, norms, rotary embeddings, attention, the residual stream and
      sampling in the weights' dtype. On a CPU the model then attends with ``sdpa_float32``
      (:mod:`core_rl_train_kit.attention`), so the behaviour log-probs are those of an actor
      trained with ``actor.engine.autocast_dtype`` (up to summation order). On CPUs with native
      bfloat16 (AVX512-BF16, AMX) the projections run about twice as fast. ``None`` (default):
      generate in the weights' dtype.
    - ``cuda_graphs``: replay each decoding step from a CUDA graph captured once per batch shape
      (:mod:`core_rl_hf.graphs`); ``null`` (default): on for a CUDA device with the lean decoder,
      off otherwise; ``true`` requires both; ``false``: launch every step's kernels from Python.
    - ``compile``: ``torch.compile`` the lean decoding step and the token choice after it
      (:func:`core_rl_hf.decode.compiled_advance`; inductor, the model's sizes constant, the rows
      and positions symbolic) wherever no CUDA graph replays it, as on a CPU: the element-wise
      work around each layer's matrix products (norms, rotary embeddings, cache writes, the
      activation, casts) and the choice's (filters, penalties, sampling, bookkeeping) run as a few
      fused kernels instead of dozens of operator calls. The first generation of a process pays
      the compilation, 15-20 s for the CPU benchmark's small models on a 2-core CPU (inductor
      caches its kernels across runs); the logits differ from the eager step's by
      float rounding (with ``autocast_dtype`` up to ~1e-3 in a log-prob: a bfloat16 input rounded
      from other float32 sums). Needs the lean decoder (``decoder: auto`` on a Llama or Qwen2
      model) and, on a CPU, a C++ compiler.
    - ``host_memory``: what the process does with host memory freed between generation and
      training (:mod:`core_rl_hf.memory`; glibc only): ``reuse`` keeps it mapped for the next
      allocations (fewer page faults: a ~8% faster step on the CPU benchmark's medium workload;
      resident memory stays at the run's high-water mark); ``release`` hands the free pages back to
      the OS before and after each generation (a lower resident set between the phases); ``null``
      (default): ``reuse`` on a CPU device, where the model's activations and cache live in host
      memory, ``release`` on a GPU.
    - ``sync_every``: the host checks whether all rows of a batch are done (and drops finished
      rows, without graphs) every this many tokens; ``null``: every token on a CPU (where the
      check costs nothing), every :data:`GPU_SYNC_EVERY` tokens on a GPU (each check waits for the
      device; up to that many steps may run after the last row is done).

    With ``rollout.sleep_while_training: true`` (a CUDA device; ``auto`` leaves it off for this
    engine), the engine drops its captured CUDA
    graphs and their key/value buffers after each step's generation, so the trainer in the same
    process can use that memory; the next generation captures them again.
    """

    #: the engine can give back its GPU memory while the trainer trains (``rollout.sleep_while_training``)
    releases_memory: ClassVar[bool] = True
    #: rows stop at rollout.sampling.stop strings (core_rl_hf.stop_check; the tokenizer is needed)
    stop_strings: ClassVar[bool] = True
    #: ``actor.trust_remote_code`` reaches its model and tokenizer loads (:mod:`core_rl.roles.remote_code`)
    loads_remote_code: ClassVar[bool] = True
    #: a mixture-of-experts model's samples carry the experts each token was routed to, recorded from
    #: the prefill and each decoding step (``rollout.return_routed_experts``, :mod:`core_rl_train_kit.moe`)
    returns_routed_experts: ClassVar[bool] = True
    #: it takes prompts with images and their pixel inputs (vision-language models, :mod:`core_rl.vision`)
    multimodal: ClassVar[bool] = True

    dtype: str = attrs.field(default="float32", validator=one_of(DTYPES))
    device: str = attrs.field(default="auto", validator=_valid_device)
    max_batch_size: int = attrs.field(default=256, validator=in_range(1, MAX_COUNT))
    seed: int | None = attrs.field(default=None, validator=in_range(0, 2**63 - 1))
    decoder: str = attrs.field(default="auto", validator=one_of(("auto", "transformers")))
    autocast_dtype: str | None = attrs.field(default=None, validator=one_of(AUTOCAST_DTYPES))
    cuda_graphs: bool | None = None
    sync_every: int | None = attrs.field(default=None, validator=in_range(1, MAX_COUNT))
    compile: bool = False
    host_memory: str | None = attrs.field(default=None, validator=one_of(HOST_MEMORY_POLICIES))

    def __attrs_post_init__(self) -> None:
        if self.compile and self.decoder == "transformers":
            raise FieldValueError(
                "compile",
                self.compile,
                "compiles the lean decoding step, which decoder: transformers does not use; set decoder: auto",
            )

    def check_environment(self, context: EnvironmentContext) -> list[str]:
        """The device against what the machine has."""
        if self.device == "auto":
            return []
        import torch

        if self.cuda_graphs and torch.device(self.device).type != "cuda":
            return [
                f"{context.key('cuda_graphs')}: true needs a CUDA device but {context.key('device')} is "
                f"{self.device!r}; set cuda_graphs to null (on where possible) or false"
            ]

        device = torch.device(self.device)
        machine = context.machine
        where = context.key("device")
        if device.type == "cuda" and not machine.cuda_available:
            return [
                f"{where}: {self.device!r} but this machine has no CUDA GPU (torch.cuda.is_available() is False); "
                "use 'auto' or 'cpu'"
            ]
        if device.type == "cuda" and device.index is not None and device.index >= machine.cuda_device_count:
            return [
                f"{where}: {self.device!r} but this machine has {machine.cuda_device_count} CUDA device(s), "
                f"cuda:0 to cuda:{machine.cuda_device_count - 1}"
            ]
        if device.type == "mps" and not machine.mps_available:
            return [f"{where}: 'mps' but Apple MPS is not available here; use 'auto' or 'cpu'"]
        return []


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda`` if a GPU is visible else ``cpu``; otherwise ``torch.device(device)``.

    Raises :class:`RuntimeError` when a CUDA device is asked for and none is available.
    """
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"rollout.engine.device is {device!r} but no CUDA device is available")
    return resolved
