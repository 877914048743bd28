"""Worker of ``test_partitioned_load.py`` (``torchrun``, CPU, gloo): each rank loads the tiny model's
causal LM and value model with :func:`core_rl_deepspeed.partitioned_load.load_partitioned`, checks what
it holds, and writes its findings to ``OUT/rank<R>.json``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    import deepspeed
    from core_rl.roles import hf
    from core_rl_deepspeed.partitioned_load import load_partitioned
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    plain = hf.load_causal_lm(args.model, dtype="float32")
    rng = torch.get_rng_state()
    found: dict[str, object] = {"rank": dist.get_rank()}
    for head in ("lm", "value"):
        _, load = hf.loaders_for_head(head)
        model = load_partitioned(load, args.model, ds_config, head=head, dtype="float32", attn_implementation=None)
        found[f"{head}/rng_untouched"] = torch.equal(rng, torch.get_rng_state())
        found[f"{head}/zero3_after"] = is_deepspeed_zero3_enabled()
        params = dict(model.named_parameters())
        found[f"{head}/local_elements"] = sum(p.data.numel() for p in params.values())
        found[f"{head}/shard_elements"] = sum(p.ds_tensor.numel() for p in params.values())
        found[f"{head}/full_elements"] = sum(p.ds_numel for p in params.values())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            full = {name: p.detach().clone() for name, p in params.items()}
        if head == "lm":
            want = dict(plain.named_parameters())
            found["lm/differs"] = sorted(k for k in want if not torch.equal(full[k], want[k]))
        else:
            head_names = sorted(k for k in full if not k.startswith(f"{model.base_model_prefix}."))
            found["value/head"] = head_names
            found["value/head_abs_sum"] = sum(full[k].abs().sum().item() for k in head_names)
            backbone = dict(plain.model.named_parameters())
            prefix = f"{model.base_model_prefix}."
            found["value/backbone_differs"] = sorted(
                k for k in full if k.startswith(prefix) and not torch.equal(full[k], backbone[k.removeprefix(prefix)])
            )
    after = hf.load_causal_lm(args.model, dtype="float32")  # an ordinary model again
    found["later_load_whole"] = all(not hasattr(p, "ds_id") for p in after.parameters())
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(found))
    # both ranks done before either tears its group down; then out without the interpreter's
    # finalisation, where a gloo worker thread still holding a tensor made one rank abort once in CI
    # ("terminate called without an active exception": a torch teardown race, not what is tested here)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
