"""Router analysis of a run directory: routing over training, and probes of what the experts specialise in.

    python -m analysis.router probe --run runs/moe-8x --weights model.pt [--compare init]
    python -m analysis.router summary runs/a runs/b ...

``probe`` builds the run's model from its ``config.yaml``, loads weights (``--weights``: a checkpoint
folder, ``step_NNNNNNN`` or a run's ``checkpoints/`` for its newest; a ``.safetensors`` export; a state
dict saved with ``torch.save``; or ``init``: the run's own initial weights, rebuilt from its seed), runs
a fixed held-out text (the first tokens of the run's validation split, or ``--text``),
prints what each expert specialises in and how consecutive layers agree, and saves every routing
choice to ``probe.npz`` (``analysis.router_probe.ProbeResult.load`` reads it). ``--compare`` probes a
second weight set on the same text and reports how the routing moved. ``summary`` prints one line per
run: final losses, and imbalance, MaxVio, dropped fraction and entropy over the last logging intervals
(``scripts/balancing_story.sh`` uses it to compare balancing methods).

The functions here are what ``notebooks/router_analysis.ipynb`` calls; the figures are in
``analysis.router_plots``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from analysis.router_probe import (
    CATEGORIES,
    ProbeResult,
    category_lift,
    expert_categories,
    layer_agreement,
    probe,
    routing_change,
    top_tokens,
)
from config.cli import command_parser, run_command
from config.errors import ConfigError, UserError
from config.run import RunConfig
from config.schema import from_dict, parse_yaml
from data.cache import load_tokens
from data.sampler import split_tokens
from interop.export import consolidated_state
from moe.transformer import MoETransformer
from parallel.checkpoint import published_checkpoints
from training.metrics import read_metrics
from training.routing_stats import read_routing

StateDictLoader = Callable[[], dict[str, torch.Tensor]]


def newest_run(runs_dir: Path | str = "runs") -> Path:
    """The run directory under ``runs_dir`` whose metrics.jsonl changed last."""
    candidates = sorted(Path(runs_dir).glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise FileNotFoundError(f"no run under {Path(runs_dir).resolve()} (no */metrics.jsonl): train one with "
                                "`make train` or set MOE_RUN_DIR to a run directory")
    return candidates[-1].parent


def run_dir_from_env(runs_dir: Path | str = "runs") -> Path:
    """``$MOE_RUN_DIR`` if set, else the newest run under ``runs_dir``."""
    chosen = os.environ.get("MOE_RUN_DIR")
    if chosen:
        if not (Path(chosen) / "config.yaml").is_file():
            raise FileNotFoundError(f"MOE_RUN_DIR={chosen} is not a run directory (it has no config.yaml)")
        return Path(chosen)
    return newest_run(runs_dir)


def companion_run(run_dir: Path | str, runs_dir: Path | str = "runs") -> Path | None:
    """A run to compare with: ``$MOE_COMPARE_RUN``, else the newest other run under ``runs_dir``, else None."""
    chosen = os.environ.get("MOE_COMPARE_RUN")
    if chosen:
        return Path(chosen)
    this = Path(run_dir).resolve()
    others = [p.parent for p in Path(runs_dir).glob("*/metrics.jsonl")
              if p.parent.resolve() != this and (p.parent / "routing" / "step.npy").is_file()]
    return max(others, key=lambda p: (p / "metrics.jsonl").stat().st_mtime) if others else None


def load_run_config(run_dir: Path | str) -> RunConfig:
    """The resolved configuration a run was trained with (its ``config.yaml``), validated."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    try:
        tree = parse_yaml(path.read_text(encoding="utf-8"), str(path))
        if not isinstance(tree, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, got {type(tree).__name__}")
        config = from_dict(RunConfig, tree)
        config.validate()
    except (ConfigError, OSError, UnicodeDecodeError) as exc:
        reason = " ".join(str(exc).split())  # YAML's own message spans lines
        raise ConfigError(f"{path} is not a run's resolved config ({reason}); train.py writes it at the start of a "
                          "run") from exc
    return config


@dataclass
class RunData:
    """What a run directory holds for router analysis."""

    run_dir: Path
    config: RunConfig
    metrics: list[dict]  # metrics.jsonl records
    routing: dict[str, np.ndarray]  # routing/*.npy columns, one row per MoE layer per logging interval

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def layers(self) -> list[int]:
        return sorted(set(self.routing["layer"].tolist()))

    def per_layer(self, field: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(steps [I], values [I, ...]) of one routing field for one layer, in step order."""
        if field not in self.routing:
            raise UserError(f"{self.run_dir} has no routing field {field!r}; it has {', '.join(sorted(self.routing))}")
        rows = self.routing["layer"] == layer
        return self.routing["step"][rows], self.routing[field][rows]

    def metric(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a scalar metric over the records that have it."""
        records = [r for r in self.metrics if key in r]
        return np.array([r["step"] for r in records]), np.array([r[key] for r in records], dtype=np.float64)

    def coselection(self, layer: int, last_intervals: int | None = None) -> np.ndarray:
        """[E, E] co-selection counts of ``layer`` summed over the run (or its last intervals); top-k >= 2."""
        _, counts = self.per_layer("coselection", layer)
        return counts[-last_intervals:].sum(0) if last_intervals else counts.sum(0)


def load_run(run_dir: Path | str) -> RunData:
    run_dir = Path(run_dir)
    return RunData(run_dir, load_run_config(run_dir), read_metrics(run_dir / "metrics.jsonl"), read_routing(run_dir))


def coselection_lift(counts: np.ndarray) -> np.ndarray:
    """[E, E] how often two experts are chosen together against independent choice at their loads.

    counts[i, j] over what independent picks at those loads would give, ``N_i N_j / T`` (T tokens, N_i
    the diagonal: tokens per expert). Each token adds k * k to the sum and k to the trace, so
    k = sum / trace and T = trace / k. 1 = as often as chance; the diagonal is set to nan.
    """
    counts = counts.astype(np.float64)
    load = np.diag(counts).copy()
    experts = len(load)
    top_k = counts.sum() / load.sum()
    tokens = load.sum() / top_k
    with np.errstate(invalid="ignore", divide="ignore"):
        lift = counts / (np.outer(load, load) / tokens)
    lift[np.arange(experts), np.arange(experts)] = np.nan
    return lift


# --------------------------------------------------------------------------------------------------------------
# probing
# --------------------------------------------------------------------------------------------------------------


class WeightsError(ValueError):
    """A weights file that cannot be read, or that is not a state dict of the run's model."""


def load_state_dict_file(path: Path | str) -> StateDictLoader:
    """A loader for a model state dict saved with ``torch.save`` (tensors only, loaded on the CPU); a file that is
    not one is a ValueError naming it."""
    def load() -> dict[str, torch.Tensor]:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - unpickling raises anything from EOFError to KeyError
            raise WeightsError(f"{path} is not a torch.save'd state dict ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else 'unreadable'})") from exc
        if not isinstance(state, dict):
            raise WeightsError(f"{path} holds a {type(state).__name__}, not a model state dict")
        return state
    return load


def probe_weights_from_env(run_dir: Path | str) -> tuple[StateDictLoader | None, str]:
    """(loader, description): ``$MOE_PROBE_WEIGHTS`` (any ``--weights`` value), else the run's newest
    checkpoint, else its initial weights."""
    path = os.environ.get("MOE_PROBE_WEIGHTS")
    if path:
        return _weights_arg(path), path
    checkpoints = published_checkpoints(Path(run_dir) / "checkpoints")
    if checkpoints:
        return _weights_arg(str(checkpoints[0][1])), f"checkpoint {checkpoints[0][1]}"
    return None, ("initial weights (the run has no checkpoint: train with checkpoint.interval set, or set "
                  "MOE_PROBE_WEIGHTS to a checkpoint, .safetensors or state dict file)")


def build_model(config: RunConfig, load_weights: StateDictLoader | None = None) -> MoETransformer:
    """The run's model on the CPU: its initial weights (seeded as training seeds them), or loaded ones."""
    torch.manual_seed(config.train.seed)  # train() seeds the same way before building the model
    model = MoETransformer(config.model, config.moe)
    if load_weights is not None:
        state = load_weights()
        check_state_dict(state, model.state_dict())
        model.load_state_dict(state)
    return model.eval()


def check_state_dict(state: dict, expected: dict[str, torch.Tensor]) -> None:
    """A ValueError naming what differs when ``state`` is not a state dict of the model ``expected`` describes."""
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    shapes = [f"{name} {tuple(state[name].shape)} (the run's model: {tuple(value.shape)})"
              for name, value in expected.items()
              if name in state and getattr(state[name], "shape", None) != value.shape]
    problems = ([f"{len(missing)} of the model's tensors missing (first: {missing[0]})"] if missing else []) + \
               ([f"{len(unexpected)} tensors the model lacks (first: {unexpected[0]})"] if unexpected else []) + \
               ([f"{len(shapes)} of another shape (first: {shapes[0]})"] if shapes else [])
    if problems:
        raise WeightsError(f"the weights do not fit the run's model: {'; '.join(problems)}; give this run's "
                         "checkpoint, export or state dict")


def heldout_tokens(config: RunConfig, count: int) -> np.ndarray:
    """The first ``count`` tokens of the run's validation split: text the model never trained on (of a mixture,
    its first source's)."""
    corpus = config.data.corpora()[0]
    tokens = load_tokens(corpus.path, config.data.cache_dir, tokenizer=config.data.tokenizer, text_key=corpus.text_key,
                         skip=config.data.skip, token_dtype=corpus.token_dtype,
                         document_end_spec=config.data.document_end)
    _, val = split_tokens(tokens, config.data.val_fraction)
    if len(val) < config.model.seq_len:
        raise ValueError(f"the validation split has {len(val)} tokens, fewer than model.seq_len")
    return np.asarray(val[:count], dtype=np.int64)


def probe_run(run_dir: Path | str, load_weights: StateDictLoader | None, tokens: np.ndarray | None = None,
              count: int = 8192) -> ProbeResult:
    """Probe a run's model (weights from ``load_weights``; None = its initial weights) on a held-out text."""
    config = load_run_config(run_dir)
    if config.model.n_moe_layers == 0:
        raise ValueError(f"{run_dir} trained a dense model (model.moe_every=0): there is no routing to probe")
    tokens = heldout_tokens(config, count) if tokens is None else np.asarray(tokens, dtype=np.int64)
    result = probe(build_model(config, load_weights), tokens, config.model.seq_len)
    result.initial_weights = load_weights is None
    return result


def specialisation_lines(result: ProbeResult, layer: int, byte_level: bool = True) -> list[str]:
    """One line per expert: its share of the text's assignments and what it favours.

    Byte-level vocabularies: the two token categories with the highest lift. Any other vocabulary:
    the expert's most frequent token ids.
    """
    ids = result.expert_ids[layer]
    shares = np.bincount(ids.reshape(-1), minlength=result.num_experts) / ids.size
    lift = category_lift(expert_categories(result, layer)) if byte_level else None
    lines = []
    for expert in range(result.num_experts):
        if lift is not None:
            order = [c for c in np.argsort(-np.nan_to_num(lift[expert], nan=-1)) if lift[expert, c] > 0][:2]
            favours = ", ".join(f"{CATEGORIES[c]} x{lift[expert, c]:.2f}" for c in order) or "-"
        else:
            favours = "tokens " + (", ".join(f"{t} ({n})" for t, n in top_tokens(result, layer, expert, 5)) or "-")
        lines.append(f"  expert {expert:>3}: {100 * shares[expert]:5.1f}% of assignments; favours {favours}")
    return lines


@dataclass
class RunSummary:
    """A run's balancing in a few numbers, over its last logging intervals."""

    name: str
    steps: int
    train_loss: float
    val_loss: float
    imbalance: float  # max/mean load, mean over layers and the last intervals
    maxvio: float
    dropped_frac: float
    entropy: float


def summarise(run: RunData, last_intervals: int = 5) -> RunSummary:
    """Final losses and the routing figures averaged over the last ``last_intervals`` logging intervals."""
    last_steps = np.unique(run.routing["step"])[-last_intervals:]
    rows = np.isin(run.routing["step"], last_steps)
    mean = lambda field: float(run.routing[field][rows].mean())  # noqa: E731
    train_steps, train_loss = run.metric("train/loss")
    if not len(train_steps) or not len(run.routing["step"]):
        raise ValueError(f"{run.run_dir} logged no training interval yet (metrics.jsonl has no train/loss, or "
                         "routing/ no rows): nothing to summarise")
    _, val_loss = run.metric("val/loss")
    return RunSummary(run.name, int(train_steps[-1]), float(train_loss[-1]),
                      float(val_loss[-1]) if len(val_loss) else float("nan"),
                      mean("imbalance"), mean("maxvio"), mean("dropped_frac"), mean("entropy"))


def summary_command(args: argparse.Namespace) -> None:
    if args.last < 1:
        raise ConfigError(f"--last {args.last}: must be at least 1 logging interval")
    summaries = [summarise(load_run(run_dir), args.last) for run_dir in args.runs]  # every run read before output
    print(f"{'run':<28} {'steps':>6} {'train':>7} {'val':>7} {'imbal':>6} {'maxvio':>7} {'dropped':>8} {'entropy':>8}")
    for s in summaries:
        print(f"{s.name:<28} {s.steps:>6} {s.train_loss:>7.4f} {s.val_loss:>7.4f} {s.imbalance:>6.3f} "
              f"{s.maxvio:>7.3f} {100 * s.dropped_frac:>7.2f}% {s.entropy:>8.4f}")
    print(f"(routing figures: mean over MoE layers and the last {args.last} logging intervals; "
          "imbal = max/mean expert load, maxvio = imbal - 1)")


def _weights_arg(value: str) -> StateDictLoader | None:
    """``init`` (None), a checkpoint folder (a ``step_NNNNNNN`` folder or a run's ``checkpoints/``: its newest),
    a consolidated ``.safetensors`` export, or a ``torch.save``'d state dict."""
    if value == "init":
        return None
    path = Path(value)
    if path.is_dir():
        return lambda: consolidated_state(path)[0]
    if not path.is_file():
        raise FileNotFoundError(f"--weights/--compare {value}: no such file or folder (a checkpoint folder, a "
                                ".safetensors export, a torch.save'd model state dict, or 'init' for the run's "
                                "initial weights)")
    if path.suffix == ".safetensors":
        def load() -> dict[str, torch.Tensor]:
            try:
                return load_file(str(path))
            except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError and OSError
                raise WeightsError(f"{path} is not a readable .safetensors file ({exc})") from exc
        return load
    return load_state_dict_file(value)


def probe_command(args: argparse.Namespace) -> None:
    config = load_run_config(args.run)
    tokens = None
    if args.text is not None:
        try:
            tokens = np.frombuffer(Path(args.text).read_bytes(), dtype=np.uint8).astype(np.int64)
        except OSError as exc:
            raise ConfigError(f"--text {args.text}: cannot read it ({exc.strerror or exc})") from exc
    if args.tokens < 1:
        raise ConfigError(f"--tokens {args.tokens}: must be a positive number of tokens")
    if tokens is not None and len(tokens) == 0:
        raise ConfigError(f"--text {args.text}: the file is empty")
    try:
        result = probe_run(args.run, _weights_arg(args.weights), tokens, args.tokens)
    except WeightsError as exc:
        raise WeightsError(f"--weights {args.weights}: {exc}") from exc
    out = Path(args.out) if args.out else Path(args.run) / "probe.npz"
    try:
        result.save(out)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write it ({exc.strerror or exc}); give a writable path") from exc
    byte_level = config.model.vocab_size == 256
    print(f"probe of {args.run} ({args.weights}) on {len(result.tokens)} held-out tokens; saved to {out}")
    for layer in result.layers:
        print(f"layer {layer}:")
        print("\n".join(specialisation_lines(result, layer, byte_level)))
    for pair in layer_agreement(result):
        print(f"layers {pair.layers[0]} -> {pair.layers[1]}: top-1 choices share NMI {pair.nmi:.3f} "
              "(0 independent, 1 one determines the other)")
    if args.compare:
        try:
            other = probe_run(args.run, _weights_arg(args.compare), result.tokens)
        except WeightsError as exc:
            raise WeightsError(f"--compare {args.compare}: {exc}") from exc
        for layer, change in routing_change(other, result).items():
            print(f"layer {layer}: vs {args.compare}: {100 * change['top1_same']:.1f}% of tokens keep their top-1 "
                  f"expert; top-{config.moe.top_k} sets overlap {100 * change['topk_overlap']:.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-router", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    probe_parser = commands.add_parser("probe", help="what each expert specialises in, on a held-out text")
    probe_parser.add_argument("--run", required=True, type=Path, help="run directory (holds config.yaml)")
    probe_parser.add_argument("--weights", default="init",
                              help="model state dict file (torch.save), or 'init' for the run's initial weights")
    probe_parser.add_argument("--compare", default=None, help="a second weight set (file or 'init') to compare with")
    probe_parser.add_argument("--text", default=None, help="probe this file's bytes instead of the validation split")
    probe_parser.add_argument("--tokens", type=int, default=8192, help="held-out tokens to probe")
    probe_parser.add_argument("--out", default=None, help="where to save the routing (default RUN/probe.npz)")
    summary_parser = commands.add_parser("summary", help="final loss and balancing of runs, one line each")
    summary_parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    summary_parser.add_argument("--last", type=int, default=5, help="logging intervals to average routing over")
    args = parser.parse_args(argv)
    return run_command(lambda: {"probe": probe_command, "summary": summary_command}[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
