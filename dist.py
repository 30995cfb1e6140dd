"""Multi-process training helpers for `torchrun --nproc_per_node=N train.py`: process group,
FSDP2 sharding, small collectives, full state dicts, gradient clipping, work split (a step's
groups; GEPA's answers over every rank's engine: shared_map / serve).

Every function is the identity or a no-op in a single process (WORLD_SIZE unset or 1), so the
trainer calls them unconditionally and a plain `python train.py` never touches
torch.distributed.

The loss convention the sharding relies on: each rank divides its loss by the token count of
the WHOLE step (all ranks, all micro-batches; `all_sum` of the local counts), so the step's
gradient is the SUM of the ranks' gradients, never their mean (see `shard`).

Failures: a rank that fails must not leave the others waiting in a collective (train.py sets
the timeout to a day). Where the ranks follow one protocol, the error travels in the protocol's
own object collective and every rank raises RankError naming it ("rank 1 failed: ValueError:
..."): shared_map / serve / leading (GEPA's answer calls and the round around them) and section
(a block that may fail on some ranks only, e.g. rank 0 writing a checkpoint). Anywhere else
(the step's tensor collectives, rank 0's logging between them), share_failure records the first
error in the group's store and the failing process leaves the group (train.py's teardown): a
rank waiting in a gloo collective gets "Connection closed by peer" at once, and share_failure
turns that into RankError naming the first error. On NCCL a waiting collective does not notice
that a peer left: torchrun's agent ends the waiting ranks once the failing process has exited
(SIGTERM, which train.py's StopSignal defers, then SIGKILL 30 s later), and its summary names the
first failure.
"""

import contextlib
import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist


def world_size():
    """WORLD_SIZE as torchrun sets it; 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def active():
    """True when running under torchrun with more than one process and the group is up."""
    return world_size() > 1 and dist.is_available() and dist.is_initialized()


def setup(device_type, timeout_minutes=30):
    """Join the process group -> (rank, world, device). NCCL for cuda (one GPU per process,
    cuda:LOCAL_RANK), gloo for cpu. Single process: (0, 1, torch.device(device_type)).
    timeout_minutes bounds how long a collective waits for the slowest rank (train.py raises it:
    the other ranks wait while rank 0 reflects in a GEPA round)."""
    world = world_size()
    if world <= 1:
        return 0, 1, torch.device(device_type)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # object collectives and NCCL use the current device
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=timeout_minutes))
    else:
        device = torch.device(device_type)
        dist.init_process_group("gloo", timeout=timedelta(minutes=timeout_minutes))
    return rank, world, device


def teardown():
    """Leave the process group that setup() joined. A no-op in a single process, where a group,
    if any, belongs to someone else (an in-process vLLM engine initialises its own)."""
    if active():
        dist.destroy_process_group()


def rank():
    """This process's rank; 0 in a single process."""
    return dist.get_rank() if active() else 0


def world():
    """Processes in the group; 1 in a single process."""
    return dist.get_world_size() if active() else 1


def is_main():
    """True on rank 0 (and in a single process): the one that logs, saves and evaluates."""
    return rank() == 0


def barrier():
    """Wait for every rank."""
    if active():
        dist.barrier()


def _scalar_device():
    """Where a collective's scalar tensor must live: NCCL only reduces CUDA tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_scalar(x, op):
    """Reduce a python number over the ranks in float64 (integers exact up to 2**53); an int
    in gives an int out."""
    if not active():
        return x
    t = torch.tensor(float(x), dtype=torch.float64, device=_scalar_device())
    dist.all_reduce(t, op=op)
    return int(t.item()) if isinstance(x, int) and not isinstance(x, bool) else t.item()


def all_sum(x):
    """Global sum of a python float or int (e.g. the step's token count)."""
    return _all_reduce_scalar(x, dist.ReduceOp.SUM)


def all_max(x):
    """Global max of a python float or int."""
    return _all_reduce_scalar(x, dist.ReduceOp.MAX)


def gather_objects(obj):
    """Every rank's picklable `obj`, in rank order, on every rank; [obj] in a single process."""
    if not active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src=0):
    """Rank `src`'s picklable `obj` on every rank (the others' argument is ignored)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def sum_counters(counter, max_keys=()):
    """A collections.Counter summed over the ranks (keys in `max_keys`: their max instead)."""
    parts = gather_objects(counter)
    if len(parts) == 1:
        return counter
    out = type(counter)()
    for part in parts:
        for key, value in part.items():
            out[key] = max(out[key], value) if key in max_keys and key in out else out[key] + value
    return out


def split(items, rank, world):
    """This rank's share of a step's items, items[rank::world]: whole groups per rank (pass the
    groups, not the rows, so a group's advantages are never split), counts differing by one at
    most. The shares may hold different token counts; the global token-mean divides them out."""
    return items[rank::world]


def unsplit(parts):
    """Inverse of split: the ranks' shares (gather_objects(split(items, r, world))) back in the
    order of `items`."""
    out, world = [], len(parts)
    for i in range(sum(map(len, parts))):
        out.append(parts[i % world][i // world])
    return out


class RankError(RuntimeError):
    """One rank's error, raised again on every rank that learned of it; the message names the
    rank and the original error ("rank 1 failed: ValueError: bad item"). shared_map, serve,
    leading and section raise it on every rank at the same point (after the same collective),
    so it needs no further announcing."""


def _failure(error):
    """This rank's `error` as a RankError, small and picklable: what an object collective carries."""
    return RankError(f"rank {rank()} failed: {type(error).__name__}: {error}")


def _raise_failures(parts, error=None):
    """RankError naming every failure among the ranks' gathered `parts` (chained to this rank's
    own `error`, if it is one of them); nothing when there is none."""
    failures = [str(p) for p in parts if isinstance(p, RankError)]
    if failures:
        raise RankError("; ".join(failures)) from error


def _gather_shares(fn, share):
    """Every rank's fn(share), in rank order. A rank whose fn raises still takes part in the
    gather, sending its error instead of results; then every rank raises RankError naming it, so
    no rank is left waiting for another's results."""
    error = None
    try:
        mine = fn(share)
        pickle.dumps(mine)  # results that cannot be sent fail here, as this rank's error, not inside the gather
    except BaseException as e:  # KeyboardInterrupt too: the others wait for this rank's part
        error, mine = e, _failure(e)
    parts = gather_objects(mine)
    _raise_failures(parts, error)
    return parts


def shared_map(fn, items):
    """fn(items) computed by every rank together, called on rank 0 inside leading() while the
    others are in serve(fn): each rank takes items[rank::world] (split: shares differ by one item
    at most), and rank 0 gets the results back in the order of `items`. fn maps a list to a list
    of as many results, each a function of its own item alone (e.g. greedy answers: then the
    result is the one-process one). If fn raises on any rank, every rank raises RankError naming
    it (and the others leave serve). A single process: fn(items)."""
    if not active():
        return fn(items)
    broadcast_object(list(items))
    return unsplit(_gather_shares(fn, split(items, 0, world())))


def serve(fn):
    """Ranks > 0: compute their share of every rank-0 shared_map(fn, ...) until rank 0's
    leading() block ends. Raises RankError when that block fails on rank 0, or when a share
    fails on any rank."""
    while (items := broadcast_object(None)) is not None:
        if isinstance(items, RankError):  # rank 0 failed between two calls
            raise items
        _gather_shares(fn, split(items, rank(), world()))


def release():
    """Rank 0: the ranks in serve() return (a no-op in a single process). leading() calls it."""
    if active():
        broadcast_object(None)


@contextlib.contextmanager
def leading():
    """Rank 0's side of serve(): the block may call shared_map any number of times while the
    other ranks serve; when it ends they return from serve(). When it raises, the serving ranks
    raise RankError naming its error and rank 0 raises the error itself (a RankError from a
    shared_map call: every rank raised it already, nothing more is sent).

        if dist.is_main():
            with dist.leading():
                result = search(...)  # calls dist.shared_map(answer, prompts)
        else:
            dist.serve(answer)
    """
    try:
        yield
    except BaseException as e:
        if active() and not isinstance(e, RankError):
            with contextlib.suppress(Exception):  # a broadcast to ranks already gone fails: `e` is the error to raise
                broadcast_object(_failure(e))  # between calls the others wait in serve()'s broadcast
        raise
    release()


@contextlib.contextmanager
def section():
    """A block that may fail on some ranks only (e.g. rank 0 writing a checkpoint's files),
    ended by every rank together: each sends None or its error in one object collective (a
    barrier that carries errors), and if any rank failed, every rank raises RankError naming it
    (on the failing rank, chained to its own error). The block must not call collectives: a rank
    that failed early would skip them. A single process: the block, its error unchanged.

        with dist.section():
            if dist.is_main():
                save(weights, folder)  # OSError on rank 0: RankError on every rank
    """
    error = None
    try:
        yield
    except BaseException as e:
        if not active():
            raise
        error = e
    _raise_failures(gather_objects(None if error is None else _failure(error)), error)


FIRST_FAILURE = "dist/first_failure"  # the store key share_failure writes


def share_failure(error):
    """Call where an error ends this rank's run (in the `except` that re-raises it, before the
    process group is torn down): the first failure of the run is recorded in the group's store
    (under torchrun its agent holds the store, so the record outlives the failing process). A
    rank whose error came after another rank's is seen as its consequence, typically gloo's
    "Connection closed by peer" once the failing process left the group: RankError naming the
    first failure is raised instead, chained to this rank's error. A RankError (every rank
    raised it already) and a single process: nothing to do.

        try:
            loop()
        except BaseException as e:
            dist.share_failure(e)
            raise
        finally:
            dist.teardown()
    """
    if not active() or isinstance(error, RankError):
        return
    mine = str(_failure(error))
    try:  # the store init_process_group made (torch has no public getter); compare_set: the first writer wins
        first = dist.distributed_c10d._get_default_store().compare_set(FIRST_FAILURE, "", mine).decode()
    except Exception:  # no store to reach (its host is gone): this rank's own error stands
        return
    if first != mine:
        raise RankError(first) from error


def shard(model, reshard_after_forward=True, forward_methods=()):
    """FSDP2 (`fully_shard`) on each decoder layer (model.model.layers), then on the root.
    Returns the model (the same object, now an FSDPModule). Identity in a single process.

    Mixed precision: param_dtype stays fp32 (None: the parameters' own dtype). Training keeps
    fp32 master weights and runs the forward under bf16 autocast, which casts each matmul's
    inputs to bf16 itself while the embedding output, the residual stream and the norm weights
    stay fp32. FSDP-cast bf16 parameters would make all of those bf16 (and the gradients too),
    so the sharded run would no longer compute what the single-device run computes. The price
    is an fp32 all-gather (2x the bytes of bf16). reduce_dtype = fp32: gradients are summed in
    full precision.

    Gradients are SUMMED across ranks: FSDP2 divides the reduce-scatter by the world size by
    default (ReduceOp.AVG), but each rank's loss is already divided by the GLOBAL token count.
    In torch 2.13 (_fully_shard/_fsdp_collectives.py, _get_gradient_divide_factors) a divide
    factor of 1.0 alone picks ReduceOp.PREMUL_SUM(1/1.0), which gloo does not implement;
    adding set_force_sum_reduction_for_comms(True) takes the branch that reduces with plain
    ReduceOp.SUM and post-divides by 1.0, which `_div_if_needed` skips. Both setters act on
    one FSDP module's own parameter group, so they are applied to every sharded module.

    Tied embeddings (lm_head.weight is model.embed_tokens.weight): neither module is sharded
    on its own, so the shared parameter belongs to the root's group once and the tie holds.

    forward_methods: names of methods of `model` that the trainer calls INSTEAD of forward (e.g.
    one that runs the decoder and the LM head only at the response positions). FSDP gathers
    the root's parameters (embeddings, final norm, LM head) around forward only; a registered
    method gets the same pre/post-forward hooks, hence also the gradient reduction of the root.
    """
    if not active():
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    return model


def full_state_dict(model, main_only=False):
    """{HF name: full tensor}. Keys are the plain module names (fully_shard adds no prefix), tied
    weights under both names as in model.state_dict(). Single process: model.state_dict() itself
    (no copies). Under torchrun a collective that gathers every parameter:
    - main_only=False: on EVERY rank, on the model's device (the whole fp32 model per rank);
    - main_only=True: on rank 0 only, in CPU memory ({} elsewhere): what a checkpoint or rank 0's
      GEPA round needs, without a GPU copy of the whole model on any rank.
    To push weights into an engine, stream them instead (full_parameters)."""
    if not active():
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=main_only))


def full_parameters(model, dtype=None):
    """(HF name, full tensor) for each parameter, one at a time, cast to `dtype` (None: as
    stored). Under FSDP2 each parameter's shard is cast first, then gathered (`full_tensor()`,
    a collective per parameter: every rank must consume the whole generator, in step), so a
    rank holds one full parameter at a time, never the whole model. A tied LM head is the
    embedding and comes once, under the embedding's name (named_parameters drops the duplicate).
    Single process: the parameters themselves (no copy when dtype matches)."""
    for name, param in model.named_parameters():
        tensor = param.detach()
        if dtype is not None:
            tensor = tensor.to(dtype)
        if hasattr(tensor, "full_tensor"):  # DTensor: an FSDP2 shard
            tensor = tensor.full_tensor()
        yield name, tensor


def optimizer_state(optimizer, copy=False):
    """optimizer.state_dict() with each DTensor (an FSDP2 shard of a state like exp_avg)
    replaced by its local CPU tensor: a file that loads without a process group or a device
    mesh. In a single process: the state dict itself. copy=True: every tensor copied into CPU
    memory, in any process (a snapshot that later optimizer steps leave as it is)."""
    state = optimizer.state_dict()
    if not (active() or copy):
        return state

    def local(v):
        v = _local(v)
        return v.to("cpu", copy=copy) if torch.is_tensor(v) else v

    return {**state, "state": {i: {k: local(v) for k, v in s.items()} for i, s in state["state"].items()}}


def load_optimizer_state(optimizer, state):
    """Inverse of optimizer_state, at the same world size: a local tensor shaped like its
    parameter's shard becomes a DTensor on the parameter's mesh again."""
    if active():
        from torch.distributed.tensor import DTensor

        params = [p for g in optimizer.param_groups for p in g["params"]]
        wrapped = {}
        for i, s in state["state"].items():
            p = params[i]
            wrapped[i] = {k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False)
                          if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.to_local().shape
                          and v.dim() > 0 else v for k, v in s.items()}
        state = {**state, "state": wrapped}
    optimizer.load_state_dict(state)


def _local(t):
    """A tensor's own storage: an FSDP2 DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def cpu_snapshot(model, optimizer):
    """This rank's parameters (under FSDP2: its shards) and optimizer state, copied into CPU
    memory: what train.policy_update puts back when a later optimizer step of a call is not
    finite. A copy on the GPU would hold weights + AdamW moments twice (48 GB more for a 4B
    model on one GPU); a CPU copy costs a device-to-host transfer per call of several steps.
    Only trained parameters are copied (LoRA: the adapters; a frozen base never changes)."""
    params = [_local(p.detach()).to("cpu", copy=True) for p in model.parameters() if p.requires_grad]
    return params, optimizer_state(optimizer, copy=True)


@torch.no_grad()
def restore_snapshot(model, optimizer, snapshot):
    """Put cpu_snapshot's parameters and optimizer state back, in place (an empty optimizer
    state, before the first step, becomes empty again)."""
    params, state = snapshot
    for p, saved in zip([p for p in model.parameters() if p.requires_grad], params, strict=True):
        _local(p).copy_(saved)
    load_optimizer_state(optimizer, state)


def clip_grad_norm(model, max_norm):
    """Scale the gradients so their global L2 norm is at most max_norm; returns that norm
    (before clipping) as a float, the same on every rank. Under FSDP2 the gradients are
    DTensor shards and the norm comes back as a DTensor holding per-rank partial results;
    full_tensor() reduces it, so the clip coefficient is the global one everywhere. A
    collective: every rank calls it after the same backward passes (FSDP2 gives every rank
    gradients then, or none)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # tied weights counted once
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):  # DTensor
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
    return total.item()
