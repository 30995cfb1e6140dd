"""One rank of tests/test_dist.py, started by torchrun: a sharded PPO-clip SGD step and the
small collectives, each rank writing what it saw to the output folder.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_child.py JOB.json

JOB.json: {"model": folder, "out": folder, "rows": [...], "max_norm", "lr", "micro_batches"}.
The parent imports `batch_loss` from here, so the single-process reference and the ranks
compute the loss with the same code; what differs is only the sharding and the split.
"""

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dist
import grpo

PAD_ID = 0


def batch_loss(model, rows, step_tokens, step_rows):
    """This batch's share of the step's token-mean PPO-clip loss. Each row is
    {"prompt", "response", "advantage", "old_shift"}: the old log-probs are the current ones
    shifted per response token by old_shift, so some ratios leave the clip range."""
    ids, attention, response_mask = grpo.make_batch([r["prompt"] for r in rows], [r["response"] for r in rows],
                                                    PAD_ID)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # [B, L-1, V]
    mask = response_mask[:, 1:]  # [B, L-1]
    logp = grpo.token_logprobs(logits, ids[:, 1:])  # [B, L-1]
    shift = torch.zeros_like(logp)
    for b, r in enumerate(rows):
        shift[b, mask[b].nonzero().squeeze(1)] = torch.tensor(r["old_shift"])
    advantages = torch.tensor([r["advantage"] for r in rows])
    loss, _ = grpo.ppo_clip_token_loss(logp, logp.detach() + shift, advantages, 0.2, 0.28)
    return grpo.aggregate(loss, mask.float(), "token-mean", step_tokens, step_rows)


def sharded_step(job, rank, world):
    """split -> global token count -> micro-batches through the FSDP2 model -> full gradients,
    clipped norm, SGD step -> full state dict, the same weights streamed one parameter at a time
    (bf16) and gathered on rank 0 only; then dist.restore_snapshot back to before the step.
    Returns what the parent compares."""
    from transformers import AutoModelForCausalLM

    model = dist.shard(AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32))
    local = dist.split(job["rows"], rank, world)
    step_tokens = dist.all_sum(sum(len(r["response"]) for r in local))
    step_rows = dist.all_sum(len(local))
    size = -(-len(local) // job["micro_batches"])  # 4 rows per rank: every rank runs the same micro-batch count
    loss_sum = 0.0
    for i in range(0, len(local), size):
        loss = batch_loss(model, local[i:i + size], step_tokens, step_rows)
        loss.backward()
        loss_sum += loss.item()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}  # before clipping
    norm = dist.clip_grad_norm(model, job["max_norm"])
    optimizer = torch.optim.SGD(model.parameters(), lr=job["lr"], momentum=0.9)  # momentum: an optimizer state
    before = {k: v.detach().clone() for k, v in dist.full_state_dict(model).items()}
    snapshot = dist.cpu_snapshot(model, optimizer)  # empty optimizer state: nothing stepped yet
    optimizer.step()
    params = {k: v.detach().clone() for k, v in dist.full_state_dict(model).items()}
    streamed = [(k, v.clone()) for k, v in dist.full_parameters(model, torch.bfloat16)]
    main_only = dist.full_state_dict(model, main_only=True)
    on_main = {k: (str(v.device), torch.equal(v, params[k].cpu())) for k, v in main_only.items()}
    stepped_state = len(optimizer.state)
    dist.restore_snapshot(model, optimizer, snapshot)
    restored = {k: torch.equal(v, before[k]) for k, v in dist.full_state_dict(model).items()}
    return {"step_tokens": step_tokens, "step_rows": step_rows, "loss": dist.all_sum(loss_sum),
            "local_tokens": sum(len(r["response"]) for r in local), "grads": grads, "norm": norm,
            "params": params, "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "streamed": streamed, "on_main": on_main, "restored": restored, "stepped_state": stepped_state,
            "state_after_restore": len(optimizer.state)}


def collectives(rank):
    """The small collectives on rank-dependent inputs."""
    return {
        "is_main": dist.is_main(),
        "gather": dist.gather_objects({"rank": rank, "square": rank * rank}),
        "broadcast0": dist.broadcast_object(f"from rank {rank}"),
        "broadcast1": dist.broadcast_object([rank, "x"], src=1),
        "sum_int": dist.all_sum(rank + 1),
        "sum_float": dist.all_sum(0.25 * (rank + 1)),
        "max_int": dist.all_max(10 - 3 * rank),
        "max_float": dist.all_max(-1.5 + rank),
    }


def main(job_path):
    with open(job_path) as f:
        job = json.load(f)
    rank, world, device = dist.setup("cpu")
    assert device.type == "cpu"
    torch.manual_seed(0)
    step = sharded_step(job, rank, world)
    torch.save(step, os.path.join(job["out"], f"step-rank{rank}.pt"))
    small = collectives(rank)
    small["types"] = {k: type(v).__name__ for k, v in small.items() if k.startswith(("sum", "max"))}
    with open(os.path.join(job["out"], f"collectives-rank{rank}.json"), "w") as f:
        json.dump(small, f)
    dist.barrier()
    dist.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
