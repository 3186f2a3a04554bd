"""README's context-parallel example runs as written, and its banner counts every rank it runs on."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import launch

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "train.global_batch_size=4", "train.warmup_steps=0",
        "train.steps=2", "train.eval_interval=0", "train.eval_batches=1", "logging.wandb=disabled",
        "logging.progress=lines", "logging.plots=false", "checkpoint.interval=null", "checkpoint.final=false",
        f"data.cache_dir={ROOT / '.cache' / 'data'}"]


def readme_command() -> list[str]:
    """The command README's "Long sequences" line gives, its words as a shell would split them."""
    text = " ".join((ROOT / "README.md").read_text().split())
    found = re.search(r"\*\*Long sequences\*\*: `(python launch\.py [^`]+)`", text)
    assert found, "README's Long sequences line gives no launch.py command"
    return shlex.split(found.group(1))


def test_readmes_cp_example_passes_every_check_and_the_default_config_says_why_not():
    command = readme_command()
    assert command[:2] == ["python", "launch.py"] and "parallel.cp=4" in command
    assert launch.precheck(launch.get_args_parser().parse_args(command[2:])) is None
    default = [word for word in command[2:] if word not in ("--config", "dropless")]  # the moe-8x default
    message = launch.precheck(launch.get_args_parser().parse_args(default))
    assert "moe.capacity_factor=1.25" in message and "moe.capacity_factor=null" in message


def test_readmes_cp_example_trains_and_its_banner_counts_the_four_ranks(tmp_path):
    """The command as README writes it (python: this interpreter; its files from the repository), with the
    model and run made tiny by --set."""
    command = readme_command()
    command = [sys.executable, str(ROOT / "launch.py"), *command[2:]]
    command[command.index("train.py")] = str(ROOT / "train.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*command, *TINY], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "= 1 data-parallel rank(s) x 1 micro-batch(es) of 4; 4 ranks: " in done.stderr
    assert "cp=4" in done.stderr.split("4 ranks: ")[1].splitlines()[0]
    assert "done: 2 steps" in done.stderr
