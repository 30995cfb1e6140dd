"""runs.py: checkpoint names, atomic writes, and a resume that turns the run folder into a clean branch."""

import json
import os

import pytest

from runs import checkpoint_step, link_checkpoint, resolve_resume, start_branch, write_atomic
from train import Config


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
    assert resolve_resume(cfg) is None  # nothing saved yet: start from scratch
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "latest").write_text("ckpt-000010\n")  # a run written before pointers were links
    assert resolve_resume(cfg) == os.path.join(str(tmp_path), "r", "ckpt-000010")
    link_checkpoint(str(tmp_path / "r"), "latest", 12)
    assert resolve_resume(cfg) == os.path.join(str(tmp_path), "r", "ckpt-000012")
    with pytest.raises(SystemExit, match="run_name"):
        resolve_resume(Config(resume="auto"))


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
