"""A long sequence trained on ranks that each hold a slice of it: memory per rank and step time against one process.

Trains ``--config`` (default ``moe-8x``) at ``--seq-len`` positions (default 16,384), one sequence per step, for
``--steps`` steps twice, with ``train.py`` as a user would:

- ``torchrun --standalone --nproc-per-node 4 train.py --set parallel.cp=4 ...``: context parallelism, each rank
  holding 1/4 of the sequence (two chunks, one from each end), attention gathering the keys and values of all
  four in every layer, FSDP over the four;
- ``python train.py ...``: one process, the whole sequence.

and prints each rank's training memory (the live tensor peak less the tensors held before the model, as
``benchmarks/large_model.py`` measures it), the step time (the median over the steps after the first, from
``perf/tokens_per_s`` at a log interval of 1) and the first and last losses, which agree between the two runs
(the same sequences, the same model). Dropless routing: capacity-limited routing is not served under cp.
A measurement on shared CPU cores, never a pass/fail test (``tests/parallel/test_context.py`` and the parity rows
check the numbers).

    python benchmarks/context_parallel.py [--config moe-8x] [--seq-len 16384] [--nproc 4] [--steps 4]
                                          [--set key=value ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.large_model import measured, train  # noqa: E402
from training.metrics import read_metrics  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="moe-8x")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE",
                        help="extra overrides for both runs")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    common = [f"model.seq_len={args.seq_len}", "train.global_batch_size=1", f"train.steps={args.steps}",
              "train.warmup_steps=1", "train.eval_interval=0", "train.eval_batches=1", "moe.capacity_factor=null",
              "logging.log_interval=1", "logging.wandb=disabled", "logging.plots=false", *args.overrides]
    runs = (("one process", 1, common), (f"cp={args.nproc}", args.nproc, [*common, f"parallel.cp={args.nproc}"]))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, nproc, overrides in runs:
            run_dir = Path(tmp) / name.replace(" ", "_")
            summary = train(args.config, overrides, nproc, run_dir)
            records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
            step_s = statistics.median(args.seq_len / r["perf/tokens_per_s"] for r in records[1:])
            rows[name] = {"measured_gib": measured(summary), "step_s": step_s,
                          "losses": [records[0]["train/loss"], records[-1]["train/loss"]]}
    one = rows["one process"]
    print(f"{args.config} at {args.seq_len:,} positions, one sequence per step: training memory per rank (live "
          "tensor peak less the tensors before the model) and step time")
    print(f"{'run':<13}{'rank':>5}{'GiB':>8}{'vs one process':>16}{'step s':>9}{'vs one process':>16}"
          f"{'first loss':>12}{'last loss':>11}")
    for name, row in rows.items():
        for rank, gib in enumerate(row["measured_gib"]):
            print(f"{name:<13}{rank:>5}{gib:>8.2f}{gib / one['measured_gib'][0]:>16.2f}{row['step_s']:>9.2f}"
                  f"{row['step_s'] / one['step_s']:>16.2f}{row['losses'][0]:>12.4f}{row['losses'][1]:>11.4f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
