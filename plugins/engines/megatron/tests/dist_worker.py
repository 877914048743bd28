"""Worker of ``test_distributed.py``, launched once by ``torchrun --nproc_per_node=2`` (gloo, CPU,
with the test-only CUDA shim). One launch runs two layouts of the same 2 ranks, one after the other:

1. ``tp2``: tensor parallelism 2 (one replica). Checks, written to ``--out`` for the test:
   the engine's shards right after loading equal the pure converter's TP=2 shards of the Hugging
   Face weights, and gathering them back gives the original weights bit for bit; logits (the two
   vocabulary halves gathered, for the test only) and the mean NLL loss against the Hugging Face
   model; vocabulary-parallel log-probs/entropies and their gradients against the core's
   full-vocabulary formula; 3 training steps (saving after step 1), a second engine resuming from
   that checkpoint, a bucketed Hugging Face export; a layout clash error.
   Then a critic (``head="value"``) on the same layout: values and 3 value steps (saving after step
   1), a second critic resuming from that checkpoint, the value model's export.
2. ``dp2``: data parallelism 2 (tensor parallelism 1, DDP with ``overlap_grad_reduce``), rows split
   unevenly (down to a rank with none): the same 3 steps, and a resume from the ``tp2`` checkpoint
   (another layout); then the critic's 3 value steps on those rows.

Rank 0 writes ``result.json`` and ``*.pt`` files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mcore_common as common
import mcore_cpu_shim as cpu_shim
import torch
import torch.distributed as dist
from core_rl_megatron import convert
from core_rl_megatron.config import DDPConfig, MegatronConfig
from core_rl_megatron.engine import MegatronEngine
from core_rl_megatron.errors import MegatronSetupError
from core_rl_megatron.vocab_parallel import vocab_parallel_stats
from core_rl_train_kit.logprobs import align_to_tokens, token_logprobs
from megatron.core import parallel_state as mpu


def vocab_parallel_parity(engine: MegatronEngine) -> dict[str, float]:
    """Values and gradients of the vocabulary-parallel formulas against ``token_logprobs`` on the
    gathered logits, with padded vocabulary entries present in the last shard."""
    g = torch.Generator().manual_seed(5)
    vocab, padded, tp = engine.spec.vocab_size, engine.padded_vocab, engine.tp_size
    full = torch.randn(3, 7, padded, generator=g) * 3
    ids = torch.randint(0, vocab, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    w_lp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)

    ref_logits = full[..., :vocab].clone().requires_grad_(True)
    ref_lp, ref_ent = token_logprobs(ref_logits, ids, mask, 0.7, with_entropy=True)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()

    width = padded // tp
    local = full[..., engine.tp_rank * width : (engine.tp_rank + 1) * width].clone().requires_grad_(True)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    lp, ent = vocab_parallel_stats(
        local,
        targets,
        vocab_start=engine.tp_rank * width,
        vocab_size=vocab,
        temperature=0.7,
        with_entropy=True,
        group=mpu.get_tensor_model_parallel_group(),
    )
    lp, ent = align_to_tokens(lp[:, :-1], mask), align_to_tokens(ent[:, :-1], mask)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    grads = [torch.empty_like(local.grad) for _ in range(tp)]
    dist.all_gather(grads, local.grad.contiguous(), group=mpu.get_tensor_model_parallel_group())
    grad = torch.cat(grads, dim=-1)
    return {
        "logprob": (lp - ref_lp).abs().max().item(),
        "entropy": (ent - ref_ent).abs().max().item(),
        "grad": (grad[..., :vocab] - ref_logits.grad).abs().max().item(),
        "grad_padding": grad[..., vocab:].abs().max().item(),
    }


def phase_tp2(model_path: str, out: Path) -> dict:
    cfg = MegatronConfig(tensor_model_parallel_size=2, make_vocab_size_divisible_by=8, export_bucket_mb=0.05)
    actor = common.actor(model_path)
    engine = MegatronEngine(actor, cfg)
    rank = engine.rank
    result: dict = {"tp": engine.tp_size, "padded_vocab": engine.padded_vocab}

    # the engine's loaded shards against the pure converter, and the gathered weights against the file
    from safetensors.torch import load_file

    hf = load_file(str(Path(model_path) / "model.safetensors"))
    shards = convert.hf_to_megatron_shards(hf, engine.spec, engine.padded_vocab, 2)[engine.tp_rank]
    result["shards_equal"] = all(torch.equal(p.detach(), shards[n]) for n, p in engine.params.items())
    gathered = engine.full_state_dict()
    if rank == 0:
        result["round_trip_exact"] = gathered.keys() == hf.keys() and all(torch.equal(gathered[k], hf[k]) for k in hf)

    batch = common.batches()[0]
    logits = common.full_logits(engine, batch)
    lp = engine.compute_logprobs(batch, temperature=0.7)
    result["vocab_parallel"] = vocab_parallel_parity(engine)

    # each rank passes its own rows, as the trainer does; the replica pools them
    world = engine.world_size
    metrics_a = common.train(engine, range(1), rank, world)
    engine.save_state(out / "ckpt_tp2", {"data_position": 1})
    metrics_a += common.train(engine, range(1, 3), rank, world)
    final_a = engine.full_state_dict()
    engine.export_hf(out / "export_tp2")

    resumed = MegatronEngine(actor, cfg)
    assert resumed.load_state(out / "ckpt_tp2") == {"data_position": 1}
    metrics_b = common.train(resumed, range(1, 3), rank, world)
    final_b = resumed.full_state_dict()
    result.update(metrics_a=metrics_a, metrics_b=metrics_b)

    try:  # a second layout in the same process is a clear error, not a hang
        MegatronEngine(actor, MegatronConfig(make_vocab_size_divisible_by=8))
        result["layout_clash"] = None
    except MegatronSetupError as exc:
        result["layout_clash"] = str(exc)

    if rank == 0:
        torch.save({"logits": logits, "logprobs": lp}, out / "tp2_forward.pt")
        torch.save({"a": final_a, "b": final_b}, out / "tp2_final.pt")
    for e in (engine, resumed):
        e.close()
    return result


def phase_tp2_critic(model_path: str, out: Path) -> dict:
    cfg = MegatronConfig(tensor_model_parallel_size=2, make_vocab_size_divisible_by=8)
    actor = common.actor(model_path)
    engine = MegatronEngine(actor, cfg, head="value")
    rank, world = engine.rank, engine.world_size
    batch = common.value_batches()[0]
    start = engine.compute_values(batch)
    metrics = common.train_values(engine, range(1), rank, world)
    engine.save_state(out / "ckpt_tp2_critic", {"n": 1})
    metrics += common.train_values(engine, range(1, 3), rank, world)
    values, final = engine.compute_values(batch), engine.full_state_dict()
    engine.export_hf(out / "export_tp2_critic")
    resumed = MegatronEngine(actor, cfg, head="value")
    assert resumed.load_state(out / "ckpt_tp2_critic") == {"n": 1}
    metrics_b = common.train_values(resumed, range(1, 3), rank, world)
    final_b = resumed.full_state_dict()
    if rank == 0:
        torch.save({"start": start, "values": values, "a": final, "b": final_b}, out / "tp2_critic.pt")
    for e in (engine, resumed):
        e.close()
    return {"metrics_a": metrics, "metrics_b": metrics_b}


def phase_dp2(model_path: str, out: Path) -> dict:
    cfg = MegatronConfig(make_vocab_size_divisible_by=8, ddp=DDPConfig(overlap_grad_reduce=True, bucket_size=4000))
    actor = common.actor(model_path)
    engine = MegatronEngine(actor, cfg)
    rank, world = engine.rank, engine.world_size
    result: dict = {"tp": engine.tp_size, "dp": mpu.get_data_parallel_world_size()}
    metrics = common.train(engine, range(3), rank, world)
    final = engine.full_state_dict()
    cross = MegatronEngine(actor, cfg)
    assert cross.load_state(out / "ckpt_tp2") == {"data_position": 1}
    metrics_c = common.train(cross, range(1, 3), rank, world)
    final_c = cross.full_state_dict()
    critic = MegatronEngine(actor, cfg, head="value")
    result["critic_metrics"] = common.train_values(critic, range(3), rank, world)
    final_critic = critic.full_state_dict()
    result.update(metrics=metrics, metrics_c=metrics_c)
    if rank == 0:
        torch.save({"final": final, "cross": final_c, "critic": final_critic}, out / "dp2_final.pt")
    for e in (engine, cross, critic):
        e.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu_shim.install()
    out = Path(args.out)
    result = {"tp2": phase_tp2(args.model, out)}
    result["tp2_critic"] = phase_tp2_critic(args.model, out)
    dist.barrier()
    mpu.destroy_model_parallel()
    result["dp2"] = phase_dp2(args.model, out)
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
