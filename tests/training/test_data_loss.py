"""Fault cases where a run could lose or mix what it published: the NaN guard, run directories, the corpus cache.

Each drives ``train.py`` (in this process through ``train.main``, or as a subprocess where two processes are the
point) with a tiny model for a few steps, and checks the exit status, that no traceback is printed, and that
nothing published was lost or mixed.
"""

import contextlib
import errno
import fcntl
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint.filesystem
import yaml
from numpy.testing import assert_array_equal

import train
import training.loop
import training.metrics
from data import cache as token_cache
from data.cache import load_tokens
from parallel.checkpoint import published_checkpoints
from parallel.runtime import Runtime
from tests.spawn import spawn
from tests.training.stopped_run import stopped_after_step
from tests.training.test_checkpointing import load_checkpoint
from training.metrics import read_metrics
from training.routing_stats import read_routing
from training.run_dir import hold_run_dir

ROOT = Path(__file__).resolve().parents[2]

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "train.global_batch_size=4", "train.warmup_steps=0",
        "train.precision=fp32", "train.eval_interval=0", "train.eval_batches=1", "logging.wandb=disabled",
        "logging.log_interval=1", "logging.progress=lines", "logging.plots=false"]


def main(run_dir, *settings, resume=None):
    return train.main(["--run-dir", str(run_dir), *(["--resume", resume] if resume else []),
                       "--set", *TINY, *settings])


def steps(run_dir):
    return [step for step, _ in published_checkpoints(run_dir / "checkpoints")]


def manifests(run_dir):
    found = published_checkpoints(run_dir / "checkpoints")
    return {path.name: (path / "manifest.json").read_text() for _, path in found}


# --- the NaN guard ---------------------------------------------------------------------------------------------


def test_a_divergence_keeps_the_good_checkpoints_and_the_advised_resume_works(tmp_path, capsys):
    assert main(tmp_path, "train.steps=4", "checkpoint.interval=1") == 0
    assert steps(tmp_path) == [4, 3, 2]
    good = manifests(tmp_path)
    capsys.readouterr()

    # lr=1e9: step 5's update (finite loss and gradient) writes weights of ~1e9 that give NaN from step 6 on
    assert main(tmp_path, "train.steps=40", "checkpoint.interval=1", "train.lr=1e9") == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "checkpoint step_0000005 discarded" in err
    assert f"The last good state is {tmp_path}/checkpoints/step_0000004" in err and "lower train.lr" in err
    assert manifests(tmp_path) == good  # nothing published was lost or replaced, nothing bad was published
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))
    for name in good:
        model, _ = load_checkpoint(tmp_path / "checkpoints" / name, [*TINY, "train.steps=4"])
        assert all(torch.isfinite(p).all() and p.abs().max() < 100 for p in model.parameters()), name

    # the advice: the same command with a lower lr resumes the last good state and finishes
    assert main(tmp_path, "train.steps=6", "checkpoint.interval=1", "train.lr=1e-3") == 0
    err = capsys.readouterr().err
    assert f"resumed from {tmp_path}/checkpoints/step_0000004 at step 4" in err
    assert steps(tmp_path) == [6, 5, 4]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "train/loss" in r] == [1, 2, 3, 4, 5, 6]  # the bad steps rewound


def test_an_update_that_writes_non_finite_weights_stops_at_once(tmp_path, monkeypatch, capsys):
    real_step = torch.optim.AdamW.step

    def overflowing(self, *args, **kwargs):  # the third update overflows one weight (its loss and gradient were fine)
        result = real_step(self, *args, **kwargs)
        if self.state[self.param_groups[0]["params"][0]]["step"] == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing)
    assert main(tmp_path, "train.steps=10", "checkpoint.interval=1") == 3
    err = capsys.readouterr().err
    assert "step 3: the update gave non-finite weights" in err and "Traceback" not in err
    assert f"The last good state is {tmp_path}/checkpoints/step_0000002" in err
    assert steps(tmp_path) == [2, 1] and not list((tmp_path / "checkpoints").glob(".tmp_*"))


def test_a_final_state_with_non_finite_validation_loss_is_not_saved(tmp_path, monkeypatch, capsys):
    real = training.loop.evaluate
    calls = {"n": 0}

    def evaluate(*args, **kwargs):  # the first run's final validation is fine, the second's NaN
        calls["n"] += 1
        return real(*args, **kwargs) * (float("nan") if calls["n"] > 1 else 1.0)

    monkeypatch.setattr(training.loop, "evaluate", evaluate)
    assert main(tmp_path, "train.steps=2", "checkpoint.interval=1") == 0
    assert main(tmp_path, "train.steps=4", "checkpoint.interval=1") == 3
    err = capsys.readouterr().err
    assert "the final weights give a non-finite validation loss" in err and "Traceback" not in err
    assert steps(tmp_path) == [3, 2, 1]  # step 3 was confirmed by step 4's finite loss; step 4 not saved


# --- one run per run directory ---------------------------------------------------------------------------------

HOLDER = """
import sys, time
from pathlib import Path
import torch
import torch.distributed.checkpoint.filesystem
from parallel.runtime import Runtime
from training.run_dir import hold_run_dir
run_dir = Path(sys.argv[1])
with hold_run_dir(run_dir, Runtime(0, 1, 0, torch.device("cpu")), run_dir / "checkpoints", "auto"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_held_directory_is_refused_naming_the_holder_and_a_killed_holder_blocks_nothing(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(tmp_path, "train.steps=2") == 2
        err = capsys.readouterr().err
        assert f"is in use by another run (pid {holder.pid} on host {socket.gethostname()}" in err
        assert "Traceback" not in err and not (tmp_path / "config.yaml").exists()
    finally:
        holder.kill()  # SIGKILL: the holder cannot clean up, the OS drops its lock
        holder.wait()
    assert main(tmp_path, "train.steps=2") == 0


def _refused_rank(rank, run_dir, out):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = train.main(["--run-dir", run_dir, "--set", *TINY, "train.steps=2"])
    Path(out, f"rank{rank}.json").write_text(json.dumps({"status": status, "stderr": stderr.getvalue()}))


def test_every_rank_of_a_job_learns_the_refusal_and_one_says_it(tmp_path):
    run_dir = tmp_path / "run"
    with hold_run_dir(run_dir, Runtime(0, 1, 0, torch.device("cpu")), run_dir / "checkpoints", "auto"):
        spawn(_refused_rank, 2, str(run_dir), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["status"] for r in ranks] == [2, 2]
    errors = [line for r in ranks for line in r["stderr"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"pid {os.getpid()}" in errors[0]
    assert not any("Traceback" in r["stderr"] for r in ranks)


def snapshot(run_dir):
    return {path.relative_to(run_dir).as_posix(): path.read_bytes() for path in sorted(run_dir.rglob("*"))
            if path.is_file() and path.name != "run.lock"}


def test_a_used_run_directory_without_checkpoints_is_refused_or_moved_aside_never_mixed(tmp_path, capsys):
    no_saves = ("checkpoint.interval=null", "checkpoint.final=false")  # (a default run saves: see the next test)
    assert main(tmp_path, "train.steps=3", *no_saves) == 0
    first = snapshot(tmp_path)
    capsys.readouterr()

    assert main(tmp_path, "train.steps=2", *no_saves) == 2  # the same command again: nothing to continue from
    err = capsys.readouterr().err
    assert "holds a run (config.yaml, metrics.jsonl, summary.json, routing) without a checkpoint" in err
    assert "--resume none" in err and "Traceback" not in err
    assert snapshot(tmp_path) == first
    other = tmp_path.parent / f"{tmp_path.name}-other"
    assert main(other, "train.steps=1", "checkpoint.interval=1") == 0
    assert main(tmp_path, "train.steps=2", *no_saves, resume=str(other / "checkpoints")) == 2  # another run's
    assert "in a new --run-dir" in capsys.readouterr().err and snapshot(tmp_path) == first
    new = tmp_path.parent / f"{tmp_path.name}-new"  # where it belongs, with a changed key recorded
    assert main(new, "train.steps=2", "train.lr=5e-3", resume=str(other / "checkpoints")) == 0
    assert yaml.safe_load((new / "resume_changes.yaml").read_text())[0]["changes"]["train.lr"]["now"] == 5e-3

    assert main(tmp_path, "train.steps=2", *no_saves, resume="none") == 0  # start over: the old run moves aside
    [aside] = (tmp_path / "replaced").iterdir()
    assert snapshot(aside) == first
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r] == [1, 2]
    assert read_routing(tmp_path)["step"].tolist() == [1, 1, 2, 2]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["steps"] == 2


def test_a_checkpoint_dir_outside_the_run_belongs_to_one_run(tmp_path, capsys):
    shared = tmp_path / "shared-checkpoints"  # two experiments given one absolute checkpoint.dir
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(first, "train.steps=2", "checkpoint.interval=1", f"checkpoint.dir={shared}") == 0
    assert (shared / "owner.txt").read_text().strip() == str(first.resolve())
    saved = snapshot(shared)
    capsys.readouterr()
    for resume in (None, "none", str(shared)):  # the second never resumes, replaces or writes into the first's
        assert main(second, "train.steps=3", "train.lr=5e-3", "checkpoint.interval=1", f"checkpoint.dir={shared}",
                    resume=resume) == 2
        err = capsys.readouterr().err
        assert f"checkpoint.dir {shared} belongs to the run in {first.resolve()}" in err, err
        assert "Traceback" not in err and not (second / "metrics.jsonl").exists()
    assert snapshot(shared) == saved
    assert main(first, "train.steps=3", "checkpoint.interval=1", f"checkpoint.dir={shared}") == 0  # its owner goes on
    assert [r["step"] for r in read_metrics(first / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3]

    unowned = tmp_path / "unowned"  # checkpoints of a run from before owners were recorded
    unowned.mkdir()
    for name in saved:
        (unowned / name).parent.mkdir(parents=True, exist_ok=True)
        (unowned / name).write_bytes(saved[name])
    (unowned / "owner.txt").unlink()
    assert main(second, "train.steps=1", f"checkpoint.dir={unowned}") == 2
    assert "of a run that named no owner" in capsys.readouterr().err
    (unowned / "owner.txt").write_text(f"{second.resolve()}\n")  # the way out the message gives
    assert main(second, "train.steps=3", f"checkpoint.dir={unowned}") == 0


def test_a_checkpoint_dir_in_use_by_a_live_run_is_refused(tmp_path, capsys):
    shared = tmp_path / "shared"
    shared.mkdir()
    with open(shared / "run.lock", "a+") as held:  # another live run holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 1 on host elsewhere\n")
        held.flush()
        assert main(tmp_path / "run", "train.steps=1", "checkpoint.interval=1", f"checkpoint.dir={shared}") == 2
    err = capsys.readouterr().err
    assert f"checkpoint.dir {shared} is in use by another run (pid 1 on host elsewhere)" in err, err


def test_a_tokenizer_changed_under_a_run_is_refused_and_a_new_one_given_deliberately_is_recorded(tmp_path, capsys):
    from data.tokenizer import main as tokenizer_cli

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("textwrap.py", "string.py", "shlex.py"):  # ~60 KB of text from the standard library
        (corpus / name).write_bytes((Path(os.__file__).parent / name).read_bytes())
    tokenizer, run = tmp_path / "mytok.json", tmp_path / "run"
    data = [f"data.source={corpus}", f"data.tokenizer={tokenizer}", "model.vocab_size=512", "checkpoint.interval=1"]
    assert tokenizer_cli(["train", "--source", str(corpus), "--vocab-size", "512", "--out", str(tokenizer)]) == 0
    assert main(run, "train.steps=2", *data) == 0
    saved = snapshot(run / "checkpoints")
    capsys.readouterr()

    assert tokenizer_cli(["train", "--source", str(corpus / "shlex.py"), "--vocab-size", "300", "--overwrite",
                          "--out", str(tokenizer)]) == 0  # retrained in place: same path, other ids
    assert main(run, "train.steps=3", *data) == 2
    err = capsys.readouterr().err
    assert f"would be read here with {tokenizer} (sha256:" in err and "changed in place since the save" in err, err
    assert "Traceback" not in err
    assert snapshot(run / "checkpoints") == saved and not (run / "resume_changes.yaml").exists()

    other = tmp_path / "other-tok.json"  # the new tokenizer under a path of its own: deliberate, and recorded
    other.write_bytes(tokenizer.read_bytes())
    assert main(run, "train.steps=3", *data[:1], f"data.tokenizer={other}", *data[2:]) == 0
    [entry] = yaml.safe_load((run / "resume_changes.yaml").read_text())
    assert entry["changes"]["data.tokenizer"]["now"] == str(other)
    assert entry["changes"]["data.tokenizer (content)"]["saved"].startswith("sha256:")
def test_a_default_run_leaves_a_checkpoint_and_the_same_command_again_says_it_is_done(tmp_path, capsys):
    """``make train`` twice: the first run saves (after step 1, as checkpoint.interval=auto does before it has
    measured a save, and at the end), the second changes nothing and says how to go on; a longer run continues."""
    assert main(tmp_path, "train.steps=3") == 0
    assert steps(tmp_path) == [3, 1]
    first = snapshot(tmp_path)
    capsys.readouterr()
    assert main(tmp_path, "train.steps=3") == 0
    err = capsys.readouterr().err
    assert "is complete" in err and "at step 3 of train.steps=3" in err and "--set train.steps=N" in err
    assert snapshot(tmp_path) == first  # nothing trained, logged or saved again
    assert main(tmp_path, "train.steps=4") == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "schedule redrawn at resume (train.steps 3 -> 4)" in err
    assert steps(tmp_path)[0] == 4
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3, 4]


def test_a_resumed_run_rewinds_its_routing_rows_with_its_metrics(tmp_path, monkeypatch):
    with stopped_after_step(monkeypatch, 3):
        main(tmp_path, "train.steps=4", "checkpoint.interval=2")
    assert read_routing(tmp_path)["step"].tolist() == [1, 1, 2, 2, 3, 3]
    assert main(tmp_path, "train.steps=4", "checkpoint.interval=2") == 0  # resumes step 2
    assert read_routing(tmp_path)["step"].tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3, 4]


# --- the corpus cache ------------------------------------------------------------------------------------------


def fresh(folder, tmp_path):
    """What a tokenisation with no cache at all gives."""
    cache = tmp_path / f"fresh-{len(list(tmp_path.glob('fresh-*')))}"
    return np.asarray(load_tokens(str(folder), cache))


def rewrite_keeping_size_and_mtime(path, content):
    before = path.stat()
    path.write_bytes(content)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize("racy_seconds", [2.0, 0.0], ids=["just-written", "older"])
def test_the_corpus_cache_serves_only_what_a_fresh_tokenisation_would(tmp_path, monkeypatch, racy_seconds):
    # just-written: files changed within RACY_SECONDS of the build are re-hashed on each start;
    # older: their status-change time (which writing always moves) is part of the cache's key
    monkeypatch.setattr(token_cache, "RACY_SECONDS", racy_seconds)
    folder, cache = tmp_path / "corpus", tmp_path / "cache"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"alpha")
    (folder / "b.txt").write_bytes(b"bravo")
    assert bytes(load_tokens(str(folder), cache).astype(np.uint8)) == b"alpha\n\nbravo\n\n"
    time.sleep(0.05)  # past the file times' grain (a clock tick)
    cases = [lambda: rewrite_keeping_size_and_mtime(folder / "a.txt", b"ALPHA"),  # same size, same mtime
             lambda: (folder / "c.txt").write_bytes(b"charlie"),  # a file added
             lambda: (folder / "b.txt").unlink()]  # a file removed
    for change in cases:
        change()
        assert_array_equal(load_tokens(str(folder), cache), fresh(folder, tmp_path))
    assert bytes(load_tokens(str(folder), cache).astype(np.uint8)) == b"ALPHA\n\ncharlie\n\n"


def test_an_unreadable_corpus_file_is_an_error_naming_it_even_with_a_cache(tmp_path, monkeypatch, capsys):
    folder, cache = tmp_path / "corpus", tmp_path / "cache"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_bytes(bytes(range(32, 127)) * 100)
    settings = [f"data.source={folder}", f"data.cache_dir={cache}", "train.steps=1"]
    assert main(tmp_path / "r1", *settings) == 0
    real_open = open

    def open_as_a_user(file, *args, **kwargs):  # the tests may run as root, who reads anything
        if not os.stat(file).st_mode & 0o444:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(token_cache, "open", open_as_a_user, raising=False)
    (folder / "b.txt").chmod(0)
    capsys.readouterr()
    assert main(tmp_path / "r2", *settings) == 2
    err = capsys.readouterr().err
    assert f"cannot read {folder / 'b.txt'} (Permission denied)" in err and "Traceback" not in err


@pytest.mark.parametrize(("setting", "message"), [
    ("checkpoint.dir=/proc", "checkpoint.dir: cannot write checkpoints to /proc"),  # /proc takes no files, even root's
    ("data.cache_dir=/proc", "data.cache_dir='/proc': cannot write there"),
])
def test_an_unwritable_output_folder_is_refused_before_the_first_step(tmp_path, capsys, setting, message):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_bytes(bytes(range(32, 127)) * 100)
    assert main(tmp_path / "r", setting, f"data.source={folder}", "checkpoint.interval=1", "train.steps=2") == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("settings", "message"), [
    (["train.lr=.inf"], "train.lr: inf is not a finite number"),
    (["model.init_std=.nan"], "model.init_std: nan is not a finite number"),
])
def test_inputs_that_would_fail_mid_run_are_refused_before_any_work(tmp_path, capsys, settings, message):
    assert main(tmp_path / "r", *settings) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "r").exists()


def test_resuming_a_checkpoint_of_another_model_shape_names_the_tensor(tmp_path, capsys):
    assert main(tmp_path, "train.steps=1", "checkpoint.interval=1") == 0
    assert main(tmp_path, "train.steps=2", "checkpoint.interval=1", "moe.expert_hidden=48") == 2
    err = capsys.readouterr().err
    assert "holds another model shape: layers.0.moe.experts.w_in is [4, 32, 32] there, [4, 32, 48] here" in err
    assert "moe.expert_hidden 32 -> 48" in err and "Traceback" not in err
    assert steps(tmp_path) == [1]


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_full_disk_during_a_save_loses_nothing_and_says_what_to_do(tmp_path, monkeypatch, capsys, async_save):
    real_write = torch.distributed.checkpoint.filesystem.FileSystemWriter.write_data

    def write_data(self, plan, planner):  # the third save finds the disk full
        if "step_0000003" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, plan, planner)

    monkeypatch.setattr(torch.distributed.checkpoint.filesystem.FileSystemWriter, "write_data", write_data)
    assert main(tmp_path, "train.steps=6", "checkpoint.interval=1", f"checkpoint.async_save={async_save}") == 2
    err = capsys.readouterr().err
    assert "checkpoint step_0000003 could not be written" in err and "No space left on device" in err
    assert "Nothing published was lost (newest: step_0000002)" in err and "lower checkpoint.keep" in err
    assert "Traceback" not in err
    assert steps(tmp_path) == [2, 1] and not list((tmp_path / "checkpoints").glob(".tmp_*"))
    monkeypatch.undo()
    assert main(tmp_path, "train.steps=4", "checkpoint.interval=1") == 0  # space freed: it resumes step 2
    assert steps(tmp_path) == [4, 3, 2]


class FillsUp:
    """A log file on a disk that fills up at the record of ``step``: the line is cut short, then ENOSPC."""

    def __init__(self, handle, step):
        self.handle, self.marker = handle, f'{{"step": {step},'

    def write(self, text):
        if text.startswith(self.marker):
            self.handle.write(text[:len(text) // 2])
            self.handle.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.handle.write(text)

    def __getattr__(self, name):
        return getattr(self.handle, name)


def test_a_full_disk_while_logging_metrics_stops_with_one_message_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    own_file = training.metrics.open_own_file
    monkeypatch.setattr(training.metrics, "open_own_file", lambda *a, **k: FillsUp(own_file(*a, **k), 3))
    assert main(tmp_path, "train.steps=4", "checkpoint.interval=1") == 2
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'metrics.jsonl'} at step 3 (No space left on device)" in err, err
    assert "resumes from the newest checkpoint" in err and "Traceback" not in err
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r] == [1, 2]
    monkeypatch.undo()  # space freed: the same command resumes, and the cut line is gone
    assert main(tmp_path, "train.steps=4", "checkpoint.interval=1") == 0
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3, 4]
    assert read_routing(tmp_path)["step"].tolist() == [1, 1, 2, 2, 3, 3, 4, 4]


def test_a_full_disk_while_creating_a_routing_file_leaves_no_half_file(tmp_path, monkeypatch, capsys):
    real_save = np.save

    def save(file, array, *args, **kwargs):  # the disk fills up while the first routing file is written
        file.write(b"\x93NUMPY")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", save)
    assert main(tmp_path, "train.steps=2", "checkpoint.interval=1") == 2
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'routing'}" in err and "at step 1 (No space left on device)" in err, err
    assert "Traceback" not in err and list((tmp_path / "routing").iterdir()) == []  # no half-written file
    monkeypatch.setattr(np, "save", real_save)
    assert main(tmp_path, "train.steps=2", "checkpoint.interval=1", resume="none") == 0
    assert read_routing(tmp_path)["step"].tolist() == [1, 1, 2, 2]


def test_a_run_directory_that_cannot_be_created_is_refused(capsys):
    assert main(Path("/proc/moe-toolkit-run"), "train.steps=1") == 2  # /proc takes no folders, even root's
    err = capsys.readouterr().err
    assert "--run-dir /proc/moe-toolkit-run: cannot create /proc/moe-toolkit-run/run.lock" in err
    assert "Traceback" not in err


def test_wandb_failing_to_start_is_one_message_not_a_traceback(tmp_path, monkeypatch, capsys):
    import wandb

    def broken_init(**kwargs):
        raise OSError("no API key configured")

    monkeypatch.setattr(wandb, "init", broken_init)
    assert main(tmp_path, "train.steps=1", "logging.wandb=online") == 2
    err = capsys.readouterr().err
    assert "wandb failed to start in logging.wandb=online mode" in err and "logging.wandb=disabled" in err
    assert "Traceback" not in err


def test_config_text_that_used_to_give_tracebacks_gives_one_message(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"  # "billion laughs": 9^7 strings from a few hundred bytes
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"{new}: &{new} [{', '.join([f'*{old}'] * 9)}]" for old, new in zip("abcdef", "bcdefg", strict=True)]
    bomb.write_text("\n".join([*lines, "model: *g"]) + "\n")
    for args, message in [(["--config", str(bomb)], "configs may not use YAML aliases"),
                          (["--set", "train.steps=[1"], "override 'train.steps=[1': the value is not valid YAML"),
                          (["--set", "data.source="], "data.source is empty")]:
        assert train.main(["--run-dir", str(tmp_path / "r"), *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err) < 2000


def test_a_resumed_run_that_leaves_out_a_set_given_at_the_start_keeps_its_schedule(tmp_path, capsys):
    """The run's own settings go on where the command is silent (here a learning rate given only at the start),
    and one the command sets explicitly changes and is recorded. Reference: the uninterrupted run's rates."""
    assert main(tmp_path / "whole", "train.steps=4", "train.lr=0.02", "train.min_lr_ratio=0.5") == 0
    assert main(tmp_path / "split", "train.steps=2", "train.lr=0.02", "train.min_lr_ratio=0.5") == 0
    capsys.readouterr()
    assert main(tmp_path / "split", "train.steps=4") == 0  # lr and min_lr_ratio left out: the config says others
    err = capsys.readouterr().err
    assert "train.lr=0.02 (the command's config: 0.003)" in err

    def rates(run):
        return [r["train/lr"] for r in read_metrics(run / "metrics.jsonl") if "train/lr" in r]
    assert rates(tmp_path / "split")[2:] == rates(tmp_path / "whole")[2:]  # steps 3-4: the schedule stretched to 4
    [entry] = yaml.safe_load((tmp_path / "split" / "resume_changes.yaml").read_text())
    assert set(entry["changes"]) == {"train.steps"}  # the one change the command made, recorded
    assert yaml.safe_load((tmp_path / "split" / "config.yaml").read_text())["train"]["lr"] == 0.02
