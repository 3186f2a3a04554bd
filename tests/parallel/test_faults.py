"""Faults under torchrun: a rank killed with SIGKILL, in training and in the middle of a save.

``torchrun --max-restarts 1`` restarts the whole job when a worker dies; ``train.py`` run again in the same
run directory resumes from the newest complete checkpoint. The job must then finish with exactly the losses
of an uninterrupted run (same layout, ep=2 on 2 gloo processes: bit for bit), and a save cut short must
leave the previous checkpoint intact and be the one resumed.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.parallel.parity import TINY
from training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [*TINY, "train.steps=24", "checkpoint.interval=4", "moe.capacity_factor=null",
            "parallel.dp_shard=2", "parallel.ep=2"]


def torchrun(run_dir: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "train.py", "--run-dir", str(run_dir), "--set", *SETTINGS, *extra]
    # pytorch/pytorch#135712: workers sharing the rendezvous TCPStore read the previous attempt's addresses after
    # a restart; a store per attempt avoids it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(job: subprocess.Popen) -> str:
    try:
        output = job.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("torchrun did not finish in 300 s")
    assert job.returncode == 0, output[-3000:]
    return output


def worker_of_rank(job: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's worker process with RANK=rank."""
    children = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no worker with RANK={rank} among {children}")


def wait_for(condition, job: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"gave up waiting (torchrun exit status {job.returncode}): {job.communicate()[0][-3000:]}")
        time.sleep(0.002)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[tuple[int, float]]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    finish(torchrun(run_dir))
    return losses(run_dir)


def test_killed_rank_is_restarted_and_the_run_finishes_as_if_uninterrupted(uninterrupted, tmp_path):
    job = torchrun(tmp_path, "checkpoint.async_save=true")
    wait_for(lambda: (tmp_path / "checkpoints" / "step_0000008").exists(), job)
    os.kill(worker_of_rank(job, 1), signal.SIGKILL)
    output = finish(job)
    assert "resumed from" in output, output[-3000:]
    assert losses(tmp_path) == uninterrupted
    assert [step for step, _ in uninterrupted] == list(range(1, 25))


def saving(checkpoints: Path) -> int | None:
    """The step of a save in progress from step 8 on (its temporary folder exists), else None."""
    steps = [int(p.name.rsplit("_", 1)[1]) for p in checkpoints.glob(".tmp_step_*")] if checkpoints.is_dir() else []
    return next((step for step in steps if step >= 8), None)


def test_killed_while_saving_keeps_the_previous_checkpoint_and_resumes_it(uninterrupted, tmp_path):
    job = torchrun(tmp_path)
    wait_for(lambda: saving(tmp_path / "checkpoints") is not None, job)  # saves at 8, 12, ...: several chances
    os.kill(worker_of_rank(job, 0), signal.SIGKILL)  # rank 0 publishes: this save can no longer become visible
    step = saving(tmp_path / "checkpoints")
    output = finish(job)
    previous = step - 4
    assert f"resumed from {tmp_path}/checkpoints/step_{previous:07d} at step {previous}" in output, output[-3000:]
    assert f".tmp_step_{step:07d}: an incomplete save" in output
    assert losses(tmp_path) == uninterrupted
