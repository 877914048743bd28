"""GRPO on the real pretrained model (SmolLM2-135M-Instruct, ``real_model``) with rollout through real
vLLM and SGLang CPU servers, the weights reaching them by ``collective`` and by ``disk``: 2 steps,
and the servers must sample step 2 with the weights step 1 trained.

What shows it: the trainer recomputes the log-probs of the sampled tokens with its current weights
(``algorithm.recompute_logprob``) and reports ``offpolicy/kl_behave_old``, the k3 KL of the
server's behaviour log-probs to them. At step 1 both hold the pretrained weights, so it is the
servers' numerical distance alone; at step 2 it must stay that small, while the same samples'
log-probs under the *pretrained* weights (recomputed here from ``rollout.dump``) are far. The
learning rate is high (1e-4: one Adam step moves every weight by about that much) so that a single
step moves the policy well past the distance allowed.

Measured on this model (2 prompts x 2 samples of 8 tokens; docs/real-models.md):

- ``float32`` servers: 1.2e-11 at step 1 for both, and 2-3e-12 (SGLang) or ~5e-11 (vLLM) after the
  sync, collective and disk. This caught a stale output head in vLLM: on a CPU it packs ``lm_head``
  for oneDNN when the model loads, and an in-place reload of a tied model (whose ``lm_head.weight``
  is the embedding's, not sent) never re-packed it, so the server sampled from the pretrained head
  (3-7.4e-5 after the sync: exactly the samples' distance under the trained weights with the
  pretrained head). The worker re-packs a tied head after every reload now. The bound, 1e-8, is
  float32 rounding with room; the pretrained weights are 0.3-0.6 away.
- ``bfloat16`` servers (the engines' default): 0.9-2e-3 at step 1 (bfloat16 weights and kernels
  against the trainer's float32), 6e-4 to 5e-3 after the sync, 0.09-0.6 from the pretrained
  weights. The bound is 3e-2, and the pretrained weights must be 5x further than the server's
  distance at either step: it catches a server that kept or mangled its weights, not a stale head
  (~5e-5, under the bfloat16 noise).
  SGLang's figures repeat from run to run to the last digit; vLLM's samples after the sync do not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from real_model_helpers import dumped_samples, k3_kl, load_model, response_logprobs, rl_sections, train, write_tasks

for _dist in ("core_rl_fsdp", "core_rl_grpo"):
    pytest.importorskip(_dist)

LR = 1e-4


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return write_tasks(tmp_path_factory.mktemp("real_data"))


@pytest.fixture(scope="module")
def hf(real_model: Path) -> dict[str, Any]:
    return load_model(real_model)


CASES = [
    pytest.param("vllm", "collective", "float32", marks=pytest.mark.server_env("vllm")),
    pytest.param("vllm", "disk", "float32", marks=pytest.mark.server_env("vllm")),
    pytest.param("vllm", "collective", "bfloat16", marks=pytest.mark.server_env("vllm")),
    pytest.param("sglang", "collective", "float32", marks=pytest.mark.server_env("sglang")),
    pytest.param("sglang", "disk", "float32", marks=pytest.mark.server_env("sglang")),
    pytest.param("sglang", "collective", "bfloat16", marks=pytest.mark.server_env("sglang")),
]
#: the most ``offpolicy/kl_behave_old`` a server of each dtype may differ by from the trainer's float32
TOLERANCE = {"float32": 1e-8, "bfloat16": 3e-2}


@pytest.mark.parametrize(("engine", "sync", "dtype"), CASES)
def test_servers_sample_with_the_trained_weights(
    tmp_path: Path, real_model: Path, data: dict, hf: dict, engine: str, sync: str, dtype: str
) -> None:
    import torch

    pytest.importorskip(f"core_rl_{engine}")
    rollout = {"engine": {"name": engine, "dtype": dtype}, "weight_sync": sync, "dump": {"every_n_steps": 1}}
    sections = rl_sections(real_model, data, lr=LR, rollout=rollout, algorithm={"recompute_logprob": True})
    run, (first, second) = train(tmp_path, f"{engine}_{sync}_{dtype}", sections)
    assert first["weight_sync/bytes"] > 0 and first["actor/grad_norm"] > 0
    samples = dumped_samples(run, 2)
    assert {s["weight_version"] for s in samples} == {1}  # sampled after the first update's sync
    behave = torch.cat([torch.tensor(s["logprobs"]) for s in samples])
    model = hf["model"]
    pretrained = torch.cat([response_logprobs(model, s["prompt_ids"], s["response_ids"]) for s in samples])
    to_pretrained = k3_kl(behave, pretrained)
    at_start, after_sync = first["offpolicy/kl_behave_old"], second["offpolicy/kl_behave_old"]
    print(
        f"{engine} {sync} {dtype}: KL(server || trainer) {at_start:.2e} at step 1, {after_sync:.2e} at step 2; "
        f"KL(server || pretrained) {to_pretrained:.2e} at step 2"
    )
    assert at_start < TOLERANCE[dtype], at_start
    # the step moved the policy well past the server's numerical distance, and the server is far
    # nearer the trained weights than the pretrained ones
    assert to_pretrained > 5 * max(at_start, after_sync), (to_pretrained, at_start, after_sync)
    assert after_sync < TOLERANCE[dtype], after_sync
