"""Routed experts as stacked weights, computed with grouped GEMM on tokens grouped by expert.

Shapes: N grouped tokens, D = d_model, H = expert hidden size, E experts.

Two backends compute the grouped GEMMs (``moe.backend``): ``torch`` (``torch.nn.functional.grouped_mm``, or a
padded ``bmm`` where that is missing) and ``megablocks`` (``grouped_gemm.ops.gmm``, the grouped GEMM the
MegaBlocks package builds on; CUDA and bf16 only). Both take the stacked weights as they are stored, so neither
copies them. ``auto`` picks megablocks only on GPUs where a benchmark measured it faster (``MEGABLOCKS_FASTER_ON``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from config.errors import ConfigError
from moe import workspace
from moe.swiglu_experts import runs_fused, swiglu_experts

HAS_GROUPED_MM = hasattr(F, "grouped_mm")

# GPUs (substrings of ``torch.cuda.get_device_name``) on which ``benchmarks/moe_layer.py --device cuda`` measured
# the megablocks backend faster than torch's for the layer: ``auto`` picks megablocks there. The H200 (2026-11-26,
# docs/gpu.md) is not one: megablocks was 4% faster at Mixtral's shape and 25% slower at the standard one, so
# ``auto`` is the torch backend everywhere measured so far.
MEGABLOCKS_FASTER_ON: tuple[str, ...] = ()

INSTALL_MEGABLOCKS = ("on a CUDA machine run `bash scripts/install_megablocks.sh` (it builds megablocks 0.10.0 and "
                      "grouped_gemm against your torch; `pip install -e .[megablocks]` lists them), or set "
                      "moe.backend=torch")


def megablocks_unavailable(device_type: str) -> str | None:
    """Why the megablocks backend cannot run on ``device_type`` here, or None when it can."""
    if device_type != "cuda":
        return "it runs only on CUDA GPUs (grouped_gemm's kernels are CUDA-only) and this run has none"
    try:
        import grouped_gemm.ops  # noqa: F401
    except ImportError as exc:  # also an installed package whose compiled extension is missing
        return f"grouped_gemm cannot be imported ({exc})"
    return None


def check_backend(requested: str, device_type: str) -> None:
    """Refuse ``moe.backend=megablocks`` before any work where it cannot run, saying why and how to install."""
    if requested == "megablocks":
        reason = megablocks_unavailable(device_type)
        if reason is not None:
            raise ConfigError(f"moe.backend=megablocks: {reason}; {INSTALL_MEGABLOCKS}")


@functools.cache
def _auto_backend(device: torch.device) -> str:
    """``auto`` on one device, decided once: megablocks where measured faster and installed, else torch."""
    if device.type != "cuda" or megablocks_unavailable("cuda") is not None:
        return "torch"
    name = torch.cuda.get_device_name(device)
    return "megablocks" if any(gpu in name for gpu in MEGABLOCKS_FASTER_ON) else "torch"


def compute_dtype(reference: Tensor) -> torch.dtype:
    """The dtype matrix products should run in: autocast's when it is on, else the tensor's own."""
    device = reference.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return reference.dtype


class _UseCopy(torch.autograd.Function):
    """``copy`` (a low-precision copy of ``weight``) in forward; the gradient cast back to ``weight``'s dtype."""

    @staticmethod
    def forward(ctx, weight: Tensor, copy: Tensor) -> Tensor:
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _cast(grad, ctx.dtype), None


def _cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor.to(dtype)`` on a workspace buffer (``moe/workspace.py``: kept between steps on a CPU)."""
    if tensor.dtype == dtype:
        return tensor
    return workspace.empty(tensor.shape, dtype, tensor.device).copy_(tensor)


class ComputeCopies:
    """Copies of fp32 weights in the compute dtype, made once per optimizer step rather than at every call.

    Under bf16 autocast each forward casts every fp32 weight its matmuls use, once per micro-batch, and
    keeps the copy until that micro-batch's backward. For the routed experts, most of an MoE model's
    weights, that is a pass over all of them per micro-batch, which the expert math alone (the floor
    ``benchmarks/moe_layer.py`` measures against) does not pay. A copy made here serves every micro-batch of
    an optimizer step and every micro-batch in flight in a pipeline. The optimizer drops the copies before
    it steps (``release_compute_copies``, hooked in by ``training.optim.build_optimizer``: a fused AdamW
    writes the weights without moving their version counters); a copy is also remade whenever its weight's
    version counter has moved since it was made (a checkpoint load, any in-place write autograd sees; not a
    write through ``.data``). Gradients reach the fp32 weight cast up from the matmul's, exactly as through
    autocast's cast, so training is unchanged.

    The memory: one copy of the weights it serves, held from a step's first forward to its optimizer step,
    instead of one per micro-batch in flight held until its backward (``analysis.memory_activations``
    counts it). Weights already in the compute dtype (FSDP's bf16 gathers:
    ``parallel.sharding.mixed_precision``) pass through.
    """

    def __init__(self):
        self._copies: dict[str, tuple[tuple, Tensor]] = {}

    def get(self, name: str, weight: Tensor, dtype: torch.dtype) -> Tensor:
        """``weight`` in ``dtype``: the kept copy while ``weight`` is unchanged, else a new one."""
        if weight.dtype == dtype:
            return weight
        key = (weight._version, weight.data_ptr(), tuple(weight.shape), dtype)
        kept = self._copies.get(name)
        if kept is None or kept[0] != key:
            with torch.no_grad():
                kept = (key, _cast(weight.detach(), dtype))
            self._copies[name] = kept
        return _UseCopy.apply(weight, kept[1])

    def tensors(self) -> list[Tensor]:
        return [copy for _, copy in self._copies.values()]

    def clear(self) -> None:
        self._copies.clear()


def release_compute_copies(model: nn.Module) -> None:
    """Drop every compute copy in ``model``: its weights are about to change (an optimizer step)."""
    for module in model.modules():
        if isinstance(copies := getattr(module, "compute_copies", None), ComputeCopies):
            copies.clear()


def _grouped_mm_supported(x: Tensor, weight: Tensor) -> bool:
    """torch's grouped_mm wants 16-byte aligned rows everywhere, and bf16 on CUDA."""
    if not HAS_GROUPED_MM:
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    return all(dim * x.element_size() % 16 == 0 for dim in (x.shape[-1], weight.shape[-1]))


def _padded_bmm(x: Tensor, weight: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """Fallback for torches without grouped_mm: pad each group to the largest and use one bmm."""
    num_experts = weight.shape[0]
    group = torch.repeat_interleave(torch.arange(num_experts, device=x.device), tokens_per_expert)
    starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
    slot = torch.arange(x.shape[0], device=x.device) - starts[group]
    longest = int(tokens_per_expert.max()) if x.shape[0] else 0  # one host sync
    padded = x.new_zeros(num_experts, longest, x.shape[1]).index_put((group, slot), x)
    return torch.bmm(padded, weight)[group, slot]


def _megablocks_gmm(x: Tensor, weight: Tensor, batch_sizes: Tensor) -> Tensor:
    """``grouped_gemm.ops.gmm``: a [N, in] bf16, b [E, in, out] bf16 (``trans_b=False``: our stacked layout, no
    copy), group sizes as a CPU int64 tensor (its cuBLAS path reads them on the host). Autograd included."""
    from grouped_gemm.ops import gmm

    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ConfigError(f"moe.backend=megablocks computes in bf16 only (got {x.dtype} tokens, {weight.dtype} "
                          "weights): set train.precision=bf16, or moe.backend=torch")
    return gmm(x.contiguous(), weight.contiguous(), batch_sizes, trans_b=False)


def grouped_matmul(x: Tensor, weight: Tensor, tokens_per_expert: Tensor, backend: str = "torch") -> Tensor:
    """Row block ``e`` of ``x`` times ``weight[e]``: [N, in] x [E, in, out] -> [N, out].

    The blocks are consecutive with sizes ``tokens_per_expert`` (summing to N); empty
    groups are fine. One kernel for all experts: no Python loop over experts.
    ``backend="megablocks"`` wants ``tokens_per_expert`` on the host (``expert_ffn`` copies it once per layer).
    """
    if backend == "megablocks":
        return _megablocks_gmm(x, weight, tokens_per_expert)
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return _eager_grouped_matmul(x, weight, tokens_per_expert)
    return _torch_grouped_matmul(x, weight, tokens_per_expert)


def _torch_grouped_matmul(x: Tensor, weight: Tensor, tokens_per_expert: Tensor) -> Tensor:
    if _grouped_mm_supported(x, weight):
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        return F.grouped_mm(x, weight, offs=offsets)
    return _padded_bmm(x, weight, tokens_per_expert)


@torch.compiler.disable
def _eager_grouped_matmul(x: Tensor, weight: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """The grouped GEMM outside ``torch.compile`` (``train.compile``) for dtypes other than bf16: torch's
    meta kernel of ``grouped_mm`` (what compilation traces with) accepts bf16 only, though the CPU kernel takes
    fp32 too, and the padded fallback has a data-dependent shape. So fp32 blocks compile around their experts."""
    return _torch_grouped_matmul(x, weight, tokens_per_expert)


class GroupedExperts(nn.Module):
    """E feed-forward experts with stacked weights: SwiGLU, GELU, GPT-OSS's clamped or DeepSeek-V4's limited SwiGLU.

    ``forward(x, tokens_per_expert)`` takes tokens already grouped by expert and the
    group sizes, and returns outputs in the same order. This narrow signature is the
    seam expert parallelism hooks into: ``parallel/expert.py`` wraps this module to
    exchange tokens between ranks before and after it, and the rest of ``MoELayer``
    never knows.

    Weights are stored input-major (``w_in: [E, D, H]``, ``w_out: [E, H, D]``) so the
    grouped GEMM reads them without transposes. SwiGLU (Shazeer 2020) keeps its gate
    and up projections separate (``w_gate``, ``w_in``) so tensor parallelism can split
    both on H without reshuffling (GPT-OSS interleaves them in one matrix: an import
    de-interleaves). With ``bias`` (``moe.expert_proj_bias``, GPT-OSS) each projection
    has a bias per expert, stacked like the weights (``in_bias``/``gate_bias`` [E, H],
    ``out_bias`` [E, D]) so expert parallelism shards them on dim 0 with their experts.
    """

    def __init__(self, num_experts: int, d_model: int, hidden: int, activation: str = "swiglu",
                 backend: str = "torch", bias: bool = False, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0):
        super().__init__()
        self.num_experts = num_experts
        self.activation = activation
        self.backend = backend  # moe.backend: torch, megablocks or auto
        gated = activation in ("swiglu", "clamped_swiglu", "limited_swiglu")
        # how the gated activation bounds its inputs (``expert_ffn``'s ``clamp``): GPT-OSS's (alpha, limit), or
        # DeepSeek-V4's (None, limit)
        self.clamp = {"clamped_swiglu": (swiglu_alpha, swiglu_limit),
                      "limited_swiglu": (None, swiglu_limit)}.get(activation)
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, hidden)) if gated else None
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.in_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.gate_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias and gated else None
        self.out_bias = nn.Parameter(torch.empty(num_experts, d_model)) if bias else None
        self.compute_copies = ComputeCopies()

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """x: [N, D] grouped by expert; tokens_per_expert: [E] -> [N, D] in the compute dtype."""
        biases = None
        if self.in_bias is not None:
            biases = ExpertBiases(self.in_bias, self.gate_bias, self.out_bias)
        return expert_ffn(x, tokens_per_expert, self.w_in, self.w_gate, self.w_out, self.compute_copies,
                          self.backend, biases=biases, clamp=self.clamp)


class ExpertBiases(NamedTuple):
    """The stacked biases of the experts' projections (``moe.expert_proj_bias``): [E, H], [E, H] or None, [E, D]."""

    in_bias: Tensor
    gate_bias: Tensor | None
    out_bias: Tensor


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's gated activation ``silu(gate) * up`` (Shazeer 2020, eq. 5), as one autograd node: see ``_SwiGLU``."""
    return _SwiGLU.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` with the same kernels and saved tensors as autograd's two nodes, one allocation fewer.

    Autograd differentiates ``F.silu(gate) * up`` as a multiply's backward (two new tensors: ``grad * up`` and
    ``grad * silu(gate)``) and then silu's backward, a third new tensor. Here silu's backward writes its result
    over ``grad * up``, which nothing else reads: on the standard layer in bf16 on CPU ([8256, 1024] rows) the
    activation's forward and backward take about 10% less time (fresh [N, H] buffers cost page faults and cache
    misses), with bit-identical gradients. It saves what autograd saved: the gate, ``silu(gate)`` and ``up``.
    """

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        activated = F.silu(gate)
        ctx.save_for_backward(gate, activated, up)
        return activated * up

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        gate, activated, up = ctx.saved_tensors
        grad_gate = grad * up
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate, grad * activated


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """GPT-OSS's gated activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate,
    limit)``.

    ``g * sigmoid(1.702 g)`` is the sigmoid approximation of GELU (Hendrycks and Gimpel 2016, sec. 2); the clamps
    bound the activation so a few outlier tokens cannot blow up an expert's output (OpenAI's gpt-oss model card),
    and the ``+ 1`` lets the up projection scale around one rather than zero. Only the gate's upper side is capped:
    its negative side is already squashed by the sigmoid.
    """
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def limited_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """DeepSeek-V4's gated activation: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``. SwiGLU with its
    inputs bounded (the gate from above only: silu is already small below), so outlier tokens cannot blow up an
    expert's output (``transformers``' ``deepseek_v4`` experts and shared experts, limit 10)."""
    return swiglu(gate.clamp(max=limit), up.clamp(min=-limit, max=limit))


def gated_activation(gate: Tensor, up: Tensor, clamp: tuple[float | None, float] | None) -> Tensor:
    """The gated activation ``clamp`` names (``GroupedExperts.clamp``): SwiGLU (None), GPT-OSS's clamped SwiGLU
    ((alpha, limit)) or DeepSeek-V4's limited SwiGLU ((None, limit))."""
    if clamp is None:
        return swiglu(gate, up)
    alpha, limit = clamp
    return limited_swiglu(gate, up, limit) if alpha is None else clamped_swiglu(gate, up, alpha, limit)


def _add_row_bias(rows: Tensor, bias: Tensor, row_expert: Tensor) -> Tensor:
    """Each grouped row plus its expert's bias: [N, F] + bias[row_expert] ([E, F] gathered per row)."""
    return rows + bias.index_select(0, row_expert)


def expert_ffn(x: Tensor, tokens_per_expert: Tensor, w_in: Tensor, w_gate: Tensor | None, w_out: Tensor,
               copies: ComputeCopies, backend: str = "torch", *, biases: ExpertBiases | None = None,
               clamp: tuple[float | None, float] | None = None) -> Tensor:
    """The experts' feed-forward on grouped rows, given their stacked weights (SwiGLU when ``w_gate`` is set).

    A function of the weights, not of the module, so ``parallel/expert.py`` runs the same math on the
    local slice of an ep-sharded stack. ``copies`` holds the weights' compute-dtype copies between calls.
    ``backend``: ``moe.backend`` (``auto`` is decided once per device). The megablocks backend reads the
    group sizes on the host: one device-to-host copy per layer and pass. Where oneDNN runs the GEMMs
    (``row_multiple_on``) the groups are padded to whole blocks of rows around them. ``biases`` (the local
    experts' slices) are added to each row from its expert's; ``clamp`` bounds the gated activation
    (``gated_activation``). The bias adds are one elementwise pass each over the
    rows, not fused into the GEMM (neither grouped GEMM backend takes a per-group bias). On a CPU, plain SwiGLU
    without biases runs as one autograd node on kept buffers (``moe.swiglu_experts``, ``runs_fused``).
    """
    if backend == "auto":
        backend = _auto_backend(x.device)
    if backend == "megablocks":
        tokens_per_expert = tokens_per_expert.to("cpu", torch.int64)
    dtype = compute_dtype(x)
    x = _cast(x, dtype)
    padding, multiple = None, row_multiple_on(x.device.type, dtype)
    if multiple > 1 and not torch.compiler.is_compiling():  # CPU only, where the backend is torch's
        padding = GroupPadding(tokens_per_expert, multiple)
        x, tokens_per_expert = padding.pad(x), padding.padded_counts
    activation = "gelu" if w_gate is None else "swiglu" if clamp is None else "clamped"
    if (backend == "torch" and runs_fused(x.device.type, activation, biases is not None)
            and not torch.compiler.is_compiling()):
        w_in, w_gate, w_out = (copies.get(name, weight, dtype) for name, weight in
                               (("w_in", w_in), ("w_gate", w_gate), ("w_out", w_out)))
        out = swiglu_experts(x, tokens_per_expert, w_gate, w_in, w_out)
        return out if padding is None else padding.unpad(out)
    row_expert = None
    if biases is not None:  # output_size given: no host sync to size the result
        experts = torch.arange(w_in.shape[0], device=x.device)
        row_expert = torch.repeat_interleave(experts, tokens_per_expert.to(x.device), output_size=x.shape[0])

    def project(rows: Tensor, name: str, weight: Tensor, bias: Tensor | None) -> Tensor:
        out = grouped_matmul(rows, copies.get(name, weight, dtype), tokens_per_expert, backend)
        if bias is None:
            return out
        return _add_row_bias(out, copies.get(name.replace("w_", "") + "_bias", bias, dtype), row_expert)

    hidden = project(x, "w_in", w_in, biases.in_bias if biases else None)
    if w_gate is not None:
        gate = project(x, "w_gate", w_gate, biases.gate_bias if biases else None)
        hidden = gated_activation(gate, hidden, clamp)
    else:
        hidden = F.gelu(hidden)
    out = project(hidden, "w_out", w_out, biases.out_bias if biases else None)
    return out if padding is None else padding.unpad(out)


# Rows per block that groups are padded to where oneDNN runs the grouped GEMMs (``row_multiple_on``).
ONEDNN_GROUP_ROWS = 16


def padded_size(size, multiple: int):
    """``size`` (an int or an integer tensor) rounded up to a multiple of ``multiple``: a padded group's rows."""
    return (size + multiple - 1) // multiple * multiple


def padded_rows(group_sizes: list[int], multiple: int) -> int:
    """Rows of groups of these sizes, each padded to a multiple of ``multiple`` (``GroupPadding``'s layout)."""
    return sum(padded_size(size, multiple) for size in group_sizes)


def row_multiple_on(device_type: str, dtype: torch.dtype) -> int:
    """The multiple of rows each expert's group is padded to before its GEMMs: ``ONEDNN_GROUP_ROWS`` for
    bf16 or fp16 rows on CPU, else 1 (no padding).

    On CPU, torch runs bf16 matmuls through oneDNN, which compiles (JIT) a kernel for every new GEMM shape
    and keeps 1,024 in a cache. The grouped GEMM is one matmul per expert, whose row count is that expert's
    group size: it changes every step as the router learns, so nearly every call compiled a kernel (about
    400 per step of ``moe-8x``, each mapping fresh memory). Padded to blocks of 16 rows the shapes repeat and
    stay cached: in ``benchmarks/train_step.py`` the profiled expert GEMMs of a ``moe-8x`` step took half the
    time and steps 0.254-0.270 s against 0.278-0.292 s in three alternating pairs (docs/performance.md), for at most
    15 rows of zeros per expert. fp32 and fp64 run through BLAS kernels that compile
    nothing, and CUDA's grouped GEMM takes the group offsets as data.
    """
    return ONEDNN_GROUP_ROWS if device_type == "cpu" and dtype in (torch.bfloat16, torch.float16) else 1


class GroupPadding:
    """Grouped rows laid out with each group padded to a multiple of ``multiple`` rows with zeros.

    Row ``i`` moves to row ``destination[i]``; padding rows stay zero, so they add nothing to any weight's
    gradient (their inputs are zero in the first GEMMs, their output gradients zero in the last), and the
    outputs read back are the unpadded rows' own. The group sizes are read on the host once (free on CPU,
    the only device that pads).
    """

    def __init__(self, tokens_per_expert: Tensor, multiple: int):
        counts = tokens_per_expert.to(torch.int64)
        self.padded_counts = padded_size(counts, multiple)
        extra = self.padded_counts - counts
        shift = torch.cumsum(extra, 0) - extra  # padding rows before each group
        self.destination = torch.arange(int(counts.sum()), device=counts.device) + shift.repeat_interleave(counts)
        self.num_padded = int(self.padded_counts.sum())
        # the rows no input row moves to: zeroed alone, not the whole buffer first (at most multiple - 1 per group)
        is_padding = torch.ones(self.num_padded, dtype=torch.bool, device=counts.device)
        self.padding_rows = is_padding.index_fill_(0, self.destination, False).nonzero().squeeze(1)

    def pad(self, x: Tensor) -> Tensor:
        """[N, D] -> [N_padded, D]."""
        return _MoveRows.apply(x, self.destination, self.padding_rows, self.num_padded)

    def unpad(self, y: Tensor) -> Tensor:
        """[N_padded, D] -> [N, D]."""
        return _MoveRows.apply(y, self.destination, self.padding_rows, None)


class _MoveRows(torch.autograd.Function):
    """Row ``i`` of ``x`` to row ``destination[i]`` of ``num_rows`` rows whose ``padding_rows`` are zero, or, with
    ``num_rows=None``, the inverse: row ``destination[i]`` of ``x`` back to row ``i``. Each direction's gradient is
    the other, so both are a copy of the rows with no scatter-add (the destinations are distinct). Padding writes
    zeros into the padding rows only rather than zero-filling the whole buffer first: one pass over the rows fewer
    (each forward and each backward of a layer on CPU in bf16, the only place that pads)."""

    @staticmethod
    def forward(ctx, x: Tensor, destination: Tensor, padding_rows: Tensor, num_rows: int | None) -> Tensor:
        if num_rows is None:  # its backward pads: it needs the padding rows too
            ctx.save_for_backward(destination, padding_rows)
            ctx.num_rows = x.shape[0]
            return workspace.gather_rows(x, destination)
        ctx.save_for_backward(destination)
        ctx.num_rows = None
        padded = workspace.empty((num_rows, x.shape[1]), x.dtype, x.device).index_copy_(0, destination, x)
        return padded.index_fill_(0, padding_rows, 0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        destination, *padding_rows = ctx.saved_tensors
        padding_rows = padding_rows[0] if padding_rows else None
        return _MoveRows.apply(grad, destination, padding_rows, ctx.num_rows), None, None, None
