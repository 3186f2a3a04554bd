"""A model too large for one small process, trained on 4 ranks that each hold a quarter: measured memory per rank.

Trains ``--config`` (default ``moe-large``: 260M parameters, 4.2 GB of fp32 weights, gradients and AdamW
moments) for its few steps twice, with ``train.py`` as a user would:

- ``torchrun --standalone --nproc-per-node 4 train.py --config moe-large --set parallel.ep=4`` (FSDP over
  4 ranks, each MoE layer's 8 experts split 2 per rank; the model built on the meta device, each rank
  allocating only its shards);
- ``python train.py --config moe-large``: one process, the whole model.

and prints, per rank, the peak memory the run logged (``perf/memory_peak_gib_per_rank`` in summary.json: on a
CPU the live tensor peak of the steps it measures, ``training/live_memory.py``) less what the process held just
before building the model (``perf/memory_before_model_gib_per_rank``), and its resident peak,
beside the memory model's prediction for that rank (``analysis.memory``: the larger of forward/backward's
peak and the optimizer step's). A measurement,
never a pass/fail test: the checks ``make test`` runs are in tests/parallel/test_materialize.py.

    python benchmarks/large_model.py [--config moe-large] [--nproc 4] [--set key=value ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis.memory import GIB, estimate  # noqa: E402
from config.run import load_config  # noqa: E402
from parallel.hardware import planned_precision  # noqa: E402


def train(config: str, overrides: list[str], nproc: int, run_dir: Path) -> dict:
    """Run ``train.py`` (under torchrun when ``nproc > 1``) and return its summary.json."""
    # no checkpoints: a save's staging and time are not what this measures (the default saves after step 1 and at
    # the end)
    args = ["train.py", "--config", config, "--run-dir", str(run_dir), "--resume", "none",
            "--set", "checkpoint.interval=null", "checkpoint.final=false", *overrides]
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
               if nproc > 1 else [sys.executable, *args])
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def measured(summary: dict) -> list[float]:
    """Each rank's training memory, GiB: its peak less what it held before the model was built."""
    peaks, before = summary["perf/memory_peak_gib_per_rank"], summary["perf/memory_before_model_gib_per_rank"]
    return [peak - base for peak, base in zip(peaks, before, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="moe-large")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE",
                        help="extra overrides for both runs")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    parallel = [*args.overrides, f"parallel.ep={args.nproc}"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = (("one process", 1, args.overrides), (f"{args.nproc} ranks", args.nproc, parallel))
        for name, nproc, overrides in runs:
            config = load_config(args.config, overrides)
            summary = train(args.config, overrides, nproc, Path(tmp) / name.replace(" ", "_"))
            predicted = estimate(config, nproc, planned_precision(config.train.precision)).total / GIB
            rows[name] = {"measured_gib": measured(summary), "predicted_gib": predicted,
                          "resident_gib": summary["perf/memory_resident_peak_gib"], "loss": summary["train/loss"]}
    one = rows["one process"]["measured_gib"][0]
    print(f"{args.config}: training memory per rank (live tensor peak less the tensors before the model), GiB")
    print(f"{'run':<14}{'rank':>5}{'measured':>10}{'predicted':>11}{'error':>8}{'vs one process':>16}"
          f"{'resident (largest rank)':>25}{'final loss':>12}")
    for name, row in rows.items():
        for rank, gib in enumerate(row["measured_gib"]):
            error = 100 * (gib - row["predicted_gib"]) / row["predicted_gib"]
            print(f"{name:<14}{rank:>5}{gib:>10.2f}{row['predicted_gib']:>11.2f}{error:>+7.1f}%{gib / one:>16.2f}"
                  f"{row['resident_gib']:>25.2f}{row['loss']:>12.4f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
