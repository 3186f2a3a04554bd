"""Fault cases of the command lines: each bad input is one clear message on stderr, a known exit status, and no
traceback, before any work (issue 15). Seconds each; the ``train.py`` cases run in this process through
``train.main`` with a tiny model, the CLIs and torchrun as subprocesses where the process's own exit is the point.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train
from tests.training.test_data_loss import TINY

ROOT = Path(__file__).resolve().parents[1]


def refused(capsys, argv, message, status=2):
    """``train.main(argv)`` exits ``status`` with one message holding ``message`` and no traceback."""
    assert train.main(argv) == status
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err


def run_cli(*args, status=2, message=""):
    """``python -m ...args`` exits ``status`` with ``message`` on stderr and no traceback; its stderr."""
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


# --- data: refused when the data is opened, before the model exists ---------------------------------------------


def corpus(tmp_path, size):
    folder = tmp_path / "corpus"
    folder.mkdir(exist_ok=True)
    (folder / "a.txt").write_bytes((bytes(range(32, 127)) * (size // 95 + 1))[:size])
    return folder


def test_a_validation_split_shorter_than_a_window_is_refused_before_training(tmp_path, capsys, monkeypatch):
    import training.loop
    monkeypatch.setattr(training.loop, "build_model", lambda *a, **k: pytest.fail("built the model"))
    # 20,000 tokens: 100 of them validation, fewer than seq_len + 1 = 129; the training split would do
    refused(capsys, ["--run-dir", str(tmp_path / "r"), "--set", *TINY, "model.seq_len=128",
                     f"data.source={corpus(tmp_path, 19998)}", "data.val_fraction=0.005"],
            "the validation split has 100 tokens, fewer than model.seq_len + 1 = 129")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_seq_len_far_beyond_the_data_is_refused_before_training(tmp_path, capsys, monkeypatch):
    import training.loop
    monkeypatch.setattr(training.loop, "build_model", lambda *a, **k: pytest.fail("built the model"))
    refused(capsys, ["--run-dir", str(tmp_path / "r"), "--set", *TINY, "model.seq_len=100000",
                     f"data.source={corpus(tmp_path, 5000)}"],
            "the training split has 4,977 tokens, fewer than model.seq_len + 1 = 100,001")


def test_token_ids_beyond_the_vocabulary_are_refused_naming_file_id_and_vocab_and_scanned_once(tmp_path, capsys,
                                                                                               monkeypatch):
    import training.loop
    monkeypatch.setattr(training.loop, "build_model", lambda *a, **k: pytest.fail("built the model"))
    ids = np.arange(20000, dtype=np.uint16) % 300
    ids[7777] = 4321
    source = tmp_path / "tokens.bin"
    ids.tofile(source)
    argv = ["--run-dir", str(tmp_path / "r"), "--set", *TINY, f"data.source={source}", "data.token_dtype=uint16",
            f"data.cache_dir={tmp_path / 'cache'}"]
    message = f"{source} holds token id 4321, outside model.vocab_size=256"
    refused(capsys, argv, message)
    assert len(list((tmp_path / "cache").glob("maxid-*.json"))) == 1
    monkeypatch.setattr(np.memmap, "max", lambda *a, **k: pytest.fail("scanned the file again"))
    refused(capsys, argv, message)  # the cached largest id
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


# --- the analysis CLIs: every numeric flag checked, suggestions that pass train.py's own checks ------------------


def cli_refused(capsys, main, argv, message):
    """``main(argv)`` of a CLI exits 2 with one message holding ``message``, no traceback, nothing on stdout."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert message in err, err
    assert "Traceback" not in err and err.count("error:") == 1 and not out, (out, err)
    return err


@pytest.mark.parametrize(("argv", "message"), [
    (["--device-memory", "-1"], "--device-memory must be a positive number of GiB, got -1.0"),
    (["--device-memory", "nan"], "--device-memory must be a positive number of GiB, got nan"),
    (["--world-size", "0"], "--world-size must be at least 1, got 0"),
    (["--sweep-experts", "8,x"], "--sweep-experts '8,x': give positive expert counts"),
    (["--sweep-experts", "8,3", "--world-size", "2", "--set", "parallel.ep=2"],
     "parallel.ep=2 does not divide moe.num_experts=3"),
])
def test_the_memory_tool_refuses_bad_flags_naming_them(capsys, argv, message):
    from analysis import memory
    cli_refused(capsys, memory.main, argv, message)


@pytest.mark.parametrize(("argv", "message"), [
    (["--world-size", "8", "--top", "-1"], "--top must be at least 1, got -1"),
    (["--world-size", "8", "--device-memory", "nan"], "--device-memory must be a positive number of GiB, got nan"),
    (["--world-size", "8", "--device-memory", "-80"], "--device-memory must be a positive number of GiB, got -80.0"),
    (["--world-size", "8", "--efficiency", "nan"], "--efficiency must be in (0, 1], got nan"),
    (["--world-size", "8", "--gpus-per-node", "0"], "--gpus-per-node must be at least 1, got 0"),
    (["--world-size", "0"], "--world-size must be at least 1, got 0"),
    # not "add GPUs": the batch of 16 splits over no data-parallel degree of 9 GPUs but 1, and tp=9 cannot
    # split the sequence of 256
    (["--world-size", "9"], "no layout of 9 GPUs passes train.py's checks for this config, e.g. "
                            "train.global_batch_size=16 must be divisible by the 9 data-parallel ranks"),
    # a fixed degree no layout has: the values it could take
    (["--world-size", "8", "--set", "parallel.tp=3"], "parallel.tp=3: no valid layout of 8 GPUs for this model has "
                                                      "that degree; valid: parallel.tp in [1, 2]"),
])
def test_the_planner_refuses_bad_flags_and_says_why_no_layout_is_possible(capsys, argv, message):
    from analysis import planner
    cli_refused(capsys, planner.main, argv, message)


@pytest.mark.parametrize(("argv", "message"), [
    (["--world-size", "0"], "--world-size must be at least 1, got 0"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be at least 1, got 0"),
    (["--rank", "-1"], "--rank -1 is outside the world of 8 ranks"),
])
def test_the_communication_tool_refuses_bad_flags_naming_them(capsys, argv, message):
    from analysis import communication
    cli_refused(capsys, communication.main, argv, message)


def test_a_refused_layout_suggests_only_layouts_that_train_py_accepts(capsys):
    from analysis import memory
    from config.run import load_config
    from parallel.resolve import resolve_layout
    # 9 ranks, tp=2: the layouts of 9 ranks that ignore the model include tp=3 ep=3 (8 experts) and pp=9 (4 layers)
    for settings in (["parallel.ep=2", "parallel.tp=2", "train.global_batch_size=9"],
                     ["parallel.pp=2", "train.global_batch_size=9"], ["parallel.ep=4", "train.global_batch_size=9"]):
        err = cli_refused(capsys, memory.main, ["--world-size", "9", "--set", *settings], "valid")
        suggested = [part for part in err.split(": ")[-1].strip().split("; ")]
        assert suggested and "ep=3" not in err and "pp=9" not in err, err
        for degrees in suggested:
            if "=" not in degrees:  # "valid ep ...: 1" lists values of one key
                continue
            overrides = [f"parallel.{pair}" for pair in degrees.split()]
            resolve_layout(load_config("moe-8x", [*settings, *overrides]), 9)  # accepted
    # no layout of 9 ranks splits the default batch of 16: the message says so instead of suggesting one
    cli_refused(capsys, memory.main, ["--world-size", "9", "--set", "parallel.tp=2"],
                "no layout of 9 ranks fits this model and run (e.g. train.global_batch_size=16 must be divisible")


# --- files the analysis CLIs and the export read or write ---------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny run with one checkpoint (two steps)."""
    run_dir = tmp_path_factory.mktemp("run") / "run"
    assert train.main(["--run-dir", str(run_dir), "--set", *TINY, "train.steps=2", "checkpoint.interval=2"]) == 0
    return run_dir


def test_the_router_probe_refuses_weights_that_are_not_this_runs_model(trained_run, tmp_path, capsys):
    import torch

    from analysis import router
    junk = tmp_path / "junk.pt"
    junk.write_text("hello\n")
    wrong = tmp_path / "wrong.pt"
    torch.save({"x": torch.zeros(3)}, wrong)
    state = router.build_model(router.load_run_config(trained_run)).state_dict()
    state["norm.weight"] = torch.zeros(7)
    shape = tmp_path / "shape.pt"
    torch.save(state, shape)
    bad_safetensors = tmp_path / "junk.safetensors"
    bad_safetensors.write_text("junk")
    probe = ["probe", "--run", str(trained_run), "--out", str(tmp_path / "p.npz"), "--weights"]
    for weights, message in [(junk, f"--weights {junk}: {junk} is not a torch.save'd state dict"),
                             (wrong, "the weights do not fit the run's model: 25 of the model's tensors missing"),
                             (shape, "1 of another shape (first: norm.weight (7,) (the run's model: (32,)))"),
                             (bad_safetensors, f"{bad_safetensors} is not a readable .safetensors file")]:
        cli_refused(capsys, router.main, [*probe, str(weights)], message)
    for argv, message in [(["probe", "--run", str(trained_run), "--tokens", "0"], "--tokens 0: must be a positive"),
                          (["probe", "--run", str(trained_run), "--out", "/proc/p.npz"], "--out /proc/p.npz: cannot"),
                          (["probe", "--run", str(trained_run), "--text", str(tmp_path / "none")], "--text"),
                          (["summary", str(trained_run), "--last", "-1"], "--last -1: must be at least 1")]:
        cli_refused(capsys, router.main, argv, message)


@pytest.mark.parametrize("text", ["model: [unclosed\n", "- 1\n", "model: {d_model: many}\n", "\xff\xfe"])
def test_a_garbled_config_yaml_in_a_run_directory_is_one_message(trained_run, tmp_path, capsys, text):
    import shutil

    from analysis import router
    garbled = tmp_path / "garbled"
    shutil.copytree(trained_run, garbled)
    (garbled / "config.yaml").write_bytes(text.encode("latin-1"))
    for argv in (["probe", "--run", str(garbled)], ["summary", str(garbled)]):
        err = cli_refused(capsys, router.main, argv, f"{garbled / 'config.yaml'} is not a run's resolved config")
        assert err.count("\n") == 1


def test_an_export_to_a_path_that_cannot_be_written_is_one_message_and_leaves_nothing(trained_run, tmp_path):
    checkpoints = str(trained_run / "checkpoints")
    for out, message in [("/proc/x.safetensors", "cannot write /proc/x.safetensors"),
                         (str(tmp_path / "none" / "x.safetensors"), "its folder"),
                         (str(tmp_path), "is a folder")]:
        run_cli("-m", "interop.export", checkpoints, out, message=message)
    assert not list(tmp_path.glob(".*partial"))


def test_exporting_a_checkpoint_that_a_running_job_prunes_is_one_message(trained_run, tmp_path, capsys,
                                                                         monkeypatch):
    import shutil

    import interop.export
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(trained_run / "checkpoints", checkpoints)
    real_load, reads = interop.export.dcp.load, []

    def load(*args, **kwargs):  # the job prunes the checkpoint after the export read its first tensor
        reads.append(1)
        if len(reads) == 2:
            shutil.rmtree(checkpoints / "step_0000002")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(interop.export.dcp, "load", load)
    out = tmp_path / "model.safetensors"
    cli_refused(capsys, interop.export.main, [str(checkpoints), str(out)],
                f"{checkpoints / 'step_0000002'} disappeared while it was read")
    assert not out.exists() and not list(tmp_path.glob(".*partial"))


def test_outputs_are_replaced_only_when_asked_and_never_over_the_commands_input(trained_run, tmp_path, capsys):
    from data.tokenizer import main as tokenizer_cli
    from interop.export import main as export_cli
    from interop.hf import main as hf_cli
    from interop.upcycle import main as upcycle_cli

    checkpoints, out = str(trained_run / "checkpoints"), tmp_path / "model.safetensors"
    assert export_cli([checkpoints, str(out)]) == 0
    first = out.read_bytes()
    cli_refused(capsys, export_cli, [checkpoints, str(out)], f"{out} exists; pass --overwrite to replace it")
    assert out.read_bytes() == first
    assert export_cli([checkpoints, str(out), "--overwrite"]) == 0
    capsys.readouterr()
    cli_refused(capsys, export_cli, [checkpoints, str(trained_run / "checkpoints" / "latest"), "--overwrite"],
                "would replace a file of the input")

    hf = tmp_path / "hf"  # import --out over the folder's own weights: refused even with --overwrite
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"the original weights")
    for extra in ([], ["--overwrite"]):
        cli_refused(capsys, hf_cli, ["import", str(hf), "--out", str(hf / "model.safetensors"), *extra],
                    f"would replace a file of the input {hf.resolve()}")
    assert (hf / "model.safetensors").read_bytes() == b"the original weights"
    exported = tmp_path / "exported"  # an HF export into a folder that holds files
    exported.mkdir()
    (exported / "notes.txt").write_text("mine")
    cli_refused(capsys, hf_cli, ["export", checkpoints, "--out", str(exported)], f"{exported} exists")

    mine = tmp_path / "mine.yaml"  # upcycling's --out mine.safetensors also writes mine.yaml
    mine.write_text("my own config\n")
    cli_refused(capsys, upcycle_cli, [checkpoints, "--experts", "4", "--top-k", "2", "--out",
                                      str(tmp_path / "mine.safetensors")], f"{mine} exists")
    assert mine.read_text() == "my own config\n" and not (tmp_path / "mine.safetensors").exists()

    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text("{}")
    cli_refused(capsys, tokenizer_cli, ["train", "--vocab-size", "300", "--out", str(tokenizer)], f"{tokenizer} exists")
    assert tokenizer.read_text() == "{}"


# --- under torchrun ----------------------------------------------------------------------------------------------


def torchrun(launcher, *args, env_extra=None):
    import os
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, *launcher, "--standalone", "--nproc-per-node", "2", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, env=env)


def test_launch_py_keeps_a_user_errors_one_message_and_exit_2_where_torchrun_gives_a_traceback(tmp_path):
    # a bad value: refused before any worker starts
    done = torchrun(["launch.py"], "train.py", "--run-dir", str(tmp_path / "r"), "--set", "train.steps=-3")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "error: train.steps must be >= 1, got -3", done.stderr
    assert not (tmp_path / "r").exists()
    # bad data, found by every worker after joining the job: the first rank's message, once, and exit 2
    source = corpus(tmp_path, 5000)
    done = torchrun(["launch.py"], "train.py", "--run-dir", str(tmp_path / "r"), "--set", *TINY,
                    "model.seq_len=100000", f"data.source={source}", f"data.cache_dir={tmp_path / 'cache'}")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    assert done.stderr.count("error:") == 1 and "the training split has 4,977 tokens" in done.stderr, done.stderr
    # plain torchrun: the worker's message once, then torchrun's own report and exit 1 (docs/configuration.md says so)
    done = torchrun(["-m", "torch.distributed.run"], "train.py", "--set", "train.steps=-3")
    assert done.returncode == 1 and done.stderr.count("error: train.steps must be >= 1, got -3") == 1, done.stderr


def test_launch_py_reports_a_crashed_worker_without_a_traceback_and_exit_1(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nsys.exit(13)\n")
    done = torchrun(["launch.py"], str(crash))
    assert done.returncode == 1, done.stderr
    assert "error: a worker failed (exit status 13)" in done.stderr and "Traceback" not in done.stderr, done.stderr


# --- beyond the list: other files the CLIs read --------------------------------------------------------


def test_missing_init_from_resume_and_config_paths_are_refused_before_the_run_directory_is_made(tmp_path, capsys):
    run_dir = tmp_path / "r"
    for argv, message in [(["--init-from", str(tmp_path / "none.safetensors")], "--init-from"),
                          (["--resume", str(tmp_path / "none")], f"--resume {tmp_path / 'none'}: no such folder"),
                          (["--config", str(tmp_path)], "is a folder; give a YAML file or a config name"),
                          (["--dry-run", "--world-size", "0"], "--world-size must be at least 1, got 0")]:
        refused(capsys, ["--run-dir", str(run_dir), *argv], message)
        assert not run_dir.exists()


def test_damaged_metrics_or_routing_files_of_a_run_are_one_message_naming_them(trained_run, tmp_path, capsys):
    import shutil

    from analysis import router
    for damage, message in [(lambda run: (run / "metrics.jsonl").write_text(""), "logged no training interval"),
                            (lambda run: (run / "metrics.jsonl").open("a").write("{garbage\n"), "metrics.jsonl:"),
                            (lambda run: (run / "routing" / "step.npy").write_text("junk"),
                             "step.npy is not a routing statistics column")]:
        run = tmp_path / "damaged"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(trained_run, run)
        damage(run)
        cli_refused(capsys, router.main, ["summary", str(run)], message)


@pytest.mark.parametrize(("damage", "message"), [
    (lambda run: (run / "resume_changes.yaml").write_text("[unclosed\n"), "resume_changes.yaml is damaged"),
    (lambda run: (run / "metrics.jsonl").open("a").write("{garbage\n"), "metrics.jsonl:5 is not a metrics record"),
])
def test_resuming_in_a_run_directory_with_damaged_logs_is_one_message_naming_the_file(trained_run, tmp_path, capsys,
                                                                                     damage, message):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "run.lock").unlink()
    damage(run)
    refused(capsys, ["--run-dir", str(run), "--set", *TINY, "train.steps=3", "checkpoint.interval=2"], message)


# --- torchrun's environment variables, set by hand ------------------------------------------------------------------


@pytest.mark.parametrize("env, message", [
    ({"LOCAL_RANK": "abc"}, "environment variable LOCAL_RANK='abc' must be an integer >= 0"),
    ({"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE='0' must be an integer >= 1"),
    ({"RANK": "0"}, "environment variable RANK is set but MASTER_ADDR and MASTER_PORT not"),
    ({"RANK": "4", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "environment variable RANK=4 is not below WORLD_SIZE=2"),
])
def test_stray_torchrun_variables_are_one_message_naming_them(tmp_path, capsys, monkeypatch, env, message):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    refused(capsys, ["--run-dir", str(tmp_path / "run"), "--set", *TINY], message)
    assert not (tmp_path / "run").exists()


def test_a_user_error_is_said_by_a_process_with_a_stray_local_rank(tmp_path, capsys, monkeypatch):
    """Only a node's later ranks of a torchrun job stay quiet (LOCAL_WORLD_SIZE > 1): a LOCAL_RANK left in a shell
    must not silence the one process there is."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    refused(capsys, ["--run-dir", str(tmp_path / "run"), "--set", *TINY, "train.steps=0"], "train.steps must be >= 1")
