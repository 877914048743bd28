"""``sdpa_float32``: transformers' SDPA attention in float32 inside a bfloat16 autocast region."""

from __future__ import annotations

import torch
from core_rl_fsdp import attention
from core_rl_fsdp.config import FSDPConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def _inputs(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 8, generator=g).to(dtype) for _ in range(3))
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False  # left padding of the second row
    mask[1, :, :2, 0] = True  # padded queries see something (no NaN)
    module = torch.nn.Module()
    module.is_causal = True
    return module, q, k, v, mask


def test_matches_sdpa_in_float32_and_keeps_the_input_dtype() -> None:
    module, q, k, v, mask = _inputs(torch.float32)
    want, _ = sdpa_attention_forward(module, q, k, v, mask)
    got, _ = attention.sdpa_float32_attention(module, q, k, v, mask)
    assert torch.equal(got, want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = attention.sdpa_float32_attention(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert low.dtype == torch.bfloat16
    # float32 math on bf16-rounded inputs: only input and output rounding remain
    exact, _ = sdpa_attention_forward(module, q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), mask)
    assert torch.equal(low, exact.bfloat16())


def test_gradients_flow_to_bfloat16_inputs() -> None:
    module, q, k, v, mask = _inputs(torch.bfloat16)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, _ = attention.sdpa_float32_attention(module, q, k, v, mask)
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_auto_resolution() -> None:
    cpu = torch.device("cpu")
    assert attention.resolve(FSDPConfig(), cpu, "float32") == "sdpa"
    assert attention.resolve(FSDPConfig(autocast_dtype="bfloat16"), cpu, "bfloat16") == attention.NAME
    assert attention.resolve(FSDPConfig(autocast_dtype="bfloat16", attn_implementation="eager"), cpu, "bfloat16") == (
        "eager"
    )
    assert attention.resolve(FSDPConfig(attn_implementation="sdpa_float32"), cpu, "float32") == attention.NAME
