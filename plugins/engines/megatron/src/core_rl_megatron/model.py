"""Building Megatron-core GPT model chunks from an :class:`~core_rl_megatron.families.ArchSpec`,
wrapping them (bf16, DDP), and moving Hugging Face weights into their tensor-parallel shards."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module
from torch import nn

from core_rl_megatron import convert
from core_rl_megatron.config import MegatronConfig
from core_rl_megatron.errors import MegatronSetupError
from core_rl_megatron.families import ArchSpec
from core_rl_megatron.heads import install_scalar_head
from core_rl_megatron.hf_io import HFWeights

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def transformer_config(
    spec: ArchSpec, cfg: MegatronConfig, *, params_dtype: torch.dtype, on_cuda: bool
) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` for ``spec`` with the engine's parallel and memory settings.

    Weights are never initialised (``perform_initialization=False``): they are loaded from the
    Hugging Face checkpoint right after construction. Dropout is off (RL fine-tuning; Hugging Face
    evaluates the same model without it). Losses are sums over tokens
    (``calculate_per_token_loss``), so neither the schedule nor DDP rescales gradients.
    """
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size
        if cfg.virtual_pipeline_size > 1
        else None,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        sequence_parallel=cfg.sequence_parallel,
        recompute_granularity=cfg.recompute_granularity,
        recompute_method=cfg.recompute_method,
        recompute_num_layers=cfg.recompute_num_layers,
        bf16=cfg.bf16,
        params_dtype=torch.bfloat16 if cfg.bf16 else params_dtype,
        pipeline_dtype=torch.bfloat16 if cfg.bf16 else params_dtype,
        use_cpu_initialization=not on_cuda,
        perform_initialization=False,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # the one Megatron accepts with variable_seq_lengths
        # fused kernels need CUDA extensions (Apex / Transformer Engine); plain PyTorch otherwise
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    if cfg.recompute_modules is not None:
        kwargs["recompute_modules"] = list(cfg.recompute_modules)
    try:
        return TransformerConfig(**kwargs)
    except (AssertionError, ValueError) as exc:
        raise MegatronSetupError(f"actor.engine: megatron-core rejects these settings for this model: {exc}") from None


def layer_spec(spec: ArchSpec, cfg: MegatronConfig):  # -> ModuleSpec
    """Megatron's layer spec: its local modules, or Transformer Engine's."""
    from megatron.core.models.gpt import gpt_layer_specs

    if cfg.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise MegatronSetupError(
                "actor.engine.transformer_impl: transformer_engine needs the transformer-engine package "
                "(GPU only); use transformer_impl: local"
            ) from None
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")


def build_chunks(
    spec: ArchSpec, cfg: MegatronConfig, tconfig: TransformerConfig, padded_vocab: int, device: torch.device
) -> list[GPTModel]:
    """This rank's model chunks on ``device``: one per virtual pipeline stage (one without virtual
    pipelining). The first chunk of the first stage holds the embedding, the last chunk of the last
    stage the final norm and output layer (for ``spec.head`` ``value`` / ``score``: a scalar head,
    :mod:`core_rl_megatron.heads`).

    megatron-core creates its own layers on the GPU, but not everything: without Apex or Transformer
    Engine its norms are plain torch modules built on the CPU, and the scalar head is ours. So the
    whole chunk is moved to ``device`` (as Megatron-LM's training scripts do after building)."""
    layers = layer_spec(spec, cfg)
    vpp = cfg.virtual_pipeline_size
    chunks = []
    for vp_stage in range(vpp):
        stage = vp_stage if vpp > 1 else None
        chunks.append(
            GPTModel(
                config=tconfig,
                transformer_layer_spec=layers,
                vocab_size=padded_vocab,
                max_sequence_length=spec.max_position_embeddings,
                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                parallel_output=True,
                share_embeddings_and_output_weights=spec.ties_output_layer,
                position_embedding_type="rope",
                rotary_base=spec.rope.theta,
                rope_scaling=spec.rope.llama3_factor is not None,
                rope_scaling_factor=spec.rope.llama3_factor or 8.0,
                vp_stage=stage,
            )
        )
    if spec.head != "lm":  # the last stage's chunk: the scalar head in place of the vocabulary projection
        for chunk in chunks:
            install_scalar_head(chunk, spec.head, sequence_parallel=cfg.sequence_parallel)
    return [chunk.to(device) for chunk in chunks]


def wrap_chunks(
    chunks: Sequence[GPTModel], cfg: MegatronConfig, tconfig: TransformerConfig
) -> list[DistributedDataParallel]:
    """``Float16Module`` (with ``bf16``) then Megatron's ``DistributedDataParallel``, which keeps
    gradients in contiguous buffers (``param.main_grad``) and reduces them over data-parallel ranks.
    Chunks after the first share no buckets (as Megatron-LM does with virtual pipelining)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.ddp.grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.ddp.overlap_grad_reduce,
        overlap_param_gather=cfg.ddp.overlap_param_gather,
        use_distributed_optimizer=cfg.ddp.use_distributed_optimizer,
        bucket_size=cfg.ddp.bucket_size,
        check_for_nan_in_grad=cfg.ddp.check_for_nan_in_grad,
    )
    return [
        DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=module, disable_bucketing=i > 0)
        for i, module in enumerate(float16_wrapped(chunks, cfg, tconfig))
    ]


def float16_wrapped(chunks: Sequence[GPTModel], cfg: MegatronConfig, tconfig: TransformerConfig) -> list[nn.Module]:
    """With ``bf16`` each chunk inside Megatron's ``Float16Module``: every parameter in bf16 (the
    norms too, which megatron-core builds in float32 without Transformer Engine), inputs cast on
    the first pipeline stage, outputs back to float32 on the last; without, the chunks as they are.
    Trainable and frozen engines (a reference model) wrap alike, so they compute alike."""
    return [Float16Module(tconfig, chunk) if cfg.bf16 else chunk for chunk in chunks]


def unwrap(module: nn.Module) -> GPTModel:
    """The ``GPTModel`` inside DDP / ``Float16Module`` wrappers."""
    while not isinstance(module, GPTModel):
        module = module.module
    return module


def global_parameters(chunks: Iterable[nn.Module]) -> dict[str, nn.Parameter]:
    """This rank's parameters named as in :func:`core_rl_megatron.convert.param_maps`: decoder
    layers by their global (0-based) index across pipeline stages and chunks."""
    out: dict[str, nn.Parameter] = {}
    for chunk in chunks:
        gpt = unwrap(chunk)
        numbers = [layer.layer_number - 1 for layer in gpt.decoder.layers] if hasattr(gpt, "decoder") else []
        for name, param in gpt.named_parameters():
            match = _LAYER.match(name)
            if match:
                name = f"decoder.layers.{numbers[int(match.group(1))]}.{name[match.end() :]}"
            out[name] = param
    return out


def mirror_padding_idx(chunks: Iterable[nn.Module], pad_token_id: int | None) -> None:
    """Hugging Face's decoders look tokens up in ``nn.Embedding(..., padding_idx=pad_token_id)``:
    a pad token's lookup sends no gradient to the embedding. That matters wherever a pad token is
    attended (e.g. one a policy sampled, or ``pad == eos``); the same here: on the chunk holding the
    word embeddings, the gradient reaching the lookup's output at pad tokens is zeroed (the lookup
    is that output's only input, so nothing else changes; a tied output layer still trains the
    row). Under sequence parallelism the output is this rank's chunk of the sequence, ``[s/tp, b, h]``."""
    if pad_token_id is None:
        return

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and output.requires_grad):
            return
        pad = args[0] == pad_token_id  # [b, s]
        if getattr(module, "reduce_scatter_embeddings", False):
            chunk, rank = output.shape[0], mpu.get_tensor_model_parallel_rank()
            pad = pad.transpose(0, 1)[rank * chunk : (rank + 1) * chunk]
        if pad.any():
            output.register_hook(lambda grad: grad.masked_fill(pad[..., None], 0.0))

    for chunk in chunks:
        gpt = unwrap(chunk)
        if getattr(gpt, "pre_process", False):
            gpt.embedding.word_embeddings.register_forward_hook(hook)


_PARTITION_DIM = {convert.Split.ROWS: 0, convert.Split.GLU: 0, convert.Split.COLS: 1}


def tag_tensor_parallel(params: dict[str, nn.Parameter], spec: ArchSpec, impl: str) -> None:
    """Mark each split parameter as tensor-parallel (``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``), which gradient norms and checkpoints rely on to count a shard once per
    rank and a replicated tensor once per model. megatron-core sets these only while it initialises
    weights, which the engine skips (``perform_initialization=False``: the weights are loaded)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for pm in convert.param_maps(spec, impl):
        param = params.get(pm.megatron)
        if param is not None and pm.split in _PARTITION_DIM and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, True, _PARTITION_DIM[pm.split], 1)


@torch.no_grad()
def load_hf_weights(
    params: dict[str, nn.Parameter],
    weights: HFWeights,
    spec: ArchSpec,
    padded_vocab: int,
    impl: str,
) -> None:
    """Copy each local parameter's tensor-parallel shard from the Hugging Face checkpoint; every
    local parameter must be covered (an optional one, a scalar head, is zeroed where the checkpoint
    lacks it)."""
    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    loaded = set()
    for pm in convert.param_maps(spec, impl):
        param = params.get(pm.megatron)
        if param is None:
            continue
        if pm.optional and not all(n in weights for n in pm.hf):
            param.zero_()  # a head the directory does not hold (e.g. a causal LM's): every run starts at 0
            loaded.add(pm.megatron)
            continue
        full = convert.to_megatron(pm, [weights.get(n) for n in pm.hf], spec, padded_vocab)
        part = convert.shard(full, pm.split, tp_rank, tp_size)
        if part.shape != param.shape:
            raise MegatronSetupError(
                f"actor.model_path: {pm.hf} give {pm.megatron} the shape {tuple(part.shape)} on this rank, "
                f"but the model expects {tuple(param.shape)}"
            )
        param.copy_(part.to(param.dtype))
        loaded.add(pm.megatron)
    missing = sorted(set(params) - loaded)
    if missing:
        raise MegatronSetupError(f"the megatron engine has no Hugging Face source for parameters {missing}")
