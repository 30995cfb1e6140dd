"""dist.py: a PPO-clip SGD step on 2 FSDP2 ranks (torchrun, gloo) equals the single-process step; the collectives;
identity in one process; a rank that fails ends every rank at once, with its error."""

import json
import os
import random
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

import dist
from dist_child import batch_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(ROOT, "tests", "dist_child.py")
FAIL_CHILD = os.path.join(ROOT, "tests", "dist_fail_child.py")
LR = 0.1
# float32 throughout; the two runs differ only in summation order (per-rank partial sums,
# different padding widths): measured max |diff| 4.5e-8 on gradients (largest 0.18) and 6e-8 on
# parameters (~0.2-1), so 1e-6 absolute leaves a ~15x margin.
ATOL = 1e-6
RTOL = 1e-5


def tiny_model():
    """Randomly initialised 2-layer Llama, tied embeddings, fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         initializer_range=0.2, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def make_rows():
    """8 rows, prompts of 2-5 and responses of 1-9 tokens (rank 0 gets rows 0, 2, 4, 6 with 18
    response tokens, rank 1 the other 4 with 26), advantages of both signs, old log-probs shifted
    by up to +-0.5 so the clip binds on some tokens."""
    rng = random.Random(1)
    prompt_lens, response_lens = [2, 5, 3, 4, 2, 3, 5, 4], [3, 7, 9, 1, 2, 9, 4, 9]
    advantages = [1.0, -0.5, -1.2, 0.8, 0.3, 1.1, -0.9, -0.4]
    return [{"prompt": [rng.randrange(1, 100) for _ in range(p)], "response": [rng.randrange(1, 100) for _ in range(n)],
             "advantage": a, "old_shift": [rng.uniform(-0.5, 0.5) for _ in range(n)]}
            for p, n, a in zip(prompt_lens, response_lens, advantages)]


def total_norm(grads):
    """L2 norm of all gradients, written out."""
    return sum((g.double() ** 2).sum() for g in grads.values()).sqrt().item()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process step: all 8 rows in one batch, backward, gradients, clip to half the
    norm (so clipping is exercised), SGD. Also saves the initial model for the ranks."""
    folder = tmp_path_factory.mktemp("dist")
    model = tiny_model()
    model.save_pretrained(folder / "model")
    rows = make_rows()
    step_tokens = sum(len(r["response"]) for r in rows)
    loss = batch_loss(model, rows, step_tokens, len(rows))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    max_norm = total_norm(grads) / 2
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9).step()  # the first step: momentum = gradient
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"folder": folder, "rows": rows, "step_tokens": step_tokens, "loss": loss.item(), "grads": grads,
            "norm": norm, "max_norm": max_norm, "params": params}


@pytest.fixture(scope="module")
def ranks(reference):
    """Run 2 ranks once; returns each rank's step results and collective results."""
    out = reference["folder"] / "out"
    out.mkdir()
    job = {"model": str(reference["folder"] / "model"), "out": str(out), "rows": reference["rows"],
           "max_norm": reference["max_norm"], "lr": LR, "micro_batches": 2}
    job_path = reference["folder"] / "job.json"
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", CHILD, str(job_path)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [{"step": torch.load(out / f"step-rank{r}.pt"),
             "small": json.loads((out / f"collectives-rank{r}.json").read_text())} for r in range(2)]


def test_sharded_step_equals_single_process(reference, ranks):
    ref = reference
    assert ranks[0]["step"]["local_tokens"] != ranks[1]["step"]["local_tokens"]  # uneven split, by design
    for r in ranks:
        s = r["step"]
        assert s["step_tokens"] == ref["step_tokens"] == 44 and s["step_rows"] == 8
        assert s["tied"]
        assert s["loss"] == pytest.approx(ref["loss"], abs=ATOL)
        assert s["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():  # SUMMED over ranks: averaging would halve them
            torch.testing.assert_close(s["grads"][name], g, rtol=RTOL, atol=ATOL, msg=name)
        assert s["norm"] == pytest.approx(ref["norm"], rel=RTOL)
        assert ref["norm"] == pytest.approx(2 * ref["max_norm"], rel=1e-6)  # clipping was active
        assert s["params"].keys() == ref["params"].keys()  # HF names, lm_head.weight included
        for name, p in ref["params"].items():
            torch.testing.assert_close(s["params"][name], p, rtol=0, atol=ATOL, msg=name)


def test_weights_stream_one_parameter_at_a_time_and_gather_on_rank_zero(reference, ranks):
    """full_parameters: each parameter once (a tied head under the embedding's name only), in
    named_parameters order, cast to bf16 before the gather, on every rank; full_state_dict with
    main_only: CPU tensors on rank 0, nothing on rank 1."""
    names = [n for n, _ in tiny_model().named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied
    for r in ranks:
        s = r["step"]
        assert [k for k, _ in s["streamed"]] == names
        for k, v in s["streamed"]:
            assert v.dtype == torch.bfloat16 and torch.equal(v, s["params"][k].to(torch.bfloat16)), k
    assert ranks[0]["step"]["on_main"] == {k: ("cpu", True) for k in reference["params"]}
    assert ranks[1]["step"]["on_main"] == {}


def test_cpu_snapshot_restores_fsdp_shards_and_an_empty_optimizer_state(reference, ranks):
    for r in ranks:
        s = r["step"]
        assert s["stepped_state"] == len(reference["params"]) - 1  # momentum buffers (tied: one less)
        assert s["state_after_restore"] == 0
        assert s["restored"] == {k: True for k in reference["params"]}


def test_collectives(ranks):
    for rank, r in enumerate(ranks):
        small = r["small"]
        assert small["is_main"] == (rank == 0)
        assert small["gather"] == [{"rank": 0, "square": 0}, {"rank": 1, "square": 1}]
        assert small["broadcast0"] == "from rank 0"
        assert small["broadcast1"] == [1, "x"]
        assert small["sum_int"] == 3 and small["types"]["sum_int"] == "int"
        assert small["sum_float"] == 0.75 and small["types"]["sum_float"] == "float"
        assert small["max_int"] == 10 and small["max_float"] == -0.5


def test_single_process_is_identity(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dist.setup("cpu") == (0, 1, torch.device("cpu"))
    assert not dist.active() and dist.is_main() and dist.rank() == 0
    dist.barrier()
    assert dist.all_sum(3) == 3 and dist.all_max(2.5) == 2.5
    assert dist.gather_objects({"a": 1}) == [{"a": 1}]
    assert dist.broadcast_object("x") == "x"
    items = list(range(7))
    assert dist.split(items, 0, 1) == items
    assert dist.shared_map(lambda xs: [x * x for x in xs], items) == [x * x for x in items]
    with dist.leading(), dist.section():
        pass
    with pytest.raises(ValueError, match="^its own error$"), dist.section():
        raise ValueError("its own error")
    assert dist.share_failure(ValueError("alone")) is None
    assert dist.split(items, 1, 3) == [1, 4]
    model = tiny_model()
    assert dist.shard(model) is model
    state, full = model.state_dict(), dist.full_state_dict(model)
    assert full.keys() == state.keys()
    assert all(torch.equal(full[k], v) for k, v in state.items())
    batch_loss(model, make_rows(), 44, 8).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    norm = dist.clip_grad_norm(model, 0.01)
    assert norm == pytest.approx(total_norm(grads), rel=1e-6)
    clipped = total_norm({name: p.grad for name, p in model.named_parameters()})
    assert clipped == pytest.approx(0.01, rel=1e-4)
    dist.teardown()


# dist_fail_child.py's scenarios: the rank that fails and its error, as the last line of a traceback shows it
FAILURES = {
    "share0": (0, "ValueError: planted failure: rank 0's share of an answer call"),
    "share1": (1, "ValueError: planted failure: rank 1's share of an answer call"),
    "lead0": (0, "ValueError: planted failure: rank 0 between two answer calls"),
    "checkpoint0": (0, "OSError: planted failure: rank 0 writing a checkpoint's weights"),
    "checkpoint1": (1, "OSError: planted failure: rank 1 writing its own checkpoint file"),
    "between0": (0, "ValueError: planted failure: rank 0 between two collectives"),
    "between1": (1, "ValueError: planted failure: rank 1 between two collectives"),
}
# A rank left waiting would wait for the group's timeout, a day. Once every process has loaded,
# the scenarios take milliseconds: what a process needs after the go is the failure reaching it
# and its exit, 14 interpreters exiting at once. Measured on 2 cores shared with other jobs (load
# 10-13): each process ended 5-12 s after the go (1-4 s with one scenario alone), the whole test
# took 24-46 s.
FAIL_SECONDS = 20  # from the go to each process's end
DEADLINE_SECONDS = 90  # the whole test, loading 14 processes that import torch included


def start_ranks(name, folder):
    """The 2 processes of one scenario, started as torchrun starts its workers (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, the store held by the launcher, here this test, so that it outlives a
    failing rank) but without torchrun's agent, which ends the other ranks once one exits: here
    each process has to end by itself. -> (the store, the processes); each process's stderr
    goes to FOLDER/rank-R.err."""
    folder.mkdir()
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE="2", OMP_NUM_THREADS="1",
               TORCHELASTIC_USE_AGENT_STORE="True", PYTHONPATH=ROOT)
    procs = []
    for r in range(2):
        with open(folder / f"rank-{r}.err", "w") as err:
            procs.append(subprocess.Popen([sys.executable, FAIL_CHILD, name, str(folder)], cwd=ROOT,
                                          stdout=subprocess.DEVNULL, stderr=err,
                                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
    return store, procs


def test_a_failing_rank_ends_every_rank_with_its_error(tmp_path):
    """Each rank fails in turn in an answer call's share, in rank 0's GEPA round between calls, in
    writing a checkpoint after the weights' gather, and between two collectives of a step: every
    process ends by itself, with exit code 1 and an error whose last line names the original
    error (on the other rank: as "rank R failed: <error>"), within FAIL_SECONDS of the go that
    starts every scenario at once."""
    started = time.monotonic()
    stores, procs = [], {}
    for name in FAILURES:
        store, pair = start_ranks(name, tmp_path / name)
        stores.append(store)
        procs.update({(name, rank): proc for rank, proc in enumerate(pair)})
    ended = {}  # (scenario, rank) -> seconds from the go to its process's end, as seen by polling
    try:
        for store in stores:  # every process loaded and in its process group
            store.wait(["ready-0", "ready-1"], timedelta(seconds=DEADLINE_SECONDS))
        go = time.monotonic()
        for store in stores:
            store.set("go", "")
        while len(ended) < len(procs) and time.monotonic() - started < DEADLINE_SECONDS:
            ended.update({key: time.monotonic() - go for key, proc in procs.items()
                          if key not in ended and proc.poll() is not None})
            time.sleep(0.05)
    finally:
        for proc in procs.values():
            proc.kill()
    assert ended.keys() == procs.keys(), f"after {DEADLINE_SECONDS} s: {sorted(procs.keys() - ended.keys())} running"
    for (name, rank), seconds in ended.items():
        failing, error = FAILURES[name]
        err = (tmp_path / name / f"rank-{rank}.err").read_text()
        last = err.strip().splitlines()[-1] if err.strip() else ""
        named = last.endswith(f"RankError: rank {failing} failed: {error}") or rank == failing and last.endswith(error)
        code = procs[name, rank].returncode
        assert code == 1 and named, f"{name}, rank {rank}: exit {code}\n{err[-3000:]}"
        assert seconds < FAIL_SECONDS, f"{name}, rank {rank}: ended {seconds:.1f} s after the go"
