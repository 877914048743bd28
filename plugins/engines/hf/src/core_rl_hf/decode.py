"""Decoding steps: one new token per row over a KV cache, through transformers or a lean path.

:func:`generate_batch <core_rl_hf.generation.generate_batch>` prefills with the model's own
forward and then asks a *stepper* for the next-token logits of each step. Two steppers share one
small interface (``step(tokens, done) -> logits [B, V]``, ``keep(rows)``):

- :class:`TransformersStepper` calls the model's forward with the transformers cache
  (written in place, :mod:`core_rl_hf.kv_cache`): any architecture.
- :class:`LeanStepper` runs the decoder layers of a Llama or Qwen2 model (:func:`lean_supported`)
  as plain tensor operations on the model's own weights, with its own ``[B, kv_heads, capacity,
  head_dim]`` key/value buffers and a boolean attention mask over them. Per layer:
  ``h += o_proj(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))`` with ``n = rms_norm(h)``, then
  ``h += down_proj(silu(gate_proj(n)) * up_proj(n))`` with ``n = rms_norm(h)``; attention is
  scaled dot-product attention over the cached positions, as the transformers forward computes it
  (a compiled step's single query in float32 on a CPU as two matrix products around a softmax:
  :func:`_one_query_attention`). It skips what a one-token step does not need from the
  general forward (mask construction over the whole sequence, module dispatch, cache objects),
  which was about 40% of a decode step on small models on CPU. Its logits equal the transformers
  forward's up to float rounding (tests compare them). It prefills too (:meth:`LeanStepper.prefill`:
  the same layers over the left-padded prompts with a causal mask, writing its buffers directly),
  in about a quarter less time than the model's forward plus the copy of its cache (the small CPU
  benchmark model).

Mixed precision (``compute_dtype``, the engine's ``autocast_dtype``): :class:`LeanStepper` runs
the projections (q/k/v/o, the MLP, the output head) on copies of their weights in that dtype, made
once per stepper, and keeps the embeddings, norms, rotary embedding and the residual stream in the
weights' dtype: the arithmetic of a forward under ``torch.autocast``. Attention (and its key/value
buffers) follows the model's attention implementation as autocast runs it: with ``sdpa_float32``
(:mod:`core_rl_train_kit.attention`, what the engines load on a CPU) in the weights' dtype, with
``sdpa`` (on a GPU) in ``compute_dtype``, as autocast casts SDPA's inputs. The value buffers hold
``compute_dtype`` either way: values come out of ``v_proj`` in it, so keeping them there is exact,
and float32 attention widens them as it reads them (half the bytes a decoding step reads of them;
the rotated keys are float32 sums and stay in the attention dtype).
:class:`TransformersStepper` runs the forward under ``torch.autocast``.

A row whose response is finished is fed a filler token whose outputs are discarded until it is
dropped (``keep``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch._dynamo
import torch.nn.functional as F
from core_rl_train_kit import attention
from torch.compiler import config as compiler_config
from torch.fx.experimental import _config as fx_config

from core_rl_hf.decode_state import DecodeState
from core_rl_hf.kv_cache import cache_argument, output_cache, preallocate

#: model classes whose decoder layers :class:`LeanStepper` reproduces
LEAN_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def lean_supported(model: torch.nn.Module) -> bool:
    """Whether :class:`LeanStepper` computes ``model`` exactly as its forward does: a Llama or
    Qwen2 causal LM (exactly those classes) with SiLU-gated MLPs without biases, full attention on
    every layer (no sliding window), no attention dropout in effect, and rotary frequencies that do
    not depend on the sequence length (not the ``dynamic`` or ``longrope`` types, whose update reads
    the length back to the host and so cannot be captured in a CUDA graph)."""
    if type(model).__name__ not in LEAN_ARCHITECTURES or model.training:
        return False
    config = model.config
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "use_sliding_window", False):
        return False
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or ())):
        return False
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    rope_type = getattr(getattr(model.model, "rotary_emb", None), "rope_type", "default")
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
        return False
    for layer in layers:
        mlp = layer.mlp
        if any(getattr(mlp, name, None) is None for name in ("gate_proj", "up_proj", "down_proj")):
            return False
        if any(getattr(mlp, name).bias is not None for name in ("gate_proj", "up_proj", "down_proj")):
            return False
    return True


class TransformersStepper:
    """Steps through the model's own forward with its (preallocated) transformers cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: Any,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        capacity: int,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.cache_argument = cache_argument(model)
        self.cache = preallocate(cache, capacity)  # written in place, not concatenated
        self.attention_mask, self.position_ids = attention_mask, position_ids
        self.compute_dtype = compute_dtype

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.reorder_cache(rows)
        self.attention_mask, self.position_ids = self.attention_mask[rows], self.position_ids[rows]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [B] (one per row); return the next-token logits [B, V] (float32)."""
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones((len(tokens), 1))], dim=1)
        self.position_ids = self.position_ids + 1
        with mixed_precision(self.model, self.compute_dtype):
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=self.attention_mask,
                position_ids=self.position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_argument: self.cache},
            )
        self.cache = output_cache(out)
        return out.logits[:, -1].float()


class LeanStepper:
    """Decodes a Llama/Qwen2 model (see the module docstring) from a prefilled transformers cache,
    or from its own prefill (:meth:`prefill`).

    ``cache`` holds the prompt's keys/values per layer ``[B, kv_heads, L, head_dim]`` (already one
    row per sample), ``attention_mask`` [B, L] marks real prompt tokens, ``position_ids`` [B, 1] the
    last prompt token's position; ``capacity`` bounds ``L`` plus the tokens to generate.

    Every buffer (keys, values, attention mask, positions, the next write slot ``pos``) is allocated
    once and updated in place, so a step reads nothing back to the host. With ``static`` each step
    attends over all ``capacity`` positions (the unwritten ones masked out; the buffers start zeroed)
    and so has the same shapes every step: it can be captured in a CUDA graph and replayed, and
    :meth:`load` refills the buffers for the next batch of the same shape. Otherwise it attends
    over the positions written so far (less work on a CPU; rows can be dropped with :meth:`keep`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: Any,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        capacity: int,
        compute_dtype: torch.dtype | None = None,
        *,
        static: bool = False,
        weights: StepperWeights | None = None,
    ) -> None:
        self._use(model, compute_dtype, static=static, weights=weights)
        self._allocate(position_ids, attention_mask.shape[1], capacity)
        self.load(cache, attention_mask, position_ids)

    @classmethod
    def prefill(
        cls,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        rows: torch.Tensor,
        capacity: int,
        compute_dtype: torch.dtype | None = None,
    ) -> tuple[LeanStepper, torch.Tensor]:
        """Run the left-padded prompts (``input_ids``, ``attention_mask``, ``position_ids``, each
        ``[P, L]``, as :func:`core_rl_hf.generation.left_pad` makes them) through the model's
        layers as the steps compute them, with a causal mask over each prompt's real tokens (a
        padding position attends to itself alone: no query has an empty mask row, for which some
        attention kernels give NaN; prompts without padding need no mask), instead of the model's
        forward: the same logits up to float rounding, without building a transformers cache and
        copying it over. Returns a (non-static) stepper with one row per entry of
        ``rows`` (the prompt each sample continues), its buffers holding that prompt's keys and
        values, and the next-token logits of each prompt ``[P, V]`` (float32)."""
        stepper = cls.__new__(cls)
        stepper._use(model, compute_dtype, static=False, weights=None)
        length = input_ids.shape[1]
        last = position_ids[rows, -1:]
        stepper._allocate(last, length, capacity)
        stepper._hold_prompt(attention_mask[rows], last)
        real = attention_mask.bool()
        allowed = None  # no padding: plain causal attention, without a mask in memory
        if not bool(real.all()):
            causal = torch.ones((length, length), dtype=torch.bool, device=real.device).tril()
            itself = torch.eye(length, dtype=torch.bool, device=real.device)
            allowed = ((causal & real[:, None, :]) | itself)[:, None]  # [P, 1, L (queries), L (keys)]
        prompts = len(input_ids)
        group = model.config.num_attention_heads // stepper.kv_heads

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            stepper.keys[i][:, :, :length] = k[rows]
            stepper.values[i][:, :, :length] = v[rows]
            out = F.scaled_dot_product_attention(
                q,
                k.repeat_interleave(group, dim=1),
                v.to(q.dtype).repeat_interleave(group, dim=1),
                attn_mask=allowed,
                is_causal=allowed is None,
                scale=stepper.scaling,
            )
            return out.transpose(1, 2).reshape(prompts, length, -1)

        hidden = model.model.embed_tokens(input_ids)  # [P, L, H]
        cos, sin = (table[position_ids] for table in stepper.rotary)  # the prompts' positions are below length
        hidden = stepper._layers(hidden, cos, sin, attend)[:, -1:]
        return stepper, stepper._logits(hidden)

    def _use(
        self, model: torch.nn.Module, compute_dtype: torch.dtype | None, *, static: bool, weights: StepperWeights | None
    ) -> None:
        """Take ``model``'s layers and projection weights (in the compute dtype) for the steps."""
        self.model = model
        self.state_dtype = model.lm_head.weight.dtype  # residual stream, norms, rotary
        self.dtype = compute_dtype or self.state_dtype  # the projections
        shared = weights if weights is not None else StepperWeights.of(model, self.dtype)
        if shared.dtype != self.dtype:
            raise ValueError(f"weights in {shared.dtype} given to a stepper computing in {self.dtype}")
        self.shared = shared
        self.weights, self.head_weight = shared.layers, shared.head
        float32_attention = getattr(model.config, "_attn_implementation", None) == attention.NAME
        self.attention_dtype = self.state_dtype if float32_attention else self.dtype  # keys/values too
        # the model's own rotary embedding (Llama's and Qwen2's modules each define it)
        self.apply_rope = sys.modules[type(model).__module__].apply_rotary_pos_emb
        self.layers = list(model.model.layers)
        first = self.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.kv_heads = model.config.num_key_value_heads
        self.static = static

    def _allocate(self, position_ids: torch.Tensor, length: int, capacity: int) -> None:
        """Key/value buffers (zeroed when static) for ``len(position_ids)`` rows of at least
        ``length + 1`` positions, their mask, and the rotary table over those positions."""
        rows = len(position_ids)
        self.capacity = max(capacity, length + 1)
        shape = (rows, self.kv_heads, self.capacity, self.head_dim)
        # a static step attends over every position, the unwritten ones masked out (finite: zeroed);
        # otherwise a step reads only positions written before it (zeroing 8 MiB a layer cost ~4%
        # of the medium CPU benchmark's generation)
        make = torch.zeros if self.static else torch.empty
        device = position_ids.device
        self.keys = [make(shape, dtype=self.attention_dtype, device=device) for _ in self.layers]
        self.values = [make(shape, dtype=self.dtype, device=device) for _ in self.layers]  # exact: v_proj's outputs
        self.mask = torch.zeros((rows, self.capacity), dtype=torch.bool, device=device)
        # the rotary embedding of every position a step can reach (a row's position never passes
        # its slot, so at most capacity - 1), from the model's own module: the prefill and each
        # step gather their positions' entries instead of evaluating cos and sin, which a
        # compiled step would otherwise evaluate again inside attention's loop over the positions
        positions = torch.arange(self.capacity, device=device)[None]
        cos, sin = self.model.model.rotary_emb(torch.empty(0, dtype=self.state_dtype, device=device), positions)
        self.rotary = (cos[0], sin[0])  # [capacity, head_dim] each
        self.position_ids = position_ids.clone()
        self.pos = position_ids.new_zeros(1)  # the buffer slot the next step writes
        self.length = 0  # the same on the host (the attended span when not static)

    def load(self, cache: Any, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Refill the buffers in place from a prefill of the same number of rows (at most
        ``capacity - 1`` prompt positions)."""
        length = attention_mask.shape[1]
        for i in range(len(self.layers)):
            keys, values = _layer_states(cache, i)
            self.keys[i][:, :, :length] = keys
            self.values[i][:, :, :length] = values
        self._hold_prompt(attention_mask, position_ids)

    def _hold_prompt(self, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> None:
        """After the prompts' keys and values are in the buffers: the mask over their real tokens
        (``attention_mask`` [B, L]), each row's last position (``position_ids`` [B, 1]), and the
        next write slot ``L``."""
        length = attention_mask.shape[1]
        self.mask.zero_()
        self.mask[:, :length] = attention_mask.bool()
        self.position_ids.copy_(position_ids)
        self.pos.fill_(length)
        self.length = length

    def refresh_weights(self) -> None:
        """Copy the model's current weights into the projection copies this stepper uses
        (:meth:`StepperWeights.refresh`)."""
        self.shared.refresh(self.model)

    def keep(self, rows: torch.Tensor) -> None:
        if self.static:
            raise RuntimeError("a static LeanStepper keeps its rows (its shapes are fixed)")
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.mask, self.position_ids = self.mask[rows], self.position_ids[rows]

    def _write(self, buffer: torch.Tensor, states: torch.Tensor) -> None:
        """Write one step's ``states`` [B, kv_heads, 1, head_dim] at slot ``pos`` of ``buffer``: by
        the device-side index when static (a graph replays it), else at the host's ``length``
        (the same slot; a plain slice copy is several times cheaper on a CPU)."""
        if self.static:
            buffer.index_copy_(2, self.pos, states)
        else:
            buffer[:, :, self.length : self.length + 1] = states

    def _layers(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The decoder layers over ``hidden`` [B, T, H] (module docstring), ``attend(layer, q, k,
        v)`` (``[B, heads, T, head_dim]``: ``q`` and ``k`` rotated, in the attention dtype, ``v`` in
        the projections') giving each layer's attention output ``[B, T, heads * head_dim]``; the
        last hidden states, not yet normed."""
        batch, length, dtype = hidden.shape[0], hidden.shape[1], self.dtype
        for i, (layer, w) in enumerate(zip(self.layers, self.weights)):
            normed = _rms_norm(layer.input_layernorm, hidden).to(dtype)
            q, k, v = w.qkv(normed)
            q = q.view(batch, length, -1, self.head_dim).transpose(1, 2)
            k = k.view(batch, length, -1, self.head_dim).transpose(1, 2)
            v = v.view(batch, length, -1, self.head_dim).transpose(1, 2)
            q, k = self.apply_rope(q, k, cos, sin)
            q, k = q.to(self.attention_dtype), k.to(self.attention_dtype)
            (attended,) = w.o(attend(i, q, k, v).to(dtype))
            hidden = hidden + attended
            normed = _rms_norm(layer.post_attention_layernorm, hidden).to(dtype)
            gate, up = w.gate_up(normed)
            (mlp_out,) = w.down(F.silu(gate) * up)
            hidden = hidden + mlp_out
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The next-token logits [B, V] (float32) of the last position of ``hidden`` [B, 1, H]."""
        hidden = _rms_norm(self.model.model.norm, hidden).to(self.dtype)
        return F.linear(hidden, self.head_weight)[:, -1].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [B] (one per row); return the next-token logits [B, V] (float32)."""
        model = self.model
        self.position_ids.add_(1)
        self.mask.index_fill_(1, self.pos, True)
        span = self.capacity if self.static else self.length + 1
        # grouped-query attention as plain attention: the query heads sharing a key/value head
        # become that head's query rows; one mask row [B, 1, 1, span] serves them all
        mask = self.mask[:, None, None, :span]
        hidden = model.model.embed_tokens(tokens[:, None])  # [B, 1, H]
        cos, sin = (table[self.position_ids] for table in self.rotary)  # [B, 1, head_dim]
        batch = hidden.shape[0]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self._write(self.keys[i], k)
            self._write(self.values[i], v)
            out = _one_query_attention(
                q.reshape(batch, self.kv_heads, -1, self.head_dim),
                self.keys[i][:, :, :span],
                self.values[i][:, :, :span],
                mask,
                self.scaling,
            )
            return out.reshape(batch, 1, -1)

        hidden = self._layers(hidden, cos, sin, attend)
        self.pos.add_(1)
        self.length += 1
        return self._logits(hidden)


def _one_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one query position per row over ``span`` cached positions: ``q`` [B, kv_heads,
    group, head_dim] (the query heads sharing a key/value head as its rows), ``k`` and ``v`` [B,
    kv_heads, span, head_dim] (``v`` possibly narrower, widened to ``q``'s dtype as it is read),
    ``mask`` [B, 1, 1, span] (true: attend); ``softmax(scale * q k^T, masked) v``.

    Compiled (:func:`compiled_advance`) in float32 on a CPU (``sdpa_float32``, what the engines
    load there), as two matrix products around a masked softmax: SDPA's flash kernel spends most
    of a decoding step on its fixed cost per row and head, and inductor fuses the scaling, masking
    and softmax with the products' reductions (the medium CPU benchmark's decode 0.27-0.28 -> 0.24
    s, ``docs/benchmarks.md``). Otherwise :func:`torch.nn.functional.scaled_dot_product_attention`:
    an eager step keeps the kernel the training forward's SDPA runs, so its bf16 behaviour
    log-probs stay bit-equal to the bf16 training forward's (``tests/test_mixed_precision_rollout.py``;
    a compiled step differs from it by float rounding anyway, its fused norms and casts included)."""
    if q.device.type == "cpu" and q.dtype == torch.float32 and torch.compiler.is_compiling():
        return _attention_products(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v.to(q.dtype), attn_mask=mask, scale=scale)


def _attention_products(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``softmax(scale * q k^T, masked) v`` (shapes as :func:`_one_query_attention`'s) as two
    matrix products around a masked softmax, ``v`` widened to ``q``'s dtype."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(-1), v.to(q.dtype))


@attrs.frozen
class _Projections:
    """Linear maps of one input, with outputs of ``sizes`` features: one matrix product on their
    concatenated weights (``weights`` and ``biases`` hold one tensor each), or one product each."""

    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    sizes: tuple[int, ...]

    def refresh(self, modules: list[torch.nn.Linear]) -> None:
        """Copy ``modules``' current weights (and biases) into a fused copy made by
        :func:`_projections`, in place; nothing when these are the modules' own parameters."""
        if len(self.weights) > 1 or self.weights[0].data_ptr() == modules[0].weight.data_ptr():
            return
        start = 0
        for module, size in zip(modules, self.sizes):
            self.weights[0][start : start + size].copy_(module.weight.detach())
            if self.biases[0] is not None and module.bias is not None:
                self.biases[0][start : start + size].copy_(module.bias.detach())
            start += size

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self.weights) == 1:
            return F.linear(x, self.weights[0], self.biases[0]).split(self.sizes, dim=-1)
        return tuple(F.linear(x, w, b) for w, b in zip(self.weights, self.biases))


def _projections(modules: list[torch.nn.Linear], dtype: torch.dtype) -> _Projections:
    """``modules`` in ``dtype``: fused into one matrix when that needs a copy anyway (``dtype`` is not
    the weights' own), else the modules' own parameters (no copy of the weights)."""
    sizes = tuple(m.out_features for m in modules)
    weights = [m.weight.detach() for m in modules]
    biases = [None if m.bias is None else m.bias.detach() for m in modules]
    if weights[0].dtype == dtype:
        return _Projections(tuple(weights), tuple(biases), sizes)
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else w.new_zeros(len(w)) for w, b in zip(weights, biases)]).to(dtype)
    return _Projections((torch.cat(weights).to(dtype),), (bias,), sizes)


@attrs.frozen
class _LayerWeights:
    """One decoder layer's projections in the stepper's compute dtype."""

    qkv: _Projections
    o: _Projections
    gate_up: _Projections
    down: _Projections


@attrs.frozen
class StepperWeights:
    """A Llama/Qwen2 model's projections and head in a :class:`LeanStepper`'s compute ``dtype``:
    copies where that is not the weights' own dtype (fused per :class:`_LayerWeights` group), the
    model's own parameters otherwise. Steppers of one model and dtype can share one (the CUDA
    graphs an engine keeps: one copy of the weights, not one per graph)."""

    dtype: torch.dtype
    layers: list[_LayerWeights]
    head: torch.Tensor

    @classmethod
    def of(cls, model: torch.nn.Module, dtype: torch.dtype) -> StepperWeights:
        layers = [_layer_weights(layer, dtype) for layer in model.model.layers]
        return cls(dtype, layers, model.lm_head.weight.detach().to(dtype))

    def refresh(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s current weights into the copies, in place and casting as they go (no
        second copy of the weights); nothing for the model's own parameters."""
        head = model.lm_head.weight
        if self.head.data_ptr() != head.data_ptr():
            self.head.copy_(head.detach())
        for layer, weights in zip(model.model.layers, self.layers):
            for name, modules in _layer_linears(layer).items():
                getattr(weights, name).refresh(modules)


def _layer_linears(layer: torch.nn.Module) -> dict[str, list[torch.nn.Linear]]:
    """A Llama/Qwen2 decoder layer's linear maps, grouped as :class:`_LayerWeights` fuses them."""
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "qkv": [attn.q_proj, attn.k_proj, attn.v_proj],
        "o": [attn.o_proj],
        "gate_up": [mlp.gate_proj, mlp.up_proj],
        "down": [mlp.down_proj],
    }


def _layer_weights(layer: torch.nn.Module, dtype: torch.dtype) -> _LayerWeights:
    """A Llama/Qwen2 decoder layer's projections as :func:`_projections` gives them."""
    return _LayerWeights(**{name: _projections(modules, dtype) for name, modules in _layer_linears(layer).items()})


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for a Llama/Qwen2 RMSNorm: ``w * x / sqrt(mean(x^2) + eps)``; in float32 as one
    fused kernel (bit-equal to the module's float32 arithmetic), otherwise through the module
    (which normalises in float32 and rounds before scaling)."""
    if x.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _layer_states(cache: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``index``'s keys and values from a transformers cache (per-layer objects or the
    older indexable form)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[index].keys, layers[index].values
    return cache[index][0], cache[index][1]


#: the source name under which dynamo sees :attr:`LeanStepper.length` in the compiled step, marked
#: dynamic from the first compilation (a name this torch does not use only costs one recompilation)
_LENGTH_SOURCE = "L['stepper'].length"


def advance(stepper: LeanStepper, state: DecodeState, uniform: torch.Tensor | None) -> None:
    """One decoding step and the choice after it: ``state.choose(stepper.step(state.feed),
    uniform)`` (``uniform``: the choice's draws, :meth:`DecodeState.draw`)."""
    state.choose(stepper.step(state.feed), uniform)


@functools.cache
def compiled_advance() -> Callable[[LeanStepper, DecodeState, torch.Tensor | None], None]:
    """:func:`advance` compiled by ``torch.compile`` (inductor), once per process:
    ``compiled_advance()(stepper, state, state.draw())`` does what ``advance`` does, the
    element-wise work of each layer and of the token choice fused into a few kernels (the draws
    are made before it, from the state's generator: compiled code takes none, and the stream is
    the eager step's). Only what changes between steps and batches is symbolic: the rows, the
    buffers' capacity, the positions cached and the tokens a batch may generate (so batches of
    other sizes, rows dropped and longer prompts reuse the compiled code); the model's sizes and
    the sampling settings are constants, so each call checks far fewer guards than with every size
    symbolic (``dynamic=True``: ~690 Python guards, ~0.25 ms a call on the medium CPU benchmark,
    and more work computing the symbolic sizes before each call) and the kernels are specialised
    to them. A model of other sizes, dtypes or layer count, or other sampling settings, compiles
    again (up to dynamo's recompile limit, then the steps run eagerly). The first call pays the
    compilation; the logits differ from the eager step's by float rounding. The compiled code
    does not assert its inputs' sizes and strides on each call (inductor's ``size_asserts``):
    dynamo's guards have checked them before it runs, and the asserts were ~40 checks a step."""
    compiled = torch.compile(advance, options={"size_asserts": False})

    def step(stepper: LeanStepper, state: DecodeState, uniform: torch.Tensor | None) -> None:
        _mark_dynamic(stepper.position_ids, 0)
        _mark_dynamic(stepper.mask, 0, 1)
        for buffer in (*stepper.keys, *stepper.values):
            _mark_dynamic(buffer, 0, 2)
        for table in stepper.rotary:
            _mark_dynamic(table, 0)
        for rows in (state.tokens, state.logprobs):
            _mark_dynamic(rows, 0, 1)
        for rows in (state.lengths, state.stopped, state.done, state.feed, state.seen, state.counts, uniform):
            if rows is not None:
                _mark_dynamic(rows, 0)
        # no "duck sizing": sizes equal by chance (rows and positions) must not be assumed equal,
        # or the next batch compiles again. Set and restored directly: ``patch()`` costs several
        # times more, on every step (~40 us of a small model's ~0.5 ms step)
        duck, sources = fx_config.use_duck_shape, compiler_config.dynamic_sources
        fx_config.use_duck_shape, compiler_config.dynamic_sources = False, _LENGTH_SOURCE
        try:
            compiled(stepper, state, uniform)
        finally:
            fx_config.use_duck_shape, compiler_config.dynamic_sources = duck, sources

    return step


def _mark_dynamic(tensor: torch.Tensor, *dims: int) -> None:
    """Compile ``tensor``'s ``dims`` as symbolic sizes (unless dynamo must specialise one: a size
    of 0 or 1). A tensor already marked (one the steps keep from call to call) is left alone:
    dynamo records the marks on the tensor, and marking again only costs the call."""
    marked = getattr(tensor, "_dynamo_weak_dynamic_indices", ())
    for dim in dims:
        if dim not in marked:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def make_stepper(
    model: torch.nn.Module,
    cache: Any,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    capacity: int,
    *,
    lean: bool,
    compute_dtype: torch.dtype | None = None,
) -> TransformersStepper | LeanStepper:
    """:class:`LeanStepper` when ``lean`` and :func:`lean_supported`, else :class:`TransformersStepper`."""
    kind = LeanStepper if lean and lean_supported(model) else TransformersStepper
    return kind(model, cache, attention_mask, position_ids, capacity, compute_dtype)


def mixed_precision(model: torch.nn.Module, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` in ``dtype`` on the model's device when ``dtype`` is set and differs from
    the weights' dtype; otherwise nothing."""
    weight = next(model.parameters())
    if dtype is None or dtype == weight.dtype:
        return contextlib.nullcontext()
    return torch.autocast(weight.device.type, dtype=dtype)
