"""Does the planner order layouts as they run? Its estimate against measured step times, on this machine's CPU.

The planner's step estimate (``analysis.layout_search.evaluate``, the same code that ranks GPU layouts) is given a
preset of this machine built from measured figures, for each world size (4 and 8 gloo processes by default):

- **matmul FLOP/s alone**: the config's own matmuls (``step_time.block_gemms`` of each kind of block on one
  micro-batch, and the head: forward, input gradient and weight gradient) in one process, one thread as
  ``train.py`` runs under torchrun;
- **the efficiency**: one process trains the config alone (``train.py``, one thread); the step's training
  FLOPs over its time, as a fraction of the matmuls' rate alone, is what the planner's ``efficiency`` is on a
  GPU (``step_time.calibrated_efficiency``: one measured step, the element-wise work, routing and optimizer
  included), measured once and used for every layout and world size;
- **sharing**: n one-process trainings at once, each on an n-th of the global batch (``shared_step``): a
  data-parallel rank's compute, shared as on n ranks, with nothing to exchange. Their step over an n-th of the
  step alone is the preset's ``sharing``, and the matmul rate alone over it the rate per rank. Above 1, a
  pipeline's idle ranks leave their cores to the busy ones (``step_time.bubble_seconds``,
  ``step_time.shared_balance``) and no traffic hides behind compute (``step_time.exposed_communication``). Measured
  on whole steps, not on matmuls alone: switching between processes and their contention for caches cost more
  in a step (on 8 processes of 2 cores, about 4.9 against 4.25 for matmuls alone);
- **gloo bandwidth and latency** (``measure_machine``): the collectives the layouts use (all-reduce,
  all-gather, reduce-scatter, all-to-all, pairwise send/recv). A small buffer's call is timed after the compute
  a step runs between two calls, as its cost beyond that compute: on shared cores the ranks drift apart while
  they compute, and a call waits for the last. The bandwidth is a large buffer's extra bus bytes
  (``traffic_items.bus_bytes``) over their extra time in a loop of calls alone; the latency
  (``gpu_presets.Latency``) is fitted by least squares to the small buffers' times under load with the
  ring-step counts of ``link_time.ring_steps`` (a call's cost and one per step). One figure each for the
  whole world size: the planner has one link here, as on a GPU node.

Then every layout of ``LAYOUTS`` trains ``--config`` for ``--warmup`` + ``--steps`` steps with
``train.py`` under torchrun (fp32, one thread per rank), the layouts interleaved over ``--rounds`` rounds,
and its step time is the median of the measured steps (``perf/tokens_per_s`` at a log interval of 1: the
step and its per-step logging). The table lists predicted against measured per layout, the error, and
Spearman's rank correlation of the two orders per world size. A measurement, never a pass/fail test
(tests/benchmarks/test_layout_ranking.py checks its plumbing).

    python benchmarks/layout_ranking.py [--config moe-8x] [--set KEY=VALUE ...] [--worlds 4 8] [--steps 4]
                                        [--warmup 2] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from analysis import gpu_presets, layout_search, link_time, step_time, traffic_items  # noqa: E402
from config.run import RunConfig, load_config  # noqa: E402
from parallel.layout import Layout  # noqa: E402
from parallel.resolve import resolve_layout  # noqa: E402
from parallel.runtime import free_port  # noqa: E402

# The config's settings every layout shares: a step of about a second on 2 cores.
BASE = ["train.global_batch_size=32", "train.precision=fp32"]

# At least 6 layouts per world size, mixing data, tensor, expert and pipeline parallelism, schedules and recompute.
LAYOUTS = {
    4: [
        "parallel.dp_shard=4",
        "parallel.dp_replicate=4 parallel.dp_shard=1",
        "parallel.dp_shard=4 parallel.ep=4",
        "parallel.dp_shard=4 parallel.activation_checkpointing=full",
        "parallel.dp_shard=2 parallel.tp=2 parallel.sequence_parallel=true",
        "parallel.pp=2 parallel.dp_shard=2 train.micro_batch_size=4",
        "parallel.pp=2 parallel.dp_shard=2 train.micro_batch_size=4 parallel.pp_schedule=interleaved_1f1b "
        "parallel.pp_virtual_stages=2",
        "parallel.pp=4 parallel.dp_shard=1 train.micro_batch_size=4 parallel.pp_schedule=gpipe",
    ],
    8: [
        "parallel.dp_shard=8",
        "parallel.dp_shard=8 parallel.ep=8",
        "parallel.dp_replicate=2 parallel.dp_shard=4 parallel.ep=4",
        "parallel.dp_shard=8 parallel.activation_checkpointing=full",
        "parallel.dp_shard=4 parallel.tp=2 parallel.sequence_parallel=true",
        "parallel.pp=2 parallel.dp_shard=4 train.micro_batch_size=2",
        "parallel.pp=4 parallel.dp_shard=2 train.micro_batch_size=4",
        "parallel.pp=2 parallel.dp_shard=2 parallel.tp=2 train.micro_batch_size=4",
    ],
}

THREAD_PER_RANK = {**os.environ, "OMP_NUM_THREADS": "1"}  # as torchrun runs each rank here
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
SMALL, LARGE = 1024, 4 * 2**20  # bytes of the buffers timed for latency and for bandwidth


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks, ties given their mean rank."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def fit_latency(points: list[tuple[int, float]]) -> gpu_presets.Latency:
    """Least-squares (call, per-step) seconds from (ring steps, seconds per call) of small-buffer collectives."""
    n = len(points)
    mean_s = sum(s for s, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((s - mean_s) ** 2 for s, _ in points)
    step = sum((s - mean_s) * (t - mean_t) for s, t in points) / var if var else 0.0
    step = max(step, 0.0)
    call = max(mean_t - step * mean_s, 0.0)
    return gpu_presets.Latency(call, step, step)


# ---------------------------------------------------------------------------
# Measured figures (in spawned processes)
# ---------------------------------------------------------------------------


def gemm_shapes(config: RunConfig) -> list[tuple[float, int, int, int]]:
    """The config's matmuls of one micro-batch on one rank without parallelism: one block of each kind (dense,
    MoE) the model has, and the head (a short pass: many passes make the fastest a fair one)."""
    layout = Layout.resolve(1)
    micro = config.train.micro_batch_size or config.train.global_batch_size
    tokens = micro * config.model.seq_len
    out = []
    kinds = {layer.feed_forward: layer for layer in config.model.layer_pattern[:config.model.n_layers]}
    for layer in sorted(kinds.values(), key=lambda layer: layer.is_moe):  # a window changes no matmul
        out += step_time.block_gemms(config, layout, tokens, layer)
    out.append((1, tokens, config.model.d_model, config.model.vocab_size))
    return out


def _time_gemms(shapes: list[tuple[float, int, int, int]], seconds: float) -> float:
    """FLOP/s of running every shape's forward, input-gradient and weight-gradient matmul, from the fastest of the
    passes repeated for ``seconds``: the one other processes of the machine disturbed least (as
    ``parallel.hardware.measure_matmul_flops``); the ranks measured together disturb every pass alike."""
    operands = []
    for count, m, k, n in shapes:
        m = max(int(round(m)), 1)
        a, w, g = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
        operands.append((int(count), a, w, g))
    flops = sum(3 * 2 * c * a.shape[0] * a.shape[1] * w.shape[1] for c, a, w, _ in operands)

    def run() -> None:
        for c, a, w, g in operands:
            for _ in range(c):
                a @ w
                g @ w.T
                a.T @ g

    run()  # warm-up
    fastest, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds:
        began = time.perf_counter()
        run()
        fastest = min(fastest, time.perf_counter() - began)
    return flops / fastest


def _collective(name: str, nbytes: int, world: int, rank: int) -> callable:
    """One call of collective ``name`` on a buffer of ``nbytes`` (the full buffer), and its bus bytes."""
    elements = max(nbytes // 4 // world * world, world)
    full, part = torch.ones(elements), torch.ones(elements // world)
    if name == "all_reduce":
        return lambda: dist.all_reduce(full)
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full)
    if name == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    peer = rank ^ 1  # pairs (0, 1), (2, 3), ...: every rank sends and receives, as pipeline stages do

    def exchange() -> None:
        if rank % 2 == 0:
            dist.send(full, peer)
            dist.recv(full, peer)
        else:
            dist.recv(full, peer)
            dist.send(full, peer)
    return exchange


def _timed_blocks(work: callable, blocks: int, calls: int) -> list[float]:
    """Seconds per call of ``work`` run ``calls`` times back to back, for each of ``blocks`` blocks: every rank
    starts a block together, and a block ends when its last rank does (a collective ends then too)."""
    samples = []
    for _ in range(blocks):
        dist.barrier()
        began = time.perf_counter()
        for _ in range(calls):
            work()
        elapsed = torch.tensor([(time.perf_counter() - began) / calls])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(elapsed.item())
    return samples


def _measure_rank(rank: int, world: int, port: int, chunk, blocks: int, calls: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    operands = [(int(count), torch.randn(max(int(round(m)), 1), k), torch.randn(k, n)) for count, m, k, n in chunk]

    def compute() -> None:
        for count, a, w in operands:
            for _ in range(count):
                a @ w

    times = {}
    for name in COLLECTIVES:
        alone, collective = {}, {}
        for nbytes in (SMALL, LARGE):
            collective[nbytes] = _collective(name, nbytes, world, rank)
            _timed_blocks(collective[nbytes], 1, 3)  # warm-up
            alone[nbytes] = statistics.median(_timed_blocks(collective[nbytes], blocks, 2 * calls))

        def step_like(call: callable = collective[SMALL]) -> None:
            compute()
            call()
        _timed_blocks(step_like, 1, 2)  # warm-up
        # alternated, so that the machine's drift falls on both alike
        pairs = [(_timed_blocks(step_like, 1, calls)[0], _timed_blocks(compute, 1, calls)[0]) for _ in range(blocks)]
        times[name, SMALL] = statistics.median(with_call - without for with_call, without in pairs)
        # the bytes' time from the calls alone: beside compute it is a few ms in a difference of tens, lost in noise
        times[name, LARGE] = times[name, SMALL] + alone[LARGE] - alone[SMALL]
        times[name, "alone"] = alone[SMALL]  # for the record: the small call in a loop of calls alone
    if rank == 0:
        out.put(times)
    dist.barrier()
    dist.destroy_process_group()


def chunk_between_calls(config: RunConfig, world: int) -> list[tuple[float, int, int, int]]:
    """The compute a rank runs between two collectives of a step, as the collectives are timed: one block's
    forward matmuls on a data-parallel rank's share of the batch, which is what runs between FSDP's gathers of
    consecutive blocks (one unit per block)."""
    tokens = config.train.global_batch_size // world * config.model.seq_len
    return step_time.block_gemms(config, Layout.resolve(1), tokens, config.model.layer(0))


def measure_machine(config: RunConfig, world: int, blocks: int = 7, calls: int = 4) -> dict:
    """gloo's seconds per collective call on ``world`` ranks, for a small and a large buffer, as a step sees them.

    A small buffer's call is timed under load: each rank runs the compute a step runs between two calls
    (``chunk_between_calls``) before each call, and the call's cost is the time beyond the same compute without
    it. Ranks that share cores drift apart while they compute, so a call waits longer for its last peer than in
    a loop of collectives alone (a 1 KiB all-reduce on 4 ranks of 2 cores: 7 to 11 ms, against 4 to 5). The large
    buffer adds its extra bytes' time as measured in a loop of calls alone."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_measure_rank, args=(r, world, port, chunk_between_calls(config, world),
                                                             blocks, calls, queue))
                 for r in range(world)]
    for p in processes:
        p.start()
    times = queue.get(timeout=600)
    for p in processes:
        p.join()
    return times


def single_rank_flops(config: RunConfig, seconds: float = 3.0) -> float:
    """The config's matmuls in this process alone, one thread: the rate the efficiency and sharing divide."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _time_gemms(gemm_shapes(config), seconds)
    finally:
        torch.set_num_threads(threads)


def preset(world: int, flops: float, times: dict, sharing: float = 1.0
           ) -> tuple[gpu_presets.Hardware, dict[str, float]]:
    """This machine as the planner's hardware for ``world`` ranks (one node) whose matmuls run at ``flops`` each
    when all run and ``sharing`` times that alone, and each collective's bus bytes/s from its ``times``."""
    rates, small_calls = {}, []
    for name in COLLECTIVES:
        members = (0, 1) if name == "send" else tuple(range(world))
        big, small = (traffic_items.bus_bytes(name, max(size // 4 // world * world, world) * 4, len(members))
                      for size in (LARGE, SMALL))
        calls = 2 if name == "send" else 1  # a send and a receive each way
        extra = times[name, LARGE] - times[name, SMALL]
        rates[name] = calls * (big - small) / extra if extra > 0 else math.inf
        steps = link_time.ring_steps(traffic_items.Traffic("", name, "", 1, 0, members), world)[0]
        small_calls.append((steps, times[name, SMALL] / calls, small))
    bandwidth = statistics.median(rates.values())
    points = [(steps, seconds - small / bandwidth) for steps, seconds, small in small_calls]  # less the bytes' time
    hardware = gpu_presets.Hardware(
        f"this CPU, {world} gloo ranks", world, bandwidth, bandwidth, flops, 64, math.inf,
        "measured by benchmarks/layout_ranking.py", fit_latency(points), "fp32", max(sharing, 1.0),
        intra_efficiency=1.0)  # the rate is gloo's own, measured: nothing more to take off
    return hardware, rates


# ---------------------------------------------------------------------------
# Measured step times (train.py under torchrun)
# ---------------------------------------------------------------------------


def train_command(config_name: str, overrides: list[str], world: int, steps: int, run_dir: Path) -> list[str]:
    """``train.py`` on ``world`` ranks (torchrun above one) for ``steps`` steps, logging every step."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
    return [sys.executable, *launcher, "train.py", "--config", config_name, "--run-dir", str(run_dir),
            "--resume", "none", "--set", *overrides, f"train.steps={steps}", "logging.log_interval=1",
            "logging.wandb=disabled", "train.eval_batches=1", "train.eval_interval=0",
            "checkpoint.interval=null", "checkpoint.final=false"]  # a save's time is not a step's


def logged_step_times(config_name: str, overrides: list[str], run_dir: Path) -> list[float]:
    """Seconds of each step a finished run logged (from its per-step tokens/s)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    config = load_config(config_name, overrides)
    tokens = config.train.global_batch_size * config.model.seq_len
    return [tokens / r["perf/tokens_per_s"] for r in records if "perf/tokens_per_s" in r]


def step_times(config_name: str, overrides: list[str], world: int, steps: int, run_dir: Path) -> list[float]:
    """Seconds of each step of ``train.py`` on ``world`` ranks."""
    command = train_command(config_name, overrides, world, steps, run_dir)
    done = subprocess.run(command, cwd=ROOT, env=THREAD_PER_RANK, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return logged_step_times(config_name, overrides, run_dir)


def shared_step(config_name: str, overrides: list[str], world: int, steps: int, warmup: int,
                run_dir: Path) -> float:
    """The step seconds of ``world`` one-process trainings run at once, each on a ``world``-th of the global batch
    (the median of their medians): a data-parallel rank's compute, shared with the others as on ``world`` ranks,
    with nothing to exchange. Over a ``world``-th of one process's step alone, it is the preset's ``sharing``:
    what the ranks' switching and their contention for caches and memory cost beyond dividing the cores."""
    batch, rest = divmod(load_config(config_name, overrides).train.global_batch_size, world)
    if rest:
        raise ValueError(f"the global batch does not split over {world} processes")
    mine = [*overrides, f"train.global_batch_size={batch}", "train.micro_batch_size=null"]
    runs = []
    for i in range(world):
        log = (run_dir / f"shared-{i}.log").open("w")
        command = train_command(config_name, mine, 1, warmup + steps, run_dir / f"shared-{i}")
        runs.append((command, subprocess.Popen(command, cwd=ROOT, env=THREAD_PER_RANK, stdout=log, stderr=log), log))
    medians = []
    for i, (command, process, log) in enumerate(runs):
        process.wait()
        log.close()
        if process.returncode != 0:
            tail = (run_dir / f"shared-{i}.log").read_text()[-3000:]
            raise RuntimeError(f"{' '.join(command)} failed:\n{tail}")
        medians.append(statistics.median(logged_step_times(config_name, mine, run_dir / f"shared-{i}")[warmup:]))
    return statistics.median(medians)


def step_efficiency(config_name: str, overrides: list[str], alone: float, steps: int, warmup: int,
                    run_dir: Path) -> tuple[float, float]:
    """The fraction of its matmuls' rate (``alone`` FLOP/s) a whole training step of the config reaches in one
    process (one thread), and that step's seconds: the CPU's counterpart of ``step_time.calibrated_efficiency``,
    measured once on one rank, where the GPU's is taken from one published layer. It is what the element-wise
    work, routing and the optimizer add to the matmuls."""
    config = load_config(config_name, overrides)
    flops = step_time.compute_seconds(config, Layout.resolve(1), peak=1.0)  # the step's training FLOPs
    seconds = statistics.median(step_times(config_name, overrides, 1, warmup + steps, run_dir)[warmup:])
    return flops / seconds / alone, seconds


def predicted(config_name: str, overrides: list[str], world: int, hardware: gpu_presets.Hardware,
              efficiency: float) -> layout_search.Plan:
    """The planner's estimate of the layout on the measured preset, its matmuls at ``efficiency`` of the rate."""
    config = load_config(config_name, overrides)
    layout = resolve_layout(config, world)[0]
    return layout_search.evaluate(config, layout, hardware, world, efficiency=efficiency, memory_total=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="moe-8x")
    parser.add_argument("--set", nargs="*", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8], choices=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every layout, interleaved")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    base = [*BASE, *args.overrides]
    config = load_config(args.config, base)
    cores = os.cpu_count() or 1
    alone = single_rank_flops(config)
    print(f"{args.config} ({' '.join(base)}): one rank alone {alone / 1e9:.1f} GFLOP/s on its matmuls; {cores} cores")
    with tempfile.TemporaryDirectory() as tmp:
        efficiency, one_step = step_efficiency(args.config, base, alone, args.steps, args.warmup, Path(tmp))
    print(f"one process: a step of {one_step:.3f} s, {efficiency:.0%} of its matmuls' rate (the efficiency)")
    presets, collectives = {}, {}
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            shared = shared_step(args.config, base, world, args.steps, args.warmup, Path(tmp))
        sharing = world * shared / one_step
        collectives[world] = measure_machine(config, world)
        hardware, rates = preset(world, alone / sharing, collectives[world], sharing)
        presets[world] = hardware
        lat = hardware.latency
        print(f"{world} ranks: {world} one-process steps on a {world}-th of the batch at once take {shared:.3f} s "
              f"each, sharing {sharing:.2f} (the cores alone: {world / min(world, cores):.2f}), "
              f"{hardware.bf16_flops / 1e9:.2f} GFLOP/s per rank; gloo bus GB/s "
              + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in rates.items())
              + f"; preset {hardware.intra_node / 1e9:.2f} GB/s, latency {lat.call * 1e6:.0f} us per call + "
              f"{lat.intra_step * 1e6:.0f} us per step")
    runs = [(world, layout) for world in args.worlds for layout in LAYOUTS[world]]
    samples: dict[tuple[int, str], list[float]] = {run: [] for run in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for i, (world, layout) in enumerate(runs):
                run_dir = Path(tmp) / f"r{round_}-{i}"
                times = step_times(args.config, [*base, *layout.split()], world, args.warmup + args.steps, run_dir)
                samples[world, layout] += times[args.warmup:]
    rows = []
    for world, layout in runs:
        plan = predicted(args.config, [*base, *layout.split()], world, presets[world], efficiency)
        rows.append({"world": world, "layout": layout, "plan": plan.describe(), "predicted_s": plan.step,
                     "compute_s": plan.compute, "bubble_s": plan.bubble, "exposed_s": plan.exposed,
                     "measured_s": statistics.median(samples[world, layout]), "samples": samples[world, layout]})
    summary = {}
    for world in args.worlds:
        mine = [r for r in rows if r["world"] == world]
        rho = spearman([r["predicted_s"] for r in mine], [r["measured_s"] for r in mine])
        summary[world] = rho
        print(f"\n{world} ranks: Spearman {rho:.2f} over {len(mine)} layouts")
        print(f"{'layout':<62} {'predicted':>9} {'measured':>9} {'error':>7}  compute bubble tp ep pp fsdp")
        for r in sorted(mine, key=lambda r: r["measured_s"]):
            parts = " ".join(f"{v * 1e3:.0f}" for v in (r["compute_s"], r["bubble_s"], *r["exposed_s"].values()))
            print(f"{r['plan']:<62} {r['predicted_s']:>8.3f}s {r['measured_s']:>8.3f}s "
                  f"{r['predicted_s'] / r['measured_s'] - 1:>+7.0%}  {parts}")
    if args.json:
        seconds = {w: {f"{name} {size}": t for (name, size), t in c.items()} for w, c in collectives.items()}
        args.json.write_text(json.dumps({"rows": rows, "spearman": summary, "single_rank_flops": alone,
                                         "efficiency": efficiency, "one_process_step_s": one_step,
                                         "collective_seconds": seconds,
                                         "presets": {w: vars(h) | {"latency": vars(h.latency)}
                                                     for w, h in presets.items()}}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
