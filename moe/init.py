"""Layout-independent initialisation: every weight element is a function of (seed, parameter name, position).

A model too large for one device is built on the meta device, spread over ranks, and only then given
memory; each rank must then initialise just the slice it holds, and that slice must hold exactly the
numbers the single-process model has there, whatever the layout (tensor, expert, pipeline or sharded data
parallelism) so that every layout trains the same model. Drawing from one global generator in parameter
order cannot do that: a rank would have to draw everything before its slice.

So each parameter is cut into fixed chunks of its *global* shape, and each chunk is drawn from its own
generator seeded with a hash of (run seed, parameter name, chunk index). A rank draws only the chunks that
overlap its slice, one at a time, and copies the overlap: building costs the rank's own shard plus one
chunk (``CHUNK_ELEMENTS``), never the whole parameter. A chunk is a run of consecutive rows of the first
dim whose rows fit in ``CHUNK_ELEMENTS`` (a tensor whose rows are larger is cut along the next dim, and so
on), so the chunking depends on the global shape alone. The numbers depend on the device type (CPU and
CUDA generators differ), not on the layout.

The rules (which distribution each parameter gets) live here, by name, in one place:

- norms' weights (``*norm.weight``: the block norms, and the per-head ``attn.q_norm``/``attn.k_norm`` of
  ``model.qk_norm``) and the hyper-connections' ``scale`` (``moe/hyper_connections.py``): ones;
- projections that write into the residual stream (attention ``wo`` or ``o_b_proj``, FFN and expert ``w_out``):
  N(0, init_std / sqrt(2 · n_layers)), so the residual's variance does not grow with depth (GPT-2,
  Radford et al. 2019 sec. 2.3; Megatron-LM's scaled init);
- biases (``wq``/``wk``/``wv`` with ``model.qkv_bias``; the router's ``gate_bias`` with ``moe.router_bias``; the
  experts' ``in_bias``/``gate_bias``/``out_bias`` with ``moe.expert_proj_bias``; the hyper-connections'): zeros,
  so a new model starts as one without them;
- every other weight (embedding, LM head, ``wq``/``wk``/``wv``, ``w_in``/``w_gate``, router gate):
  N(0, init_std).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

CHUNK_ELEMENTS = 1 << 20  # 4 MiB of fp32: the most one draw holds beyond the rank's own shard
RESIDUAL_OUTPUTS = ("wo", "w_out", "o_b_proj")


@dataclass(frozen=True)
class Slice:
    """Where a rank's local tensor sits in its parameter: ``local`` is ``global[offset : offset + local.shape]``."""

    local: Tensor
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]


def whole(param: Tensor) -> Slice:
    """The slice of a parameter held whole (one process, or replicated)."""
    return Slice(param.data, tuple(param.shape), (0,) * param.dim())


def init_std_for(name: str, std: float, out_std: float) -> float | None:
    """The standard deviation of parameter ``name``'s normal init: None for a norm's weight (ones), 0 for a bias
    (zeros)."""
    parts = name.split(".")
    if parts[-1].endswith("bias"):  # ``bias`` of a Linear, or a stacked one (``in_bias``, router ``gate_bias``)
        return 0.0
    leaf = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]
    if leaf.endswith("norm") or leaf == "scale":  # a norm's weight; the hyper-connections' scales
        return None
    return out_std if leaf in RESIDUAL_OUTPUTS else std


def chunk_seed(seed: int, name: str, chunk: tuple[int, ...]) -> int:
    """A 63-bit generator seed for one chunk of one parameter, the same on every rank and in every layout."""
    key = f"{seed}/{name}/{','.join(map(str, chunk))}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _chunks(shape: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...]
            ) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...], tuple[int, ...]]]:
    """The chunks of a tensor of global ``shape`` that overlap the box ``offset`` + ``size``.

    Yields (chunk index, the chunk's global slices, the chunk's shape). The chunk dim ``d`` is the first
    whose trailing dims hold at most ``CHUNK_ELEMENTS``; a chunk fixes one index of every dim before ``d``
    and takes a run of ``rows`` indices of ``d`` (with all of the trailing dims).
    """
    if any(s == 0 for s in size):
        return
    dims = len(shape)
    d = next(d for d in range(dims + 1) if math.prod(shape[d + 1:]) <= CHUNK_ELEMENTS) if dims else 0
    if d >= dims:  # a scalar
        yield (), (), ()
        return
    trailing = shape[d + 1:]
    rows = max(1, CHUNK_ELEMENTS // max(1, math.prod(trailing)))
    outer_ranges = [range(offset[i], offset[i] + size[i]) for i in range(d)]
    first, last = offset[d] // rows, (offset[d] + size[d] - 1) // rows
    for outer in _product(outer_ranges):
        for j in range(first, last + 1):
            start, stop = j * rows, min((j + 1) * rows, shape[d])
            slices = (*(slice(i, i + 1) for i in outer), slice(start, stop), *(slice(0, n) for n in trailing))
            yield (*outer, j), slices, (*(1 for _ in outer), stop - start, *trailing)


def _product(ranges: list[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


@torch.no_grad()
def fill_normal_(target: Slice, name: str, seed: int, std: float) -> None:
    """Fill ``target.local`` with its part of N(0, std²) drawn chunk by chunk (see the module docstring)."""
    local, offset = target.local, target.offset
    device = local.device
    for chunk, slices, chunk_shape in _chunks(target.global_shape, offset, tuple(local.shape)):
        generator = torch.Generator(device=device).manual_seed(chunk_seed(seed, name, chunk))
        drawn = torch.empty(chunk_shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator)
        # the overlap of the chunk with the box, in the chunk's and in the local tensor's coordinates
        src, dst = [], []
        for dim, whole_slice in enumerate(slices):
            lo = max(whole_slice.start, offset[dim])
            hi = min(whole_slice.stop, offset[dim] + local.shape[dim])
            src.append(slice(lo - whole_slice.start, hi - whole_slice.start))
            dst.append(slice(lo - offset[dim], hi - offset[dim]))
        local[tuple(dst)].copy_(drawn[tuple(src)])


@torch.no_grad()
def initialize(module: nn.Module, seed: int, std: float, out_std: float,
               locate: Callable[[Tensor], Slice] = whole) -> None:
    """Initialise every parameter of ``module`` by the rules above, layout-independently.

    ``locate`` says which slice of a parameter this process holds (``parallel.materialize`` passes one
    for DTensor shards); by default each parameter is whole. Names are ``module``'s own
    ``named_parameters`` names, so a submodule initialised on its own (a test's MoE layer) draws
    different numbers from the same submodule inside a model.
    """
    for name, param in module.named_parameters():
        target = locate(param)
        param_std = init_std_for(name, std, out_std)
        if param_std is None:
            target.local.fill_(1.0)
        elif param_std == 0.0:
            target.local.zero_()
        else:
            fill_normal_(target, name, seed, param_std)
