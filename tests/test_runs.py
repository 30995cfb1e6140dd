"""runs.py: checkpoint names, atomic writes, and a resume that turns the run folder into a clean branch."""

import glob
import json
import math
import os
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from runs import RunLog, checkpoint_step, link_checkpoint, resolve_resume, start_branch, wandb_resume_note, write_atomic
from train import Config

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def test_checkpoint_step_reads_only_checkpoint_names():
    assert checkpoint_step("ckpt-000012") == 12
    assert [checkpoint_step(n) for n in ("ckpt-", "ckpt-12a", "latest", "gepa-epoch-0.json")] == [None] * 4


def test_write_atomic_leaves_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "latest"
    path.write_text("ckpt-000001\n")

    def crash(tmp):
        open(tmp, "w").write("ckpt-0000")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_atomic(str(path), crash)
    assert path.read_text() == "ckpt-000001\n"
    write_atomic(str(path), lambda tmp: open(tmp, "w").write("ckpt-000002\n"))
    assert path.read_text() == "ckpt-000002\n"


def jsonl(path, steps, cut_last=False):
    lines = [json.dumps({"step": s}) + "\n" for s in steps]
    path.write_text("".join(lines) + ('{"step": 9' if cut_last else ""))


def test_start_branch_sets_aside_what_came_after_the_resumed_step(tmp_path):
    run = tmp_path / "run"
    for name in ("ckpt-000002", "ckpt-000004", "ckpt-000006", ".partial-abc"):
        (run / name).mkdir(parents=True)
    (run / "ckpt-000004" / "trainer.pt.tmp-123").write_text("half a file")
    (run / "latest.tmp-77").write_text("ckpt-0")
    for epoch in (0, 1, 2):
        (run / f"gepa-epoch-{epoch}.json").write_text("{}")
    jsonl(run / "metrics.jsonl", [1, 2, 3, 4, 5, 6], cut_last=True)
    jsonl(run / "dev.jsonl", [0, 5])
    start_branch(str(run), step=4, epoch=1, resumed_from=str(run / "ckpt-000004"))
    assert sorted(os.listdir(run)) == ["abandoned", "ckpt-000002", "ckpt-000004", "dev.jsonl", "gepa-epoch-0.json",
                                       "metrics.jsonl"]
    assert os.listdir(run / "ckpt-000004") == []  # the cut trainer.pt replacement is gone
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert [json.loads(x)["step"] for x in (run / "dev.jsonl").read_text().splitlines()] == [0]
    (aside,) = (run / "abandoned").iterdir()
    assert sorted(os.listdir(aside)) == ["ckpt-000006", "dev.jsonl", "gepa-epoch-1.json", "gepa-epoch-2.json",
                                         "metrics.jsonl"]
    assert (aside / "metrics.jsonl").read_text().splitlines()[-1] == '{"step": 9'  # kept as it was


def test_a_same_step_checkpoint_of_another_run_is_set_aside(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other" / "ckpt-000004"
    (run / "ckpt-000004").mkdir(parents=True)
    other.mkdir(parents=True)
    start_branch(str(run), step=4, epoch=0, resumed_from=str(other))
    assert not (run / "ckpt-000004").exists()  # this run continues from the other one's weights


def test_resolve_resume(tmp_path):
    cfg = Config(out_dir=str(tmp_path), run_name="r", resume="auto")
    with pytest.raises(SystemExit, match=r"no run folder .*r \(.* holds no runs\)"):
        resolve_resume(cfg)  # a run that does not exist is not started over
    (tmp_path / "r").mkdir()
    assert resolve_resume(cfg) is None  # the folder, nothing saved yet: start from scratch
    (tmp_path / "r" / "latest").write_text("ckpt-000010\n")  # a run written before pointers were links
    assert resolve_resume(cfg) == os.path.join(str(tmp_path), "r", "ckpt-000010")
    link_checkpoint(str(tmp_path / "r"), "latest", 12)
    assert resolve_resume(cfg) == os.path.join(str(tmp_path), "r", "ckpt-000012")
    with pytest.raises(SystemExit, match="run_name"):
        resolve_resume(Config(resume="auto"))


def test_resume_of_a_misspelt_run_or_a_run_folder_is_an_error_that_says_what_to_type(tmp_path):
    for name in ("p2o-seed1", "grpo-seed1"):
        (tmp_path / name).mkdir()
    link_checkpoint(str(tmp_path / "p2o-seed1"), "latest", 4)
    typo = Config(out_dir=str(tmp_path), run_name="p2o-sed1", resume="auto")
    with pytest.raises(SystemExit, match=r"did you mean --run_name=p2o-seed1\? \(runs in .*: grpo-seed1, p2o-seed1\)"):
        resolve_resume(typo)
    with pytest.raises(SystemExit, match=r"is a run folder; .*--resume=.*p2o-seed1/latest"):
        resolve_resume(Config(resume=str(tmp_path / "p2o-seed1")))
    with pytest.raises(SystemExit, match="no such checkpoint folder"):
        resolve_resume(Config(resume=str(tmp_path / "p2o-seed1" / "ckpt-000009")))


def test_pointers_into_what_was_set_aside_are_removed(tmp_path):
    run = tmp_path / "run"
    for name in ("ckpt-000002", "ckpt-000004"):
        (run / name).mkdir(parents=True)
    link_checkpoint(str(run), "latest", 4)
    link_checkpoint(str(run), "best", 2)
    start_branch(str(run), step=2, epoch=0, resumed_from=str(run / "ckpt-000002"))
    assert os.readlink(run / "latest") == "ckpt-000002"  # --resume=auto finds the new branch
    assert os.readlink(run / "best") == "ckpt-000002"
    link_checkpoint(str(run), "best", 4)
    start_branch(str(run), step=2, epoch=0, resumed_from=str(run / "ckpt-000002"))
    assert not os.path.lexists(run / "best")  # train.py re-points it from its LoopState


def test_pointers_are_relative_links_that_load_as_model_folders(tmp_path, tiny_model):
    """`latest` and `best` work wherever a model path is taken; a folder that is not a model is a
    clear error, not a JSON error inside transformers."""
    import shutil

    from transformers import AutoConfig

    from model import resolve_model

    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(tiny_model, run / "ckpt-000003")
    link_checkpoint(str(run), "latest", 3)
    (run / "latest.tmp-1").symlink_to("ckpt-000003")  # a link left by a killed process
    start_branch(str(run), step=3, epoch=0, resumed_from=str(run / "ckpt-000003"))
    assert not os.path.lexists(run / "latest.tmp-1") and (run / "ckpt-000003").is_dir()
    moved = tmp_path / "moved"
    shutil.move(str(run), moved)  # relative: the run folder can move
    assert os.readlink(moved / "latest") == "ckpt-000003"
    assert AutoConfig.from_pretrained(resolve_model(str(moved / "latest"))).hidden_size == 32
    with pytest.raises(SystemExit, match="not a model folder"):
        resolve_model(str(moved))


def test_prune_checkpoints_spares_the_newest_and_the_named(tmp_path):
    from runs import link_checkpoint, prune_checkpoints

    for step in (1, 2, 3, 5, 8):
        (tmp_path / f"ckpt-{step:06d}").mkdir()
    (tmp_path / "ckpt-notes").mkdir()  # not a checkpoint name: never touched
    link_checkpoint(str(tmp_path), "best", 2)
    link_checkpoint(str(tmp_path), "latest", 5)  # e.g. a resumed branch whose newest folder is not latest's
    assert prune_checkpoints(str(tmp_path), keep=1) == ["ckpt-000001", "ckpt-000003"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink()) == \
        ["ckpt-000002", "ckpt-000005", "ckpt-000008", "ckpt-notes"]
    assert prune_checkpoints(str(tmp_path), keep=0) == []  # 0 keeps everything


# ---- RunLog: TensorBoard, the JSONL files and optional Weights & Biases logging


def group(n):
    """A stand-in for train.Group: problem p<n>, two samples, one of them under a template."""
    return SimpleNamespace(problem=SimpleNamespace(id=f"p{n}", answer=str(n)), templates=["", "Check twice."],
                           samples=[SimpleNamespace(text=f"\\boxed{{{n}}}"), SimpleNamespace(text="no idea")],
                           rewards=[1.0, 0.0])


def test_run_log_without_wandb_project_never_imports_wandb(tmp_path, monkeypatch):
    """The default (--wandb_project=''): None in sys.modules makes any `import wandb` fail."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    log = RunLog(str(tmp_path), 0, Config())
    log.step({"step": 1, "reward_mean": 0.5}, [group(1)])
    log.dev(1, {"greedy": 0.5})
    log.gepa(0, 1, 3)
    log.close()
    assert json.loads((tmp_path / "rollouts.jsonl").read_text())["responses"] == ["\\boxed{1}", "no idea"]
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "wandb-id.txt").exists()


def test_wandb_resume_note_names_the_steps_wandb_ignores():
    assert wandb_resume_note(SimpleNamespace(id="abc", step=0), 0) is None  # a new run
    assert wandb_resume_note(SimpleNamespace(id="abc", step=6), 5) is None  # nothing logged past the checkpoint
    assert "steps 6-8" in wandb_resume_note(SimpleNamespace(id="abc", step=9), 5)


def log_two_attempts(run_dir):
    """What test_wandb_offline_run_... runs in a child process: steps 1-2, a dev evaluation and a
    GEPA round, closed; then a resume at step 2 that logs step 3."""
    cfg = Config(wandb_project="p2o-test", log_rollouts=1)
    result = SimpleNamespace(to_json=lambda: {"pool": []},
                             summary=lambda: {"accepted": 1, "proposals": 4, "best_dev_score": 0.75})
    log = RunLog(run_dir, 0, cfg)
    for step in (1, 2):
        log.step({"step": step, "reward_mean": step / 4, "loss": float("nan")}, [group(step), group(99)])
    log.dev(2, {"greedy": 0.25, "avg@4": 0.5})
    log.gepa(0, 2, 7, result)
    log.close()
    log = RunLog(run_dir, 2, cfg)
    log.step({"step": 3, "reward_mean": 1.0}, [group(3)])
    log.close()


def wandb_records(path):
    """The records of a run's .wandb file, which wandb 0.31 writes from its Go core and no longer
    reads back in Python. The file: ':W&B', magic 0xBEE1 and version 0 (7 bytes), then 32 KiB
    blocks of chunks, each a 7-byte header (CRC-32C, length, type: 1 whole, 2 first, 3 middle,
    4 last) and its bytes; a block's tail too short for a header is padding. A record is a
    wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, block = open(path, "rb").read(), 32768
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records):
    """step -> {key: value} of the history rows among `records` (W&B's own keys start with '_')."""
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = rows.setdefault(r.history.step.num, {})
            for item in r.history.item:
                row["/".join(item.nested_key) if item.nested_key else item.key] = json.loads(item.value_json)
    return rows


def tensorboard_tags(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tb"))
    events.Reload()
    return set(events.Tags()["scalars"])


def test_wandb_offline_run_gets_tensorboards_scalars_a_rollout_table_and_resumes(tmp_path):
    """wandb in offline mode, in a child process under a time limit (wandb starts a service
    process). Offline wandb writes no wandb-summary.json: what arrived is read back from the run's
    .wandb files, one per attempt (offline-run-<time>-<id>[-N]/, joined by `wandb sync`)."""
    run_dir = tmp_path / "w"
    run_dir.mkdir()
    home = str(tmp_path / "wandb-home")  # wandb's caches and artifact staging, else under ~
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, TESTS]), WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=home,
               WANDB_CACHE_DIR=home, WANDB_CONFIG_DIR=home, WANDB_DATA_DIR=home)
    started = time.time()
    child = subprocess.run([sys.executable, "-c", f"import test_runs; test_runs.log_two_attempts({str(run_dir)!r})"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    print(f"child: {time.time() - started:.1f} s")

    run_id = (run_dir / "wandb-id.txt").read_text().strip()
    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert [os.path.basename(f) for f in files] == [f"run-{run_id}.wandb"] * 2  # the resume continued the same id
    records = [r for f in files for r in wandb_records(f)]
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {(r.run_id, r.project, r.display_name) for r in runs} == {(run_id, "p2o-test", "w")}
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["wandb_project"] == "p2o-test" and config["lr"] == Config().lr and config["log_rollouts"] == 1
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [0, 0]

    history = wandb_history(records)
    scalars = {step: {k: v for k, v in row.items() if not k.startswith(("_", "rollouts/"))}
               for step, row in history.items()}
    assert scalars == {1: {"train/step": 1, "train/reward_mean": 0.25},
                       2: {"train/step": 2, "train/reward_mean": 0.5, "dev/greedy": 0.25, "dev/avg@4": 0.5,
                           "p2o/hard_set_size": 7, "p2o/gepa_acceptance_rate": 0.25,
                           "p2o/gepa_best_dev_score": 0.75},
                       3: {"train/step": 3, "train/reward_mean": 1.0}}  # the NaN loss is left out, as in TensorBoard
    assert set().union(*scalars.values()) == tensorboard_tags(str(run_dir))
    assert {history[s]["rollouts/_type"] for s in (1, 2, 3)} == {"incremental-table-file"}

    tables = str(run_dir / "wandb" / "offline-run-*" / "files" / "media" / "table" / "rollouts_*.table.json")
    increments = [json.load(open(f)) for f in glob.glob(tables)]  # offline-run-*: latest-run/ is a link to one
    assert len(increments) == 3  # one per step, each with that step's rows only
    assert {tuple(t["columns"]) for t in increments} == {("step", "id", "answer", "template", "response", "reward")}
    expected = [(s, f"p{s}", str(s), "", f"\\boxed{{{s}}}", 1.0) for s in (1, 2, 3)] + \
               [(s, f"p{s}", str(s), "Check twice.", "no idea", 0.0) for s in (1, 2, 3)]
    assert sorted(tuple(row) for t in increments for row in t["data"]) == sorted(expected)  # group 99: not sampled


def test_a_resume_sets_aside_exports_of_later_steps(tmp_path):
    run = tmp_path / "run"
    for name in ("ckpt-000002", "export-000002", "export-000004", "ckpt-000004"):
        (run / name).mkdir(parents=True)
    start_branch(str(run), step=2, epoch=0, resumed_from=str(run / "ckpt-000002"))
    assert sorted(p.name for p in run.iterdir() if p.name != "abandoned") == ["ckpt-000002", "export-000002"]
    assert sorted(p.name for p in (run / "abandoned").glob("*/*")) == ["ckpt-000004", "export-000004"]


def test_a_step_that_measured_no_token_logs_nan_mismatch_and_a_stale_engine_is_flagged():
    from train import Config
    from runs import sampler_mismatch, sampler_mismatch_bound

    cfg = Config(backend="vllm", engine_dtype="bfloat16", temperature=0.5)
    assert sampler_mismatch_bound(cfg) == pytest.approx(0.2)  # 0.1 nats/token at T = 1, over T
    cfg32 = Config(backend="hf", autocast_bf16=False, temperature=1.0)
    assert sampler_mismatch_bound(cfg32) == pytest.approx(0.01)
    none = sampler_mismatch({"mismatch_tokens": 0, "mismatch_abs_sum": 0.0, "mismatch_abs_max": 0.0}, cfg)
    assert all(math.isnan(v) for v in none.values()) and set(none) == {
        "sampler_mismatch_mean", "sampler_mismatch_max", "sampler_stale", "sampler_kl_k1", "sampler_kl_k3",
        "trainer_ppl", "sampler_ppl"}
    within = sampler_mismatch({"mismatch_tokens": 10, "mismatch_abs_sum": 1.9, "mismatch_abs_max": 0.5}, cfg)
    above = sampler_mismatch({"mismatch_tokens": 10, "mismatch_abs_sum": 2.1, "mismatch_abs_max": 0.5}, cfg)
    assert (within["sampler_mismatch_mean"], within["sampler_stale"], above["sampler_stale"]) == (0.19, 0.0, 1.0)
