"""Routing statistics of each MoE layer over a logging interval, and where they are kept.

Per micro-batch, :class:`RoutingAccumulator` adds each layer's :class:`moe.layer.RoutingStats` into one
packed tensor per layer, on the device: a few small tensor ops and no host sync. Once per logging
interval :meth:`RoutingAccumulator.reduce` sums the packed tensors over the data-parallel ranks in
one all-reduce and derives the interval's figures (:class:`IntervalRouting`), which describe the global
batch, not one rank's share of it.

:class:`training.routing_log.RoutingLog` appends them to ``run_dir/routing/<field>.npy``: columnar, one
row per MoE layer per interval, each field a plain ``.npy`` file that ``numpy.load`` opens (rows are appended in place
and the header's shape rewritten; numpy pads the header so that the shape can grow). Fields:

- ``step`` [N], ``layer`` [N]: which interval (its last step) and which layer a row describes
- ``tokens_per_expert`` [N, E]: assignments the router made per expert, before capacity drops
- ``dropped`` [N], ``assignments`` [N], ``dropped_frac`` [N]: assignments dropped for lack of capacity
- ``imbalance`` [N]: max load / mean load (1 = perfectly balanced, E = all on one expert)
- ``maxvio`` [N]: (max load - mean load) / mean load over the interval's tokens, the "maximal
  violation" of Wang et al. 2024 (Auxiliary-Loss-Free Load Balancing, arXiv:2408.15664, sec. 4.1);
  ``maxvio_batch`` [N]: the same per micro-batch on one rank, averaged (their MaxVio_batch, on our batches)
- ``entropy`` [N]: mean entropy of the router distribution (nats; ln E = uniform)
- ``top1_prob`` [N]: mean highest router probability (1/E = undecided, 1 = certain)
- ``choice_share`` [N, k]: mean share of a token's combine weight carried by its j-th choice
- ``coselection`` [N, E, E] (top-k >= 2 only): tokens that chose both i and j; the diagonal is the load
- ``aux_loss`` [N], ``z_loss`` [N]: the unscaled balancing and router z-losses, mean per micro-batch
- ``expert_bias`` [N, E] (aux-loss-free balancing only): the selection biases at the interval's end

:func:`read_routing` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from numpy.lib import format as npy

from moe.layer import RoutingStats
from storage.files import atomic_output, open_own_file

ROUTING_DIR = "routing"
# order of the scalars packed after tokens_per_expert: dropped, tokens, sum of entropy, sum of top1_prob,
# sum of maxvio_batch, micro-batches, aux_loss, z_loss (sums over micro-batches; means are weighted by tokens)
_SCALARS = ("dropped", "tokens", "entropy", "top1_prob", "maxvio_batch", "micro_batches", "aux_loss", "z_loss")


@dataclass
class IntervalRouting:
    """One logging interval's routing figures per MoE layer, global over data-parallel ranks (numpy, [L, ...])."""

    layers: np.ndarray  # [L] layer indices
    tokens_per_expert: np.ndarray  # [L, E]
    dropped: np.ndarray  # [L]
    assignments: np.ndarray  # [L]
    entropy: np.ndarray  # [L]
    top1_prob: np.ndarray  # [L]
    maxvio_batch: np.ndarray  # [L]
    choice_share: np.ndarray  # [L, k]
    coselection: np.ndarray | None  # [L, E, E]; None for top-1
    aux_loss: np.ndarray  # [L]
    z_loss: np.ndarray  # [L]
    expert_bias: np.ndarray | None = None  # [L, E] at the interval's end (aux-loss-free balancing), else None

    @property
    def load(self) -> np.ndarray:
        """[L, E] share of each layer's assignments that went to each expert."""
        return self.tokens_per_expert / np.maximum(self.tokens_per_expert.sum(1, keepdims=True), 1)

    @property
    def imbalance(self) -> np.ndarray:
        load = self.load
        return load.max(1) / load.mean(1)

    @property
    def maxvio(self) -> np.ndarray:
        return self.imbalance - 1.0

    @property
    def dropped_frac(self) -> np.ndarray:
        return self.dropped / self.assignments


class RoutingAccumulator:
    """Sums each MoE layer's routing statistics over the micro-batches of one logging interval."""

    def __init__(self) -> None:
        self._sums: dict[int, torch.Tensor] = {}  # layer -> [E + len(_SCALARS) + k (+ E*E)] float64
        self._shape: tuple[int, int] | None = None  # (E, k)

    def add(self, stats: dict[int, RoutingStats]) -> None:
        """Add one micro-batch's statistics; stays on the statistics' device (no host sync)."""
        for i, s in stats.items():
            experts, top_k = s.tokens_per_expert.numel(), s.choice_share.numel()
            self._shape = (experts, top_k)
            tokens = s.num_assignments // top_k
            load = s.tokens_per_expert.double()
            maxvio = (load.max() - load.mean()) / load.mean().clamp_min(1e-12)
            one = torch.ones((), dtype=torch.float64, device=load.device)
            scalars = torch.stack([s.num_dropped.double(), one * tokens, s.entropy.double() * tokens,
                                   s.top1_prob.double() * tokens, maxvio, one, s.aux_loss.double(), s.z_loss.double()])
            parts = [load, scalars, s.choice_share.double() * tokens]
            if s.coselection is not None:
                parts.append(s.coselection.double().reshape(-1))
            packed = torch.cat(parts)
            self._sums[i] = self._sums[i] + packed if i in self._sums else packed

    def reduce(self, dp_group: dist.ProcessGroup | None = None, pp_group: dist.ProcessGroup | None = None,
               biases: dict[int, torch.Tensor] | None = None) -> IntervalRouting | None:
        """The interval's figures for every MoE layer, summed over the data-parallel ranks.

        ``biases``: this rank's aux-loss-free selection biases by layer (:func:`balancing_biases`), kept
        as they are now, at the interval's end. A collective: every rank of ``dp_group`` and
        ``pp_group`` must call this. Under pipeline parallelism each stage holds some of the layers;
        their sums and biases are first exchanged over ``pp_group`` (one small object all-gather per
        logging interval), so every rank reports the whole model. None when the model has no MoE
        layer or nothing was added.
        """
        sums, shape = self._sums, self._shape
        biases = {i: b.detach().double().cpu() for i, b in (biases or {}).items()}
        if pp_group is not None:
            parts: list = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(parts, ({i: t.cpu() for i, t in sums.items()}, shape, biases), group=pp_group)
            device = next(iter(sums.values())).device if sums else torch.device("cpu")
            sums = {i: t.to(device) for part, _, _ in parts for i, t in part.items()}
            shape = next((part_shape for _, part_shape, _ in parts if part_shape is not None), None)
            biases = {i: b for _, _, part in parts for i, b in part.items()}
        if not sums:
            return None
        layers = sorted(sums)
        packed = torch.stack([sums[i] for i in layers])
        if dp_group is not None:
            dist.all_reduce(packed, group=dp_group)
        packed = packed.cpu().numpy()
        experts, top_k = shape
        load, rest = packed[:, :experts], packed[:, experts:]
        scalars = dict(zip(_SCALARS, rest[:, :len(_SCALARS)].T, strict=True))
        share = rest[:, len(_SCALARS):len(_SCALARS) + top_k]
        cosel = rest[:, len(_SCALARS) + top_k:]
        tokens, micro_batches = scalars["tokens"], scalars["micro_batches"]
        return IntervalRouting(
            layers=np.array(layers, dtype=np.int64),
            tokens_per_expert=load,
            dropped=scalars["dropped"],
            assignments=tokens * top_k,
            entropy=scalars["entropy"] / tokens,
            top1_prob=scalars["top1_prob"] / tokens,
            maxvio_batch=scalars["maxvio_batch"] / micro_batches,
            choice_share=share / tokens[:, None],
            coselection=cosel.reshape(len(layers), experts, experts) if cosel.shape[1] else None,
            aux_loss=scalars["aux_loss"] / micro_batches,
            z_loss=scalars["z_loss"] / micro_batches,
            expert_bias=np.stack([biases[i].numpy() for i in layers]) if biases.keys() >= set(layers) else None,
        )


def routing_metrics(routing: IntervalRouting | None) -> dict[str, float | list[float]]:
    """The scalars (and per-expert load lists) for metrics.jsonl and wandb."""
    if routing is None:
        return {"train/aux_loss": 0.0, "train/z_loss": 0.0}
    out: dict[str, float | list[float]] = {
        "train/aux_loss": float(routing.aux_loss.mean()),
        "train/z_loss": float(routing.z_loss.mean()),
        "train/dropped_frac": float(routing.dropped.sum() / routing.assignments.sum()),
    }
    load, imbalance, dropped, maxvio = routing.load, routing.imbalance, routing.dropped_frac, routing.maxvio
    for n, i in enumerate(routing.layers):
        out[f"router/layer{i}/load"] = load[n].tolist()
        out[f"router/layer{i}/imbalance"] = float(imbalance[n])
        out[f"router/layer{i}/maxvio"] = float(maxvio[n])
        out[f"router/layer{i}/dropped"] = float(dropped[n])
        out[f"router/layer{i}/entropy"] = float(routing.entropy[n])
        out[f"router/layer{i}/top1_prob"] = float(routing.top1_prob[n])
    return out


def routing_rows(step: int, routing: IntervalRouting) -> dict[str, np.ndarray]:
    """One interval as columns, one row per layer (the ``routing/*.npy`` fields)."""
    rows = {
        "step": np.full(len(routing.layers), step, dtype=np.int64),
        "layer": routing.layers,
        "tokens_per_expert": routing.tokens_per_expert.round().astype(np.int64),
        "dropped": routing.dropped.round().astype(np.int64),
        "assignments": routing.assignments.round().astype(np.int64),
        "dropped_frac": routing.dropped_frac,
        "imbalance": routing.imbalance,
        "maxvio": routing.maxvio,
        "maxvio_batch": routing.maxvio_batch,
        "entropy": routing.entropy,
        "top1_prob": routing.top1_prob,
        "choice_share": routing.choice_share,
        "aux_loss": routing.aux_loss,
        "z_loss": routing.z_loss,
    }
    if routing.coselection is not None:
        rows["coselection"] = routing.coselection.round().astype(np.int64)
    if routing.expert_bias is not None:
        rows["expert_bias"] = routing.expert_bias
    return rows


def append_rows(path: Path, rows: np.ndarray) -> None:
    """Append ``rows`` along axis 0 of the .npy file at ``path`` (created if absent), in place.

    The data goes first, then the header's shape; a run killed in between leaves a file whose header
    still describes the rows before, which ``numpy.load`` reads (it ignores bytes past the shape).
    """
    rows = np.ascontiguousarray(rows)
    if not path.exists():  # whole or not at all: a half-written header would stop every later append and read
        with atomic_output(path) as handle:
            np.save(handle, rows)
        return
    with open_own_file(path, "r+b") as handle:
        version = npy.read_magic(handle)
        read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, fortran_order, dtype = read_header(handle)
        if dtype != rows.dtype or tuple(shape[1:]) != rows.shape[1:] or fortran_order:
            raise ValueError(f"{path} holds rows of {dtype} {tuple(shape[1:])}, cannot append {rows.dtype} "
                             f"{rows.shape[1:]}: the run directory belongs to a run of another shape; "
                             "use a new --run-dir")
        data_start = handle.tell()
        handle.seek(data_start + shape[0] * rows[0].nbytes)
        handle.write(rows.tobytes())
        handle.truncate()
        handle.seek(0)
        header = {"descr": npy.dtype_to_descr(dtype), "fortran_order": False, "shape": (shape[0] + len(rows),
                                                                                       *shape[1:])}
        (npy.write_array_header_1_0 if version == (1, 0) else npy.write_array_header_2_0)(handle, header)
        if handle.tell() != data_start:  # numpy leaves room for the first axis to grow; never expected
            raise RuntimeError(f"{path}: the .npy header changed length while appending")


def read_routing(run_dir: Path | str) -> dict[str, np.ndarray]:
    """The ``routing/*.npy`` fields of a run, cut to the rows every field has (a run killed mid-append)."""
    folder = Path(run_dir) / ROUTING_DIR
    files = sorted(folder.glob("*.npy"))
    if not files:
        raise FileNotFoundError(f"no routing statistics in {folder}: is {run_dir} a run directory of an MoE model?")
    fields = {}
    for f in files:
        try:
            fields[f.stem] = np.load(f)
        except (ValueError, OSError, EOFError) as exc:  # not an .npy array (numpy refuses pickled objects too)
            raise ValueError(f"{f} is not a routing statistics column ({' '.join(str(exc).split())[:160]}); "
                             "it was damaged after the run wrote it") from exc
    rows = min(len(v) for v in fields.values())
    return {name: values[:rows] for name, values in fields.items()}


def truncate_routing(run_dir: Path | str, step: int) -> None:
    """Drop the rows of intervals after ``step`` (a run resumed from the checkpoint of ``step``), so the files read
    as one run's; each file is replaced atomically. Rows past the ones every field has (a killed append) go too."""
    folder = Path(run_dir) / ROUTING_DIR
    if not (folder / "step.npy").is_file():
        return
    fields = read_routing(run_dir)
    keep = fields["step"] <= step
    if keep.all() and all(len(np.load(folder / f"{name}.npy", mmap_mode="r")) == len(keep) for name in fields):
        return
    for name, values in fields.items():
        with atomic_output(folder / f"{name}.npy") as handle:
            np.save(handle, values[keep])


def balancing_biases(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The aux-loss-free selection bias of each MoE layer that uses one, by layer index."""
    return {i: layer.router.expert_bias for i, layer in model.moe_layers().items()
            if layer.router.bias_update_rate > 0}
