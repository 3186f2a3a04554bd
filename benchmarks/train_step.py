"""One training step end to end, and where its time goes: attention, expert GEMMs, routing and permutation,
the optimizer, the rest.

What is measured. ``training.step.train_step`` (micro-batches, backward, gradient clipping, AdamW) on one
process: on CPU ``configs/moe-8x.yaml`` as it is (its precision choice included); on CUDA a Mixtral-shaped
slice (Mixtral 8x7B's d_model 4096, 32 heads with 8 KV heads, 8 experts of hidden 14336, top-2, dropless,
vocabulary 32000, sequences of 4096 tokens, bf16; 8 sequences per step in micro-batches of one) with as many
layers as the memory model says fit the GPU's free memory. Steps are timed after warm-up (medians); then one
step runs under the torch profiler, and each operator's self time (CPU time on a CPU, kernel time on a GPU)
is put in a category:

- attention: everything inside the attention modules (``moe/attention/``: projections, RoPE, the kernel)
- expert GEMMs: inside ``GroupedExperts`` (the grouped GEMMs, the activation between them, weight copies)
- routing and permutation: the rest of each ``MoELayer`` (router, dispatch plan, permute, combine, balancing
  losses, statistics)
- optimizer: ``optimizer.step``
- the rest: embedding, norms, residual adds, dense FFNs, LM head and loss, gradient clipping, the loop

Forward operators take the category of the innermost module they ran in (``record_function`` ranges that
forward hooks open and close); a backward operator takes its forward operator's, matched through autograd's
sequence numbers. The printed line ``outside expert GEMMs and attention: N%`` is the share of the step that is
neither (goal: under 15% on CPU). On CUDA it also prints model FLOP utilisation: model FLOPs per token from the
active parameters (as ``perf/mfu`` counts them, ``moe.accounting.training_flops_per_token``) times tokens per
second, over the GPU's dense bf16 datasheet peak (``parallel.hardware.datasheet_bf16_peak``). A measurement, never a
pass/fail test; the profiler adds its own overhead to the profiled step (the timed steps run without it).

``--compile`` then compiles the blocks as ``train.compile`` does (``parallel/compile.py``) and times the same
steps again in the same process: the first compiled step's time (compilation included) and the median after.

    python benchmarks/train_step.py [--device cpu|cuda] [--config NAME] [--set key=value ...] [--steps N]
                                    [--compile] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config.run import load_config  # noqa: E402
from moe.accounting import (  # noqa: E402
    attention_flops_per_token,
    head_flops_per_token,
    parameter_counts,
    training_flops_per_token,
)
from moe.attention import AttentionKind  # noqa: E402
from moe.experts import GroupedExperts  # noqa: E402
from moe.layer import MoELayer  # noqa: E402
from moe.transformer import MoETransformer  # noqa: E402
from parallel.compile import apply_compile  # noqa: E402
from parallel.expert import ExpertParallelExperts  # noqa: E402
from parallel.hardware import choose_precision, datasheet_bf16_peak, keep_freed_memory  # noqa: E402
from training.optim import build_optimizer  # noqa: E402
from training.step import IntervalStats, StepContext, train_step  # noqa: E402

CATEGORIES = ("attention", "expert GEMMs", "routing and permutation", "optimizer", "the rest")
MIXTRAL_SLICE = ["model.vocab_size=32000", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8",
                 "model.seq_len=4096", "model.ffn_hidden=14336", "model.rope_theta=1000000.0",
                 "moe.num_experts=8", "moe.top_k=2", "moe.expert_hidden=14336", "moe.capacity_factor=null",
                 "train.precision=bf16", "train.global_batch_size=8", "train.micro_batch_size=1"]


def label_modules(model: MoETransformer) -> list:
    """Open a ``record_function`` range named after each module's category around its forward; returns the
    hooks' handles (``--compile`` removes them before compiling: Dynamo would trace them into the blocks)."""
    handles = []

    def label(module, name):
        ranges = []
        handles.append(module.register_forward_pre_hook(lambda *_: ranges.append(record_function(name).__enter__())))
        handles.append(module.register_forward_hook(lambda *_: ranges.pop().__exit__(None, None, None)))

    for module in model.modules():
        if isinstance(module, AttentionKind):
            label(module, "attention")
        elif isinstance(module, GroupedExperts | ExpertParallelExperts):
            label(module, "expert GEMMs")
        elif isinstance(module, MoELayer):
            label(module, "routing and permutation")
    return handles


def label_optimizer(optimizer: torch.optim.Optimizer) -> None:
    ranges = []
    optimizer.register_step_pre_hook(lambda *_: ranges.append(record_function("optimizer").__enter__()))
    optimizer.register_step_post_hook(lambda *_: ranges.pop().__exit__(None, None, None))


def categorized(prof):
    """Each profiled event with its category (see the module docstring), or None outside every category."""
    events = prof.events()
    forward_category: dict[int, str] = {}
    backward = "autograd::engine::evaluate_function: "

    def enclosing(event):
        """The innermost category range or backward node around ``event``."""
        node = event
        while node is not None and node.name not in CATEGORIES and not node.name.startswith(backward):
            node = node.cpu_parent
        return node

    for event in events:  # forward operators that made autograd nodes: their category, by sequence number
        node = enclosing(event)
        if event.sequence_nr >= 0 and node is not None and node.name in CATEGORIES:
            forward_category.setdefault(event.sequence_nr, node.name)
    for event in events:
        node = enclosing(event)
        if node is None:
            yield event, None
        else:
            yield event, node.name if node.name in CATEGORIES else forward_category.get(node.sequence_nr)


def breakdown(prof, device: str) -> tuple[dict[str, float], Counter]:
    """Seconds of self time per category in the profiled step (CPU time on a CPU, kernel time on a GPU), and
    per operator of the rest (where the step goes that no category names)."""
    totals, rest = dict.fromkeys(CATEGORIES, 0.0), Counter()
    for event, part in categorized(prof):
        if event.device_type != DeviceType.CPU:  # a kernel's time is already its launching operator's
            continue
        own = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        if own > 0 and event.name not in CATEGORIES:
            totals[part or "the rest"] += own / 1e6
            if part is None:
                rest[event.name] += own / 1e6
    return totals, rest


def build(config, device: torch.device):
    torch.manual_seed(config.train.seed)
    with torch.device(device):
        model = MoETransformer(config.model, config.moe, seed=config.train.seed)
    return model, build_optimizer(model, config.train)


def predicted_memory(config) -> int:
    """The memory model's training peak for ``config`` on one GPU in bf16, in bytes."""
    from analysis.fit_check import predicted_bytes
    from parallel.resolve import resolve_layout

    return predicted_bytes(config, resolve_layout(config, 1), "bf16")[0]


def mfu_figures(config, tokens_per_s: float, peak: float | None) -> dict:
    """MFU on one device under the conventions in use, with what separates them (each a figure in the result).

    ``mfu``: ``perf/mfu``'s convention (``moe.accounting.training_flops_per_token``): 6 FLOPs per active matmul
    parameter and token, attention's scores and values counted whole (PaLM's 12 · S · nh · hd per layer, no
    halving for the causal mask), the LM head counted. ``mfu_causal_halved``: attention's share halved, as the
    causal kernel skips the masked half (FlashAttention's benchmarks count so). ``mfu_without_head``: the LM
    head's FLOPs left out (its time stays in): on a slice of a few layers the head is a far larger share of the
    FLOPs than in the whole model (``head_share`` against ``head_share_whole_model``, the same shapes at
    Mixtral 8x7B's 32 layers), and its large dense GEMM runs near the peak, so ``mfu`` flatters the slice."""
    model, moe = config.model, config.moe
    total = training_flops_per_token(model, moe)
    attention = sum(attention_flops_per_token(model, layer) for layer in model.layer_pattern)
    head = head_flops_per_token(model)
    whole = load_config("moe-8x", [*MIXTRAL_SLICE, "model.n_layers=32"])
    figures = {"model_tflops": total * tokens_per_s / 1e12, "head_share": head / total,
               "head_share_whole_model": head / training_flops_per_token(whole.model, whole.moe)}
    for name, flops in (("mfu", total), ("mfu_causal_halved", total - attention / 2), ("mfu_without_head",
                                                                                         total - head)):
        figures[name] = flops * tokens_per_s / peak if peak else None
    return figures


def mfu_lines(result: dict) -> str:
    """The MFU figures of ``mfu_figures``, each beside its convention."""
    if result["mfu"] is None:
        return f"model FLOPs {result['model_tflops']:.0f} TFLOP/s; MFU unknown (no datasheet peak for this GPU)"
    return (f"model FLOPs {result['model_tflops']:.0f} TFLOP/s on one device, against its datasheet dense bf16 "
            f"peak: MFU {result['mfu']:.1%} (perf/mfu's count: causal attention counted whole, LM head counted); "
            f"{result['mfu_causal_halved']:.1%} with causal attention halved; {result['mfu_without_head']:.1%} "
            f"without the LM head's FLOPs (the head is {result['head_share']:.1%} of this slice's FLOPs, "
            f"{result['head_share_whole_model']:.1%} of the whole 32-layer model's)")


def layers_that_fit(overrides: list[str], device: torch.device, largest: int = 32) -> int:
    """The most layers of the slice whose training memory (the memory model's) fits the GPU's free memory,
    with 10% left for the allocator."""
    free = torch.cuda.mem_get_info(device)[0] * 0.9
    fitting = [n for n in range(1, largest + 1)
               if predicted_memory(load_config("moe-8x", [*overrides, f"model.n_layers={n}"])) <= free]
    if not fitting:
        raise SystemExit("train_step: not even one layer of the slice fits this GPU's free memory")
    return fitting[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--config", default="moe-8x", help="on CPU (default moe-8x); on CUDA the Mixtral slice")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after 2 warm-up steps")
    parser.add_argument("--compile", action="store_true",
                        help="then compile the blocks (train.compile, TorchInductor) and time the same steps again")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_step: --device cuda needs a CUDA GPU and torch sees none", file=sys.stderr)
        return 2
    if args.steps < 1:
        print(f"train_step: --steps must be at least 1, got {args.steps}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    keep_freed_memory(device.type)  # as train.py does
    overrides = list(args.overrides)
    name = args.config
    if args.device == "cuda":
        overrides = [*MIXTRAL_SLICE, *overrides]
        overrides.append(f"model.n_layers={layers_that_fit(overrides, device)}")
        name = "mixtral slice"
    config = load_config(args.config, overrides)
    precision = choose_precision(config.train.precision, device)
    bf16 = precision.precision == "bf16"
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
    model, optimizer = build(config, device)
    labels = label_modules(model)
    label_optimizer(optimizer)
    generator = torch.Generator().manual_seed(0)
    batch = config.train.global_batch_size
    micro = config.train.micro_batch_size or batch
    tokens = torch.randint(0, config.model.vocab_size, (batch, config.model.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    context = StepContext(model, optimizer, micro, config.train.grad_clip, autocast)

    def step():
        train_step(context, inputs, targets, IntervalStats())
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed() -> list[float]:
        """Seconds of each step: 2 warm-up steps, then ``--steps``."""
        seconds = []
        for _ in range(2 + args.steps):
            began = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - began)
        return seconds

    seconds = timed()[2:]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    parts, rest = breakdown(prof, device.type)
    total = sum(parts.values())
    step_s = statistics.median(seconds)
    tokens_per_s = batch * config.model.seq_len / step_s
    counts = parameter_counts(config.model, config.moe)
    result = {"config": name, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, "precision": precision.precision,
              "layers": config.model.n_layers, "parameters": counts.total, "active": counts.active,
              "step_s": step_s, "tokens_per_s": tokens_per_s,
              **{f"share {part}": seconds_ / total for part, seconds_ in parts.items()},
              "outside expert GEMMs and attention": 1 - (parts["expert GEMMs"] + parts["attention"]) / total,
              "rest_heaviest": ", ".join(f"{op} {t:.3f} s" for op, t in rest.most_common(6))}
    if device.type == "cuda":
        result.update(mfu_figures(config, tokens_per_s, datasheet_bf16_peak(result["device"])))
        result.update({"memory_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                       "memory_predicted_gib": predicted_memory(config) / 2**30})

    print(f"{name} on {result['device']} ({precision.precision}, torch {torch.__version__}): "
          f"{config.model.n_layers} layers, {counts.total / 1e6:,.1f}M parameters ({counts.active / 1e6:,.1f}M "
          f"active), {batch} x {config.model.seq_len} tokens per step")
    print(f"step {step_s:.3f} s (median of {args.steps}), {tokens_per_s:,.0f} tokens/s")
    for part in CATEGORIES:
        print(f"  {part:<24} {parts[part]:8.3f} s  {parts[part] / total:6.1%}")
    print(f"  the rest's heaviest operators: {result['rest_heaviest']}")
    print(f"outside expert GEMMs and attention: {result['outside expert GEMMs and attention']:.1%}")
    if device.type == "cuda":
        print(mfu_lines(result))
        print(f"peak memory {result['memory_peak_gib']:.1f} GiB allocated "
              f"(memory model: {result['memory_predicted_gib']:.1f} GiB)")
    if args.compile:
        for handle in labels:
            handle.remove()
        apply_compile(model)
        compiled = timed()
        result.update({"compiled_first_step_s": compiled[0], "compiled_step_s": statistics.median(compiled[2:]),
                       "compile_speedup": step_s / statistics.median(compiled[2:])})
        print(f"compiled blocks (TorchInductor): first step {compiled[0]:.1f} s (compiling), then "
              f"{result['compiled_step_s']:.3f} s per step: {result['compile_speedup']:.2f}x eager's")
    if args.json:
        args.json.write_text(json.dumps([result], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
