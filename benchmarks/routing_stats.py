"""Cost of recording routing statistics, as a share of one training step of a config (default moe-8x).

What is measured, in one process on the config's model and batch (random bytes, fp32 unless --precision):

- ``step``: the fastest of the timed optimizer steps as the training loop runs them (``train_step``: forward, backward,
  clipping, AdamW, bias update), statistics included.
- the recording, in its parts, each timed alone many times:
  ``stats``: one MoE layer's per-pass statistics (``MoELayer._stats``: entropy, top-1 probability,
  choice shares, co-selection, ...), paid by every MoE layer in every micro-batch;
  ``accumulate``: adding one micro-batch's statistics of all layers to the interval's sums;
  ``interval``: once per logging interval, the reduction, the metrics dict and the ``routing/*.npy``
  appends; ``charts``: the wandb bar charts and heatmap (an offline wandb run), once every
  ``logging.router_charts_every`` intervals. Each part is the fastest of many calls, as the step is the
  fastest step, so that a busy machine inflates neither side of the ratio.
- ``parts per step``: their sum per step at the config's logging interval, over ``step``. Timed alone,
  ops this small are at the mercy of the thread pool: on an oversubscribed machine each waits for a
  free core, and the sum overstates the cost (measured: 0.2% to 11% on a shared 2-core box).
- ``in-step``: the time the steps with statistics spent inside ``_stats`` and the accumulation,
  clocked in place, over each such step's time.
- ``recording cost``: in-step plus the per-interval parts per step, over ``step``: the headline
  figure. The goal is <= 2%.
- ``a/b``: a cross-check by whole steps: ``train_step`` with statistics against the same step with
  the statistics switched off (``_stats`` reduced to the expert counts the bias update needs, no
  accumulation), interleaved; the median of per-pair ratios and fastest over fastest. On a busy
  machine it is far noisier than the parts; it does not include the per-interval parts.

This is a measurement, never a pass/fail test.

    python benchmarks/routing_stats.py [--config moe-8x] [--repeats N] [--precision fp32|bf16] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from config.run import load_config
from moe.layer import MoELayer, RoutingStats
from moe.transformer import MoETransformer
from parallel.resolve import micro_batching
from training.metrics import MetricsLogger
from training.optim import build_optimizer
from training.routing_log import RoutingLog, log_routing_charts
from training.routing_stats import RoutingAccumulator, routing_metrics
from training.step import IntervalStats, StepContext, train_step


def _time(fn, repeats: int) -> float:
    """Fastest of ``repeats`` calls of ``fn()`` (after a warm-up call), in seconds: the least disturbed."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)


class _NoInterval:
    """An IntervalStats that accumulates nothing: the 'statistics off' side of the A/B."""

    def add_routing(self, model) -> None:
        pass


def _bare_stats(self, routed, selected, dropped, balance, router_z) -> RoutingStats:
    """Only what ``train_step`` needs (the expert counts for the bias update); everything else a constant."""
    zero = torch.zeros(())
    return RoutingStats(selected, dropped, 0, zero, zero, zero, zero, zero, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="moe-8x")
    parser.add_argument("--repeats", type=int, default=5, help="step pairs for the A/B and for the step time")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", 2)))

    config = load_config(args.config, [f"train.precision={args.precision}"])
    micro, accumulation = micro_batching(config, 1)
    torch.manual_seed(0)
    model = MoETransformer(config.model, config.moe)
    model.set_aux_loss_scale(1.0 / accumulation)
    optimizer = build_optimizer(model, config.train)
    batch = torch.randint(0, config.model.vocab_size, (config.train.global_batch_size, config.model.seq_len + 1))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    autocast = ((lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.precision == "bf16"
                else contextlib.nullcontext)
    context = StepContext(model, optimizer, micro, config.train.grad_clip, autocast)
    step = lambda interval: train_step(context, inputs, targets, interval)  # noqa: E731

    # the A/B by whole steps, interleaved (which side goes first alternates); in the steps with
    # statistics, the time spent inside the per-pass statistics and the accumulation is clocked too
    on, off, in_step = [], [], []
    clock = [0.0]

    def clocked(fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[0] += time.perf_counter() - start
        return wrapper

    step(IntervalStats())
    for r in range(args.repeats):
        for side in ((True, False) if r % 2 == 0 else (False, True)):
            clock[0] = 0.0
            start = time.perf_counter()
            if side:
                with (mock.patch.object(MoELayer, "_stats", clocked(MoELayer._stats)),
                      mock.patch.object(RoutingAccumulator, "add", clocked(RoutingAccumulator.add))):
                    step(IntervalStats())
            else:
                with mock.patch.object(MoELayer, "_stats", _bare_stats):
                    step(_NoInterval())
            (on if side else off).append(time.perf_counter() - start)
            if side:
                in_step.append(clock[0] / on[-1])
    step_s = min(on)
    ab = statistics.median(a / b for a, b in zip(on, off, strict=True))
    ab_best = min(on) / min(off)

    # the parts, each alone: capture one real pass's arguments to _stats
    captured = {}
    original = MoELayer._stats

    def capture(self, *stats_args):
        captured.setdefault("call", (self, stats_args))
        return original(self, *stats_args)

    with mock.patch.object(MoELayer, "_stats", capture), torch.no_grad():
        model(inputs[:micro])
    layer, stats_args = captured["call"]
    per_layer_stats = _time(lambda: layer._stats(*stats_args), 50)
    routing = model.routing_stats()
    accumulator = RoutingAccumulator()
    accumulate = _time(lambda: accumulator.add(routing), 50)

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("WANDB_SILENT", "true")
        logger = MetricsLogger(Path(tmp), {}, "routing-bench", "offline", "moe-bench")
        log = RoutingLog(Path(tmp), logger, charts_every=0)

        def close_interval() -> None:
            reduced = accumulator.reduce()
            routing_metrics(reduced)
            log.append(1, reduced)

        interval = _time(close_interval, 20)
        result = accumulator.reduce()
        charts = _time(lambda: log_routing_charts(logger, 1, result), 3)
        logger.close()

    layers = len(model.moe_layers())
    every, charts_every = config.logging.log_interval, config.logging.router_charts_every
    per_interval = interval / every + (charts / (every * charts_every) if charts_every else 0.0)
    per_step = (per_layer_stats * layers + accumulate) * accumulation + per_interval
    in_step_fraction = statistics.median(in_step)
    total_fraction = in_step_fraction + per_interval / step_s
    figures = {
        "config": args.config, "precision": args.precision, "threads": torch.get_num_threads(),
        "moe_layers": layers, "micro_batches": accumulation, "log_interval": every, "charts_every": charts_every,
        "step_s": step_s, "stats_per_layer_s": per_layer_stats, "accumulate_s": accumulate,
        "interval_s": interval, "charts_s": charts, "overhead_per_step_s": per_step,
        "overhead_fraction": per_step / step_s, "ab_ratio": ab, "ab_best_ratio": ab_best,
        "in_step_fraction": in_step_fraction, "total_fraction": total_fraction,
        "steps_on_s": on, "steps_off_s": off,
    }
    print(f"{args.config} ({args.precision}, {figures['threads']} threads): step {step_s * 1e3:.0f} ms; "
          f"{layers} MoE layers x {accumulation} micro-batch(es), log every {every} steps, charts every "
          f"{charts_every} logs")
    print(f"  stats per layer pass {per_layer_stats * 1e6:8.1f} us")
    print(f"  accumulate per micro  {accumulate * 1e6:8.1f} us")
    print(f"  per interval          {interval * 1e3:8.2f} ms (reduce, metrics, routing/*.npy)")
    print(f"  charts                {charts * 1e3:8.1f} ms (wandb offline: bar charts, heatmap)")
    print(f"  parts per step        {per_step * 1e3:8.2f} ms = {100 * per_step / step_s:.2f}% of a step "
          "(isolated timings of tiny ops; inflated where threads wait for a busy core)")
    print(f"  in-step clock         {100 * in_step_fraction:8.3f}% of each step inside the statistics "
          "and their accumulation (median over the steps with statistics)")
    print(f"  recording cost        {100 * total_fraction:8.3f}% of a step: in-step clock + per-interval parts "
          "(goal <= 2%)")
    print(f"  a/b whole steps       {ab:8.3f} (with / without statistics, median of {args.repeats} pairs; "
          f"fastest over fastest {ab_best:.3f})")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
