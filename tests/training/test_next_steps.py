"""The next steps a finished run prints run as printed, in a new shell (no virtual environment activated, only the
system's PATH), from the folder the run was started in: the person pastes them, so the test does too."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import train
from config.cli import shell_command

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "train.global_batch_size=4", "train.warmup_steps=0",
        "train.precision=fp32", "train.eval_interval=0", "train.eval_batches=1", "logging.wandb=disabled",
        "logging.progress=lines", "train.steps=2", "logging.plots=false", "data.source=corpus.txt",
        "data.cache_dir=cache"]


def new_shell() -> dict[str, str]:
    """A login shell's environment: the system PATH only (no .venv/bin), and PYTHONPATH where the tests use one
    (a worktree whose editable install points elsewhere)."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def test_the_next_steps_a_run_prints_run_as_printed_in_a_new_shell(tmp_path, monkeypatch, capsys):
    (tmp_path / "corpus.txt").write_text((ROOT / "README.md").read_text() * 3)
    (tmp_path / "held_out.txt").write_text((ROOT / "docs" / "journeys.md").read_text()[:2000])
    monkeypatch.chdir(tmp_path)
    assert train.main(["--run-dir", "runs/tiny", "--set", *TINY]) == 0
    lines = capsys.readouterr().err.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("next steps"))
    commands = [line.strip() for line in lines[start + 1:start + 4]]
    assert [shlex.split(c)[1] for c in commands] == ["runs/tiny"] * 2 + ["runs/tiny/checkpoints"]
    script = " && ".join(c.replace("FILE", "held_out.txt") for c in commands)  # the word the message says to replace
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=new_shell(), capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, (script, done.stderr)
    assert "perplexity" in done.stdout and (tmp_path / "runs/tiny/model.safetensors").is_file()
    assert train.main(["--run-dir", "runs/tiny", "--set", *TINY]) == 0  # again: complete, with the same steps
    again = capsys.readouterr().err
    assert "is complete" in again and all(command in again for command in commands)


def test_a_command_is_its_path_beside_the_python_unless_a_new_shell_finds_it(tmp_path, monkeypatch):
    """``make train`` runs .venv/bin/python from the repository: the command is .venv/bin/moe-generate there."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").touch()
    (bin_dir / "moe-generate").touch(mode=0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    assert shell_command("moe-generate", "inference.generate") == ".venv/bin/moe-generate"
    assert shell_command("moe-evaluate", "inference.evaluate") == ".venv/bin/python -m inference.evaluate"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("VIRTUAL_ENV", str(tmp_path / ".venv"))  # activated in this shell only
    assert shell_command("moe-generate", "inference.generate") == ".venv/bin/moe-generate"
    monkeypatch.delenv("VIRTUAL_ENV")  # on the PATH of every shell
    assert shell_command("moe-generate", "inference.generate") == "moe-generate"
