"""The data protocol: what travels between rollout, rewards, advantage estimators, losses and engines.

Token ids travel, never text. Training tensors are padded ``[B, T]`` (right padding) with these keys
(the *global batch* of one step; the engine splits it into micro-batches by rows):

==================  ==========  =====================================================================
key                 shape       meaning
==================  ==========  =====================================================================
``input_ids``       [B, T] long prompt followed by response, then ``pad_token_id``
``attention_mask``  [B, T] long 1 on real tokens (prompt and response), 0 on padding
``response_mask``   [B, T] f32  1 on response tokens (those the policy generated), else 0
``old_logprobs``    [B, T] f32  log-prob of token ``t`` given tokens ``< t`` under pi_old, the policy the
                                clipped ratio is taken against, 0 off-response: the behaviour log-probs,
                                or the train engine's own, recomputed before the step's first update
                                (``algorithm.recompute_logprob``, or a loss's ``requires_recompute``:
                                the proximal policy of the decoupled loss)
``behave_logprobs`` [B, T] f32  behaviour log-prob: what the rollout engine reported when it sampled
                                the token (never overwritten), 0 off-response
``versions``        [B, T] long weight version that generated each response token, -1 off-response
``ref_logprobs``    [B, T] f32  the same under the reference model (only when a loss asks for it)
``advantages``      [B, T] f32  per-token advantage (0 off-response)
``loss_mask``       [B, T] f32  1 on the response tokens that train: ``response_mask`` without the
                                samples or tokens the algorithm excludes (e.g. truncated samples under
                                ``mask_no_eos_with_zero``, M2PO); aggregation weights come from it
``loss_weight``     [B, T] f32  aggregation weight of each token's loss (:func:`core_rl.ops.aggregation_weights`)
``rewards``         [B]    f32  scalar reward of each sample (after ``algorithm.reward_shaping``)
``turn_rewards``    [B, T] f32  each turn's reward at its last token (only when a sample has
                                ``Sample.turn_ends``; 0 elsewhere and in samples without them)
``group_index``     [B]    long index of the prompt the sample answers (samples of a prompt form a group)
``truncated``       [B]    bool the response stopped at the token budget (``finish_reason == "length"``)
``train_version``   [B]    long the weight version the current update produces (the same in every row)
``routed_experts``  [B,T,L,K]   the experts the rollout routed token ``t`` to in each of the ``L``
                    int16       mixture-of-experts layers (its top-``K``), -1 where it has none (such a
                                token is routed by the training forward itself); only when a sample
                                has :attr:`Sample.routed_experts` (routing replay, :mod:`core_rl_train_kit.moe`)
``pixel_values``    [B, P, D]   a vision-language model's pixel inputs, row by row, and their image
``image_grid_thw``  [B, I, 3]   grids (only when a sample has :attr:`Sample.media`; right-padded with
                                zeros: :mod:`core_rl.vision.media`)
==================  ==========  =====================================================================

A loss's ``prepare`` may add keys of its own that travel with the rows into every micro-batch, e.g.
``cov_selected`` [B, T] (``ppo_clip``'s ``loss_mode: clip_cov | kl_cov``: the tokens chosen once per
step by covariance, ``core_rl_grpo.covariance``).

The trainer adds ``loss_mask``, ``advantages``, ``loss_weight`` and ``train_version``; the rest comes
from :func:`samples_to_batch` (and the rewards and engines).

The convention "value at position ``t`` describes token ``t``" holds for every ``[B, T]`` tensor, so a
log-prob tensor lines up with ``input_ids`` and ``response_mask`` without shifting.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch


@attrs.define
class Sample:
    """One generated response.

    ``logprobs[i]`` is the behaviour log-prob of ``response_ids[i]`` (at the sampling temperature);
    ``weight_version`` is the version of the weights that generated it (the oldest one when
    generation spanned a weight update); ``finish_reason`` is ``"stop"`` (a stop token or EOS was
    generated, or the text completed a stop string; that token is the last of ``response_ids``) or
    ``"length"`` (``max_new_tokens`` reached).

    ``token_weight_versions`` (optional): the weight version that generated each response token,
    where the engine knows it (a request interrupted by a weight update and continued after it
    changes version at the interruption point); ``None`` means every token has ``weight_version``.

    ``token_mask`` (optional): 1 on the response tokens the policy generated, 0 on tokens a
    multi-turn workflow appended from elsewhere (tool output, an environment's reply): those have
    log-prob 0, are left out of ``response_mask`` (so they never train) and carry version -1 in a
    batch. ``None`` means every response token was generated.

    ``reward`` (optional): the trajectory's reward as its rollout workflow assigned it (an
    environment's outcome, a game's score); the built-in ``workflow`` reward hands it to the trainer,
    alone or as a part of ``combine``. ``info``: what the workflow records about the trajectory (turns,
    tool calls, an environment's state), JSON-like; rewards see it as :attr:`RewardInput.info`.

    ``turn_rewards`` (optional): the reward of each model turn of a multi-turn trajectory, in order,
    as its workflow recorded them; the workflow reduces them into ``reward`` (the built-in
    ``environment`` workflow: their sum or the last one), which is what the trainer trains on.

    ``routed_experts`` (optional, a mixture-of-experts model's rollout): an int16 tensor
    ``[len(prompt_ids) + len(response_ids), L, K]``, row ``t`` the top-``K`` experts each of the
    ``L`` MoE layers chose for input token ``t`` of prompt + response (the prompt's rows from the
    prefill, the response's from the decoding steps), -1 on a row without a route: the last
    response token (never fed to the model), and tokens a multi-turn workflow inserted without
    running the model over them. The training forward replays these routes where routing replay
    is on; a row of -1 is routed by the training forward's own router (the documented rule for
    inserted tokens).

    ``turn_ends`` (optional, with ``turn_rewards``): where each rewarded turn ends, as an exclusive
    end position in ``response_ids``, never decreasing. Set, it asks the estimators that work per token
    (GAE, REINFORCE++) to pay each turn's reward at that turn's last token instead of paying
    ``reward`` at the end (:func:`core_rl.ops.token_level_rewards`); outcome estimators (GRPO,
    RLOO) still see only the trajectory's reward.

    ``media`` (optional): the pixel inputs of the images in ``prompt_ids`` (``pixel_values`` ``[P, D]``
    and ``image_grid_thw`` ``[I, 3]``, :mod:`core_rl.vision.prompts`), which the rollout engine
    generated with and the train engine computes log-probs with. ``None``: a text-only prompt.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str
    token_weight_versions: list[int] | None = None
    token_mask: list[int] | None = None
    reward: float | None = None
    info: dict[str, Any] = attrs.field(factory=dict)
    turn_rewards: list[float] | None = None
    turn_ends: list[int] | None = None
    routed_experts: torch.Tensor | None = None
    media: dict[str, Any] | None = None

    def __attrs_post_init__(self) -> None:
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(f"Sample has {len(self.response_ids)} response tokens but {len(self.logprobs)} logprobs")
        if self.token_weight_versions is not None and len(self.token_weight_versions) != len(self.response_ids):
            raise ValueError(
                f"Sample has {len(self.response_ids)} response tokens but "
                f"{len(self.token_weight_versions)} token weight versions"
            )
        if self.token_mask is not None and len(self.token_mask) != len(self.response_ids):
            raise ValueError(
                f"Sample has {len(self.response_ids)} response tokens but {len(self.token_mask)} mask values"
            )
        if self.turn_ends is not None:
            check_turn_ends(self.turn_ends, self.turn_rewards, len(self.response_ids))
        if self.routed_experts is not None:
            tokens = len(self.prompt_ids) + len(self.response_ids)
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != tokens:
                raise ValueError(
                    f"Sample has {tokens} prompt and response tokens but routed_experts of shape "
                    f"{tuple(self.routed_experts.shape)}; expected [{tokens}, layers, top_k]"
                )

    @property
    def versions(self) -> list[int]:
        """The weight version of each response token."""
        if self.token_weight_versions is not None:
            return list(self.token_weight_versions)
        return [self.weight_version] * len(self.response_ids)

    @property
    def newest_version(self) -> int:
        """The newest weight version that generated a token of this sample."""
        return max(self.versions, default=self.weight_version)


def check_turn_ends(ends: Sequence[int], rewards: Sequence[float] | None, n_response: int) -> None:
    """Raise ``ValueError`` unless ``ends`` pairs one to one with ``rewards`` and never decreases
    within ``(0, n_response]`` (a turn that sampled nothing ends where the previous one did)."""
    if rewards is None or len(rewards) != len(ends):
        have = "no turn_rewards" if rewards is None else f"{len(rewards)} turn_rewards"
        raise ValueError(f"Sample has {len(ends)} turn_ends but {have}; give one end per turn reward")
    previous = 1
    for end in ends:
        if not previous <= end <= n_response:
            raise ValueError(
                f"Sample turn_ends {list(ends)} must not decrease, within [1, {n_response}] "
                "(exclusive ends in response_ids)"
            )
        previous = end


@attrs.define
class RewardInput:
    """What a reward sees of one sample: texts, token ids, the dataset row it answers, and what the
    rollout workflow attached to it (``workflow_reward`` and ``info``: :attr:`Sample.reward` and
    :attr:`Sample.info`)."""

    prompt_text: str
    response_text: str
    prompt_ids: list[int]
    response_ids: list[int]
    row: Mapping[str, Any]
    finish_reason: str
    workflow_reward: float | None = None
    info: Mapping[str, Any] = attrs.field(factory=dict)


class TensorBatch:
    """A dict of tensors sharing their first (batch) dimension, with the row operations engines need."""

    def __init__(self, data: Mapping[str, torch.Tensor]) -> None:
        self.data: dict[str, torch.Tensor] = dict(data)
        sizes = {k: v.shape[0] for k, v in self.data.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"TensorBatch tensors disagree on batch size: {sizes}")

    @property
    def batch_size(self) -> int:
        return next(iter(self.data.values())).shape[0] if self.data else 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.data[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if self.data and value.shape[0] != self.batch_size:
            raise ValueError(f"{key!r} has batch size {value.shape[0]}, batch has {self.batch_size}")
        self.data[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def get(self, key: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.data.get(key, default)

    def keys(self) -> Iterator[str]:
        return iter(self.data)

    def rows(self, index: torch.Tensor | Sequence[int] | slice) -> TensorBatch:
        """The batch restricted to the given rows (a slice, a list of indices or a bool/long tensor)."""
        import torch

        if not isinstance(index, slice) and not isinstance(index, torch.Tensor):
            index = torch.as_tensor(list(index), dtype=torch.long)
        return TensorBatch({k: v[index] for k, v in self.data.items()})

    def to(self, device: torch.device | str) -> TensorBatch:
        return TensorBatch({k: v.to(device) for k, v in self.data.items()})

    @staticmethod
    def concat(batches: Sequence[TensorBatch]) -> TensorBatch:
        import torch

        keys = list(batches[0].data)
        return TensorBatch({k: torch.cat([b[k] for b in batches]) for k in keys})


def samples_to_batch(samples: Sequence[Sample], group_index: Sequence[int], pad_token_id: int) -> TensorBatch:
    """Pack samples into a right-padded :class:`TensorBatch` with ``input_ids``, ``attention_mask``,
    ``response_mask``, ``old_logprobs`` and ``behave_logprobs`` (both the samples' log-probs),
    ``versions`` (a sample's per-token ``token_weight_versions`` where it has them, else its
    ``weight_version`` on every token; a sample's ``token_mask`` zeroes ``response_mask`` and the
    log-probs and sets version -1 on the tokens it excludes), ``truncated`` and ``group_index``,
    ``turn_rewards`` when a sample has ``turn_ends``, ``pixel_values``/``image_grid_thw`` when a
    sample has ``media``, and ``routed_experts`` (int16 ``[B, T, L, K]``, -1 where a sample has no
    route) when one has :attr:`Sample.routed_experts` (see the module docstring; samples with routes
    must agree on ``L`` and ``K``)."""
    import torch

    from core_rl.vision.media import pad_media

    if not samples:
        raise ValueError("cannot build a batch from no samples")
    # every sample's tokens, log-probs and versions go into one flat list per field, which becomes a
    # tensor at once (through a typed buffer: torch.tensor reads a list element by element, several
    # times slower) and is scattered into place; a tensor per sample and field, and its slice
    # assignment, cost ~0.1 ms a sample
    ids: list[int] = []
    logprobs: list[float] = []
    versions_flat: list[int] = []
    prompt_lengths = [len(s.prompt_ids) for s in samples]
    response_lengths = [len(s.response_ids) for s in samples]
    masked = any(getattr(s, "token_mask", None) is not None for s in samples)
    per_turn = any(getattr(s, "turn_ends", None) is not None for s in samples)
    inside: list[float] = []  # 1 on a response token that trains, 0 on one a token_mask excludes
    turn_where: tuple[list[int], list[int]] = ([], [])
    turn_values: list[float] = []
    for i, s in enumerate(samples):
        p, r = prompt_lengths[i], response_lengths[i]
        ids.extend(s.prompt_ids)
        ids.extend(s.response_ids)
        per_token = getattr(s, "token_weight_versions", None)  # optional per-token versions
        own_versions = per_token if per_token is not None else [s.weight_version] * r
        token_mask = getattr(s, "token_mask", None)  # optional: tool output appended by a workflow
        if token_mask is None:
            logprobs.extend(s.logprobs)
            versions_flat.extend(own_versions)
            if masked:
                inside.extend([1.0] * r)
        else:
            keep = [bool(k) for k in token_mask]
            logprobs.extend([x if k else 0.0 for x, k in zip(s.logprobs, keep)])
            versions_flat.extend([v if k else -1 for v, k in zip(own_versions, keep)])
            inside.extend([1.0 if k else 0.0 for k in keep])
        ends = getattr(s, "turn_ends", None)
        if ends is not None:
            turn_where[0].extend([i] * len(ends))
            turn_where[1].extend(p + end - 1 for end in ends)
            turn_values.extend(s.turn_rewards)
    lengths = torch.tensor([p + r for p, r in zip(prompt_lengths, response_lengths)])
    width = int(lengths.max())
    n = len(samples)
    rows = torch.arange(n)
    # (row, column) of every token, then of every response token, in the flat buffers' order
    token_rows = rows.repeat_interleave(lengths)
    token_cols = torch.arange(len(ids)) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
    response = torch.tensor(response_lengths)
    response_rows = rows.repeat_interleave(response)
    response_cols = torch.arange(len(logprobs)) - (response.cumsum(0) - response).repeat_interleave(response)
    response_cols += torch.tensor(prompt_lengths).repeat_interleave(response)

    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    input_ids[token_rows, token_cols] = _flat_tensor(ids, "q", torch.long)
    attention_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    response_mask = torch.zeros((n, width), dtype=torch.float32)
    response_mask[response_rows, response_cols] = _flat_tensor(inside, "f", torch.float32) if masked else 1.0
    old_logprobs = torch.zeros((n, width), dtype=torch.float32)
    old_logprobs[response_rows, response_cols] = _flat_tensor(logprobs, "f", torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.long)
    versions[response_rows, response_cols] = _flat_tensor(versions_flat, "q", torch.long)
    turn_rewards = None
    if per_turn:
        turn_rewards = torch.zeros((n, width), dtype=torch.float32)
        where = (torch.tensor(turn_where[0], dtype=torch.long), torch.tensor(turn_where[1], dtype=torch.long))
        turn_rewards.index_put_(where, torch.tensor(turn_values, dtype=torch.float32), accumulate=True)
    extra = {"turn_rewards": turn_rewards} if turn_rewards is not None else {}
    extra.update(pad_media([getattr(s, "media", None) for s in samples]))
    routes = _batch_routes(samples, width)
    if routes is not None:
        extra["routed_experts"] = routes
    return TensorBatch(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "old_logprobs": old_logprobs,
            "behave_logprobs": old_logprobs.clone(),
            "versions": versions,
            "truncated": torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.bool),
            "group_index": torch.as_tensor(list(group_index), dtype=torch.long),
            **extra,
        }
    )


def _flat_tensor(values: list, typecode: str, dtype: torch.dtype) -> torch.Tensor:
    """The 1-D tensor of ``values``, read through an :class:`array.array` of ``typecode`` (the C type
    of ``dtype``: ``q`` int64, ``f`` float32)."""
    import torch

    return torch.frombuffer(array(typecode, values), dtype=dtype) if values else torch.empty(0, dtype=dtype)


def _batch_routes(samples: Sequence[Sample], width: int) -> torch.Tensor | None:
    """int16 ``[B, width, L, K]`` of the samples' :attr:`Sample.routed_experts` (-1 elsewhere), or
    ``None`` when no sample has routes; ``ValueError`` when samples disagree on ``(L, K)``."""
    import torch

    shapes = {tuple(s.routed_experts.shape[1:]) for s in samples if getattr(s, "routed_experts", None) is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"samples' routed_experts disagree on [layers, top_k]: {sorted(shapes)}")
    layers, top_k = shapes.pop()
    routes = torch.full((len(samples), width, layers, top_k), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        if getattr(s, "routed_experts", None) is not None:
            routes[i, : s.routed_experts.shape[0]] = s.routed_experts.to(torch.int16)
    return routes


#: the value right padding takes in each padded key (0 for any other key)
PAD_VALUES = {"versions": -1, "routed_experts": -1}


def concat_padded(batches: Sequence[TensorBatch], pad_token_id: int) -> TensorBatch:
    """Concatenate batches whose ``[B, T]`` tensors may differ in width ``T``: each is right-padded
    to the widest (``input_ids`` with ``pad_token_id``, ``versions`` with -1, the rest with 0), and
    pixel inputs to the most patch rows and images (:mod:`core_rl.vision.media`).
    Every batch must hold the same keys."""
    import torch

    from core_rl.vision.media import MEDIA_KEYS

    width = max(b["input_ids"].shape[1] for b in batches)
    pads = {**PAD_VALUES, "input_ids": pad_token_id}
    out: dict[str, torch.Tensor] = {}
    for key in batches[0].keys():
        parts = []
        media_width = max(b[key].shape[1] for b in batches) if key in MEDIA_KEYS else 0
        for b in batches:
            value = b[key]
            if key in MEDIA_KEYS and value.shape[1] < media_width:  # pixel rows or image grids
                fill = value.new_zeros((value.shape[0], media_width - value.shape[1], *value.shape[2:]))
                value = torch.cat([value, fill], dim=1)
            elif value.ndim >= 2 and value.shape[1] == b["input_ids"].shape[1] and value.shape[1] < width:
                fill = value.new_full((value.shape[0], width - value.shape[1], *value.shape[2:]), pads.get(key, 0))
                value = torch.cat([value, fill], dim=1)
            parts.append(value)
        out[key] = torch.cat(parts)
    return TensorBatch(out)
