"""Crash safety: a tiny P²O run SIGKILLed in a GEPA round, in trainer.pt's replacement, mid-step and in a checkpoint folder's write resumes (--resume=auto) to the uninterrupted run's end state; a LoRA run too."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(ROOT, "tests", "crash_child.py")
RUN = "crash"  # crash_child.RUN_NAME
STEPS = [1, 2, 3, 4]  # 6 problems, 3 per step, 2 epochs; GEPA between steps 2 and 3
# checkpoints (save_every=3): ckpt-000002 before GEPA, its trainer.pt replaced after it; 3; 4 (the end)
FINAL = "ckpt-000004"


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("crash-data") / "six.jsonl"
    rows = [{"id": f"p{i}", "problem": f"Compute {i + 1} * {i + 4} - {i}.", "answer": str((i + 1) * (i + 4) - i),
             "source": "test"} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def metrics_lines(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def unfinished(run_dir, recursive):
    """Names of leftover temporary writes (.partial-* folders, *.tmp-* files), relative to run_dir."""
    found = []
    for folder, dirs, files in os.walk(run_dir):
        if "abandoned" in dirs:
            dirs.remove("abandoned")
        for name in dirs + files:
            if name.startswith(".partial-") or ".tmp-" in name:
                found.append(os.path.relpath(os.path.join(folder, name), run_dir))
        if not recursive:
            break
    return sorted(found)


def run_child(out_dir, model, data, log, *flags, kill_when=None):
    """Run crash_child.py to its end, or SIGKILL it from here as soon as kill_when(run_dir) holds;
    return its exit status."""
    cmd = [sys.executable, CHILD, f"--model={model}", f"--data={data}", f"--out={out_dir}", *flags]
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            if kill_when is not None:
                while proc.poll() is None:
                    if kill_when(os.path.join(out_dir, RUN)):
                        proc.kill()
                        break
                    time.sleep(0.02)
            return proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def read_latest(run_dir):
    return runs.pointer_target(run_dir, "latest")


def tail(log):
    with open(log) as f:
        return f.read()[-3000:]


def trainer_state(run_dir, name=FINAL):
    return torch.load(os.path.join(run_dir, name, "trainer.pt"), map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def reference(tiny_model, data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("crash-reference")
    log = str(out / "child.log")
    rc = run_child(str(out), tiny_model, data_file, log)
    assert rc == 0, tail(log)
    return str(out / RUN)


@pytest.fixture(scope="module")
def chain(tiny_model, data_file, tmp_path_factory):
    """One run killed four times, each kill resumed with --resume=auto, then run to its end.
    Returns (run_dir, log, what was seen right after each kill)."""
    out = tmp_path_factory.mktemp("crash-chain")
    run_dir, log = str(out / RUN), str(out / "child.log")
    seen = {}

    def after_kill(name, rc):
        seen[name] = {
            "rc": rc, "leftovers": unfinished(run_dir, recursive=True),
            "steps": [m["step"] for m in metrics_lines(run_dir)],
            "gepa_archive": os.path.isfile(os.path.join(run_dir, "gepa-epoch-0.json")),
            "latest": read_latest(run_dir),
            "checkpoints": sorted(n for n in os.listdir(run_dir) if n.startswith("ckpt-")),
            "epoch_in_ckpt2": (trainer_state(run_dir, "ckpt-000002")["loop"]["epoch"]
                               if os.path.isdir(os.path.join(run_dir, "ckpt-000002")) else None),
            "partial_files": sorted(f for n in os.listdir(run_dir) if n.startswith(".partial-")
                                    for f in os.listdir(os.path.join(run_dir, n))),
        }

    # (d) inside the GEPA round: the reflector's 2nd call (after the pre-GEPA checkpoint)
    after_kill("gepa", run_child(str(out), tiny_model, data_file, log, "--kill=gepa-2"))
    # (c) the post-GEPA trainer.pt replacement: temp file written, not yet renamed
    after_kill("trainer_tmp", run_child(str(out), tiny_model, data_file, log, "--resume", "--kill=trainer-tmp"))
    # (a) from outside, once step 3 is logged and checkpointed: lands in step 4's generation (slowed down)
    def step_3_saved(d):
        return len(metrics_lines(d)) >= 3 and read_latest(d) == "ckpt-000003"
    after_kill("mid_step", run_child(str(out), tiny_model, data_file, log, "--resume", "--slow=1.5",
                                     kill_when=step_3_saved))
    # (b) inside the write of ckpt-000004/ (model and tokenizer written, trainer.pt half written)
    after_kill("partial", run_child(str(out), tiny_model, data_file, log, "--resume", "--kill=partial-1"))
    for _ in range(3):  # resume until it finishes
        rc = run_child(str(out), tiny_model, data_file, log, "--resume")
        if rc == 0:
            break
        assert rc == -9, tail(log)
    assert rc == 0, tail(log)
    return run_dir, log, seen


def test_each_kill_lands_where_intended(chain):
    _, log, seen = chain
    assert all(s["rc"] == -9 for s in seen.values()), (seen, tail(log))
    gepa, trainer_tmp, mid_step, partial = seen["gepa"], seen["trainer_tmp"], seen["mid_step"], seen["partial"]
    # (d) the round never finished: no archive; the newest checkpoint is step 2's, saved before it
    assert not gepa["gepa_archive"] and gepa["steps"] == [1, 2] and gepa["latest"] == "ckpt-000002"
    assert gepa["epoch_in_ckpt2"] == 0  # pre-GEPA state: the resume repeats the round
    # (c) archive written, trainer.pt's replacement left as a temp file; the old trainer.pt stays
    assert trainer_tmp["gepa_archive"] and trainer_tmp["epoch_in_ckpt2"] == 0
    assert [p for p in trainer_tmp["leftovers"] if p.startswith("ckpt-000002/trainer.pt.tmp-")], trainer_tmp
    assert trainer_tmp["checkpoints"] == ["ckpt-000002"]
    # (a) step 3 logged and saved, step 4 not logged: killed mid-step; the post-GEPA state was saved
    assert mid_step["steps"] == [1, 2, 3] and mid_step["checkpoints"] == ["ckpt-000002", "ckpt-000003"]
    assert mid_step["epoch_in_ckpt2"] == 1 and mid_step["latest"] == "ckpt-000003"
    # (b) step 4 logged, its checkpoint folder only half written under a .partial- name
    assert partial["steps"] == STEPS and partial["checkpoints"] == ["ckpt-000002", "ckpt-000003"]
    assert partial["latest"] == "ckpt-000003"
    assert {"model.safetensors", "trainer.pt"} <= set(partial["partial_files"]), partial


def test_resumed_run_ends_as_the_uninterrupted_one(chain, reference):
    run_dir = chain[0]
    assert read_latest(reference) == read_latest(run_dir) == FINAL
    want, got = load_file(os.path.join(reference, FINAL, "model.safetensors")), \
        load_file(os.path.join(run_dir, FINAL, "model.safetensors"))
    assert want.keys() == got.keys()
    worst = max((want[k] - got[k]).abs().max().item() for k in want)
    assert worst <= 1e-6, worst
    a, b = trainer_state(reference), trainer_state(run_dir)
    assert a["loop"]["step"] == b["loop"]["step"] == 4
    assert a["loop"]["counts"] == b["loop"]["counts"]
    assert a["loop"]["counts"]["reflection_calls"] >= 2  # the kill on the 2nd call was inside a real round
    for key in ("consumed", "epoch", "hard_now", "assignment", "skipped_steps"):
        assert a["loop"][key] == b["loop"][key], key
    for x, y in zip(a["loop"]["gepa_history"], b["loop"]["gepa_history"], strict=True):
        untimed = lambda h: {k: v for k, v in h.items() if k != "seconds"}  # noqa: E731 - the round's wall time
        assert untimed(x) == untimed(y)
    adam_a, adam_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert adam_a.keys() == adam_b.keys() and adam_a
    for k in adam_a:
        assert adam_a[k]["step"] == adam_b[k]["step"] > 0
        for name in ("exp_avg", "exp_avg_sq"):
            assert (adam_a[k][name] - adam_b[k][name]).abs().max().item() <= 1e-6
    with open(os.path.join(reference, "gepa-epoch-0.json")) as fa, open(os.path.join(run_dir, "gepa-epoch-0.json")) as fb:
        assert json.load(fa) == json.load(fb)


def test_metrics_hold_each_step_once_as_uninterrupted(chain, reference):
    run_dir = chain[0]
    got, want = metrics_lines(run_dir), metrics_lines(reference)
    assert [m["step"] for m in got] == [m["step"] for m in want] == STEPS
    for x, y in zip(want, got):
        for key in ("epoch", "prompt_ids", "reward_mean", "templated_row_fraction", "hard_so_far", "grad_norm"):
            assert x[key] == pytest.approx(y[key], abs=1e-6), (x["step"], key)
    assert sum(m["trained_rows"] for m in got[:2]) > 0  # the weights moved before the GEPA round too
    assert sum(m["templated_row_fraction"] for m in got[2:]) > 0  # GEPA's templates were used after it
    set_aside = []
    for folder in os.listdir(os.path.join(run_dir, "abandoned")):
        path = os.path.join(run_dir, "abandoned", folder, "metrics.jsonl")
        if os.path.isfile(path):
            set_aside += [m["step"] for m in metrics_lines(os.path.dirname(path))]
    assert sorted(set_aside) == [4]  # step 4's line of the attempt killed in its checkpoint write: set aside


def test_no_unfinished_write_left_in_the_run_folder(chain):
    run_dir = chain[0]
    assert unfinished(run_dir, recursive=False) == []
    assert sorted(n for n in os.listdir(run_dir) if n.startswith("ckpt-")) == ["ckpt-000002", "ckpt-000003", FINAL]


def test_no_unfinished_write_left_inside_checkpoints(chain):
    assert unfinished(chain[0], recursive=True) == []


@pytest.fixture(scope="module")
def lora_chain(tiny_model, data_file, tmp_path_factory):
    """A LoRA run (adapters only in each checkpoint) uninterrupted, and one killed in the GEPA round
    and inside a checkpoint write, each resumed with --resume=auto."""
    ref_out, out = tmp_path_factory.mktemp("lora-reference"), tmp_path_factory.mktemp("lora-chain")
    log = str(out / "child.log")
    assert run_child(str(ref_out), tiny_model, data_file, log, "--lora") == 0, tail(log)
    assert run_child(str(out), tiny_model, data_file, log, "--lora", "--kill=gepa-2") == -9, tail(log)
    assert run_child(str(out), tiny_model, data_file, log, "--lora", "--resume", "--kill=partial-1") == -9, tail(log)
    partial = sorted(f for n in os.listdir(out / RUN) if n.startswith(".partial-") for f in os.listdir(out / RUN / n))
    assert run_child(str(out), tiny_model, data_file, log, "--lora", "--resume") == 0, tail(log)
    return str(ref_out / RUN), str(out / RUN), partial


def test_a_lora_run_killed_and_resumed_ends_as_the_uninterrupted_one(lora_chain):
    reference, run_dir, partial = lora_chain
    assert {"adapter_model.safetensors", "trainer.pt"} <= set(partial) and "model.safetensors" not in partial
    assert read_latest(reference) == read_latest(run_dir) == FINAL
    want, got = (load_file(os.path.join(d, FINAL, "adapter_model.safetensors")) for d in (reference, run_dir))
    assert want.keys() == got.keys() and max(v.abs().max().item() for k, v in want.items() if "lora_B" in k) > 0
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-6
    a, b = trainer_state(reference), trainer_state(run_dir)
    for key in ("step", "consumed", "epoch", "hard_now", "assignment", "counts"):
        assert a["loop"][key] == b["loop"][key], key
    assert len(a["optimizer"]["state"]) == len(want)  # the adapters' moments, nothing of the base
    for k in a["optimizer"]["state"]:
        for name in ("exp_avg", "exp_avg_sq"):
            assert (a["optimizer"]["state"][k][name] - b["optimizer"]["state"][k][name]).abs().max().item() <= 1e-6
    for x, y in zip(metrics_lines(reference), metrics_lines(run_dir), strict=True):
        assert x["step"] == y["step"] and x["grad_norm"] == pytest.approx(y["grad_norm"], abs=1e-6)
    assert unfinished(run_dir, recursive=True) == []
