"""The unified group manager: the only code that turns ranks into device meshes and process groups.

Two views over the same flat ranks, both row-major over ``arange(world_size)`` (last axis fastest):

    dense  (pp, dp_replicate, dp_shard, cp, tp)   attention, dense FFNs, embeddings
    expert (pp, dp_replicate, edp, ep, etp)       routed experts

Expert parallelism folds over the sharded-data-, context- and tensor-parallel ranks (Megatron-Core "MoE
parallel folding"; torchtitan keeps EP inside dp_shard·cp·tp the same way): ep · etp · edp = dp_shard · cp · tp.
pp is outermost and dp_replicate the outer replica axis in both views, so pipeline and HSDP replica groups
are the same ranks in both; tp, ep and etp are innermost, i.e. contiguous ranks within a node, and cp next
to tp, since its ranks exchange keys and values in every attention layer.

Context-parallel ranks hold different tokens of the same sequences, so for the gradients they are data-parallel
ranks: FSDP shards and reduces over dp_shard × cp (the flattened ``dp_shard_cp``), the loss and the routing
statistics are reduced over dp_replicate × dp_shard × cp (``dp_cp``), and only the sampler asks for "dp" (the
ranks that draw different sequences).

Rule for etp: etp must divide tp, so every expert-tensor-parallel group lies inside one tensor-parallel
group. The tokens entering an MoE layer are the same (or sequence-sharded) across a tp group, so an etp
group nested in it needs no gather across data-parallel ranks, and stays within a node as tp does. This
admits both torchtitan-classic cases (etp = 1, etp = tp) and Megatron's usual etp < tp; a wider etp
spanning dp_shard ranks (which Megatron also allows) can be admitted later without breaking layouts.

Pure part (no processes): ``Layout`` (degrees, validated at construction), ``validate_for_model``,
``valid_layouts``, ``rank_grid``, ``groups_for``, ``coordinates``, ``expert_nodes``, ``describe_layout``. Process part:
``ParallelGroups.build``, built once in ``train.py`` and passed explicitly; there is no module state.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from config.parallel import DEGREES

DENSE = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT = ("pp", "dp_replicate", "edp", "ep", "etp")
VIEWS = {"dense": DENSE, "expert": EXPERT}
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "edp", "ep", "etp")
# Flattened axes, built as one group each: "dp" the ranks that draw different sequences (the sampler), "dp_cp"
# the ranks that hold different tokens (loss, token-count and routing reductions), "dp_shard_cp" FSDP's shards.
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
             "dp_shard_cp": ("dp_shard", "cp")}


# ---------------------------------------------------------------------------
# Layout: degrees, -1 resolution and validation with the nearest valid layouts
# ---------------------------------------------------------------------------


class _Invalid(Exception):
    """One impossible setting: which parallel.* key is at fault (None: no single key) and why."""

    def __init__(self, key: str | None, reason: str):
        super().__init__(reason)
        self.key, self.reason = key, reason


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fill(world: int, req: dict[str, int]) -> dict[str, int]:
    """Resolve the one -1 and check the world-size product and the folding rule; raises _Invalid."""
    for key in DEGREES:
        value = req[key]
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise _Invalid(key, f"parallel.{key}={value!r} must be a positive integer, or -1 for whatever is left")
    rest = [k for k in DEGREES if req[k] == -1]
    if len(rest) > 1:
        raise _Invalid(None, f"{' and '.join('parallel.' + k for k in rest)} are -1; at most one degree may be "
                             "-1 (whatever is left)")
    d = dict(req)
    dense = " × ".join(f"{k}={req[k]}" for k in _named(DENSE, req) if req[k] != -1)
    if rest and rest[0] in DENSE:
        product = math.prod(req[k] for k in DENSE if req[k] != -1)
        if world % product:
            raise _Invalid(None, f"parallel.{rest[0]}=-1 cannot fill the rest: {dense} = {product} does not divide "
                                 f"the world of {world} ranks")
        d[rest[0]] = world // product
    elif math.prod(req[k] for k in DENSE) != world:
        raise _Invalid(None, f"parallel degrees {dense} = {math.prod(req[k] for k in DENSE)} do not match the world "
                             f"of {world} ranks (a degree of -1 fills the rest)")
    fold = d["dp_shard"] * d["cp"] * d["tp"]
    folded = _named(("dp_shard", "cp", "tp"), d)
    fold_keys = " × ".join(f"parallel.{k}" for k in folded)
    if rest and rest[0] in ("ep", "etp"):  # -1 on ep or etp takes the whole fold: edp = 1
        other = "etp" if rest[0] == "ep" else "ep"
        if fold % d[other]:
            raise _Invalid(None, f"parallel.{rest[0]}=-1 cannot fill the rest: parallel.{other}={d[other]} does not "
                                 f"divide {fold_keys} = {fold}")
        d[rest[0]] = fold // d[other]
    if d["tp"] % d["etp"]:
        raise _Invalid("etp", f"parallel.etp={d['etp']}{' (the rest)' if rest == ['etp'] else ''} does not divide "
                              f"parallel.tp={d['tp']} (expert-tensor-parallel groups nest inside tensor-parallel "
                              "groups)")
    if fold % (d["ep"] * d["etp"]):
        raise _Invalid("ep", f"parallel.ep={d['ep']} × parallel.etp={d['etp']} does not divide {fold_keys} = "
                             f"{' × '.join(str(d[k]) for k in folded)} = {fold} (expert parallelism folds over the "
                             f"sharded-data-{', context-' if d['cp'] > 1 else ''} and tensor-parallel ranks)")
    return d


def _named(keys: tuple[str, ...], degrees: dict[str, int]) -> tuple[str, ...]:
    """The keys a message or a layout's description names: cp only when context parallelism is on (a layout
    without it reads, and is written on a command line, as before cp existed)."""
    return tuple(k for k in keys if k != "cp" or degrees["cp"] != 1)


def _check_model(d: dict[str, int], model: ModelConfig, moe: MoEConfig) -> None:
    """Model-dependent limits of a resolved layout; raises _Invalid."""
    has_moe = model.n_moe_layers > 0
    has_dense_ffn = model.n_moe_layers < model.n_layers
    checks = [
        ("cp", model.seq_len % (2 * d["cp"]) == 0 or d["cp"] == 1,
         f"parallel.cp={d['cp']}: model.seq_len={model.seq_len} must split into 2 × cp = {2 * d['cp']} equal chunks "
         "(each context-parallel rank holds one chunk from the front of the sequence and one from the back)"),
        ("pp", d["pp"] <= model.n_layers, f"parallel.pp={d['pp']} is more pipeline stages than "
                                          f"model.n_layers={model.n_layers}"),
        ("tp", model.n_heads % d["tp"] == 0, f"parallel.tp={d['tp']} does not divide model.n_heads={model.n_heads}"),
        ("tp", model.kv_heads % d["tp"] == 0, f"parallel.tp={d['tp']} does not divide the key/value heads "
                                              f"model.n_kv_heads={model.kv_heads}"),
        ("tp", not has_dense_ffn or model.ffn_hidden % d["tp"] == 0,
         f"parallel.tp={d['tp']} does not divide model.ffn_hidden={model.ffn_hidden}"),
        ("tp", not has_moe or moe.num_shared_experts == 0 or moe.shared_hidden % d["tp"] == 0,
         f"parallel.tp={d['tp']} does not divide the shared-expert hidden size {moe.shared_hidden}"),
        ("ep", has_moe or d["ep"] == 1, f"parallel.ep={d['ep']} needs MoE layers, but the model has none"),
        ("etp", has_moe or d["etp"] == 1, f"parallel.etp={d['etp']} needs MoE layers, but the model has none"),
        ("ep", moe.num_experts % d["ep"] == 0,
         f"parallel.ep={d['ep']} does not divide moe.num_experts={moe.num_experts}"),
        ("etp", moe.expert_hidden % d["etp"] == 0,
         f"parallel.etp={d['etp']} does not divide moe.expert_hidden={moe.expert_hidden}"),
        ("etp", not (has_moe and moe.expert_proj_bias) or d["etp"] == 1,
         f"parallel.etp={d['etp']} with moe.expert_proj_bias: every etp rank would add the experts' down-projection "
         "bias to its partial sum; use etp=1 (expert parallelism alone)"),
    ]
    for key, ok, reason in checks:
        if not ok:
            raise _Invalid(key, reason)
    _check_expert_sharding(d, model, moe)


def _check_expert_sharding(d: dict[str, int], model: ModelConfig, moe: MoEConfig) -> None:
    """FSDP2 shards each expert stack [E/ep, ...] over the edp ranks on the experts dim when they split evenly,
    else on a width dim (``parallel.sharding.expert_fsdp_dim``: d_model, or expert_hidden when etp leaves it
    whole), and FSDP2 refuses an uneven split of any dim but the first. Experts in a unit of their own (ep, etp or
    tp > 1) with edp > 1 must then have those widths divide by edp; raises _Invalid otherwise."""
    edp = d["dp_shard"] * d["cp"] * d["tp"] // (d["ep"] * d["etp"])
    local = moe.num_experts // d["ep"]
    spread = d["ep"] > 1 or d["etp"] > 1 or d["tp"] > 1
    if model.n_moe_layers == 0 or not spread or edp == 1 or local % edp == 0:
        return
    widths = {"model.d_model": model.d_model, **({} if d["etp"] > 1 else {"moe.expert_hidden": moe.expert_hidden})}
    uneven = [f"{key}={value}" for key, value in widths.items() if value % edp]
    if uneven:
        raise _Invalid("ep", f"the {local} experts per expert-parallel rank (moe.num_experts={moe.num_experts} / "
                             f"parallel.ep={d['ep']}) do not split over the {edp} expert-data-parallel ranks, so FSDP "
                             f"would shard each expert's width instead, and {' and '.join(uneven)} does not divide "
                             f"by {edp}")


# A caller's further checks of a layout (train.py's: the batch split, the pipeline schedule, tensor parallelism's
# options), returning why a layout is refused or None: suggestions pass them too, so that no message suggests a
# layout that would itself be refused.
Accept = Callable[["Layout"], "str | None"]


def _is_valid(world: int, req: dict[str, int], model: ModelConfig | None, moe: MoEConfig | None,
              accept: Accept | None = None) -> bool:
    try:
        d = _fill(world, req)
        if model is not None and moe is not None:
            _check_model(d, model, moe)
    except _Invalid:
        return False
    return accept is None or accept(Layout(world, **d)) is None


def _suggest(world: int, req: dict[str, int], key: str | None, model: ModelConfig | None,
             moe: MoEConfig | None, accept: Accept | None = None) -> str:
    """The valid values of the faulty key with everything else kept, else the nearest valid layouts (valid for the
    model too when it is given, and passing ``accept``)."""
    rest = next((k for k in DEGREES if req[k] == -1), None)
    if key is not None:
        values = [v for v in _divisors(world) if _is_valid(world, {**req, key: v}, model, moe, accept)]
        if values:
            kept = ", ".join(f"{k}={req[k]}" for k in DEGREES if k not in (key, rest) and req[k] != 1)
            return (f"valid {key} for this world of {world} ranks{' with ' + kept if kept else ''}: "
                    f"{', '.join(map(str, values))}")

    def distance(layout: Layout) -> tuple[int, float]:
        # Fewest keys changed, then the smallest changes by factor; a nonsense request value counts as 1.
        asked = {k: req[k] if isinstance(req[k], int) and req[k] >= 1 else 1 for k in DEGREES}
        changed = [k for k in DEGREES if k != rest and getattr(layout, k) != req[k]]
        return len(changed), sum(abs(math.log2(getattr(layout, k) / asked[k])) for k in changed)

    layouts = valid_layouts(world, model, moe)
    refusals = [accept(layout) for layout in layouts] if accept is not None else [None] * len(layouts)
    nearest = sorted((layout for layout, why in zip(layouts, refusals, strict=True) if why is None), key=distance)[:3]
    if not nearest:
        return f"no layout of {world} ranks fits this model" + (f" and run (e.g. {refusals[0]})" if layouts else "")
    return f"nearest valid layouts for {world} ranks: {'; '.join(layout.degrees() for layout in nearest)}"


@dataclass(frozen=True)
class Layout:
    """Degrees of the parallel dimensions over ``world_size`` ranks; always valid once constructed.

    ``pp`` pipeline stages, ``dp_replicate`` HSDP replicas (outer data parallel), ``dp_shard`` FSDP shards,
    ``cp`` context parallel (sequence slices), ``tp`` tensor parallel; for the experts ``ep`` expert parallel and
    ``etp`` expert tensor parallel, with ``edp`` = dp_shard·cp·tp/(ep·etp) expert data parallel derived. ``rest``
    records which degree was -1 in the request, so that suggestions for an impossible model layout keep it free.
    """

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    rest: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"world size must be a positive integer, got {self.world_size!r}")
        if self.rest not in (None, *DEGREES):
            raise ConfigError(f"Layout.rest={self.rest!r} must be None or one of {', '.join(DEGREES)}")
        req = {k: getattr(self, k) for k in DEGREES}
        try:
            if -1 in req.values():
                raise _Invalid(None, "a Layout holds resolved degrees; use Layout.resolve to fill a -1")
            _fill(self.world_size, req)
        except _Invalid as exc:
            raise ConfigError(f"{exc.reason}; {_suggest(self.world_size, req, exc.key, None, None)}") from None

    @classmethod
    def resolve(cls, world_size: int, pp: int = 1, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1,
                ep: int = 1, etp: int = 1, cp: int = 1, *, model: ModelConfig | None = None,
                moe: MoEConfig | None = None, accept: Accept | None = None) -> Layout:
        """Fill the one degree given as -1 ("whatever is left") and validate; ConfigError names the fix.

        ``model``/``moe``/``accept`` only narrow the suggestions of a refusal to layouts that would pass
        ``validate_for_model`` and ``accept`` (the model itself is checked by ``validate_for_model``)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
        req = dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp)
        try:
            d = _fill(world_size, req)
        except _Invalid as exc:
            raise ConfigError(f"{exc.reason}; {_suggest(world_size, req, exc.key, model, moe, accept)}") from None
        return cls(world_size, **d, rest=next((k for k in DEGREES if req[k] == -1), None))

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks of one dp_shard × cp × tp block that hold the same experts."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of different micro-batches per step (the sampler's world)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """The ranks of one pipeline stage and tp group that hold different tokens of a step (dp × cp): the loss,
        the routing statistics and the gradients are means or sums over them."""
        return self.dp * self.cp

    @property
    def dp_shard_cp(self) -> int:
        """FSDP's shard count: dp_shard × cp (context-parallel ranks reduce gradients as data-parallel ones)."""
        return self.dp_shard * self.cp

    def degree(self, axis: str) -> int:
        """The size of an axis of either view, or of a flattened axis ("dp")."""
        if axis not in AXES and axis not in FLATTENED:
            raise ValueError(f"unknown parallel axis '{axis}'; valid axes: {', '.join((*AXES, *FLATTENED))}")
        return getattr(self, axis)

    def enabled(self, axis: str) -> bool:
        return self.degree(axis) > 1

    pp_enabled = property(lambda self: self.pp > 1)
    dp_replicate_enabled = property(lambda self: self.dp_replicate > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard > 1)
    cp_enabled = property(lambda self: self.cp > 1)
    tp_enabled = property(lambda self: self.tp > 1)
    ep_enabled = property(lambda self: self.ep > 1)
    etp_enabled = property(lambda self: self.etp > 1)

    def shape(self, view: str) -> tuple[int, ...]:
        return tuple(self.degree(axis) for axis in _view_axes(view))

    def degrees(self) -> str:
        """The parallel.* keys, e.g. "pp=1 dp_replicate=1 dp_shard=4 tp=2 ep=2 etp=1" (cp too when it is above 1)."""
        return " ".join(f"{k}={getattr(self, k)}" for k in _named(DEGREES, self.requested()))

    def requested(self) -> dict[str, int]:
        """The degrees as requested: the resolved one back at -1."""
        return {k: -1 if k == self.rest else getattr(self, k) for k in DEGREES}


def validate_for_model(layout: Layout, model: ModelConfig, moe: MoEConfig, accept: Accept | None = None) -> None:
    """Check the layout against the model's shapes before anything is built; ConfigError names the fix.

    ep divides the experts, tp the attention and key/value heads and the dense and shared-expert hidden
    sizes, etp the expert hidden size; pp is at most the number of layers; ep/etp > 1 need MoE layers.
    Suggestions also pass ``accept``, the caller's further checks.
    """
    req = layout.requested()
    try:
        _check_model(_fill(layout.world_size, req), model, moe)
    except _Invalid as exc:
        raise ConfigError(f"{exc.reason}; {_suggest(layout.world_size, req, exc.key, model, moe, accept)}") from None


def valid_layouts(world_size: int, model: ModelConfig | None = None, moe: MoEConfig | None = None) -> list[Layout]:
    """Every valid layout of ``world_size`` ranks (for the model too, when given), pp slowest to etp fastest."""
    layouts = []
    for pp in _divisors(world_size):
        for dp_replicate in _divisors(world_size // pp):
            for cp in _divisors(world_size // (pp * dp_replicate)):
                for tp in _divisors(world_size // (pp * dp_replicate * cp)):
                    dp_shard = world_size // (pp * dp_replicate * cp * tp)
                    for etp in _divisors(tp):
                        for ep in _divisors(dp_shard * cp * tp // etp):
                            d = dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep,
                                     etp=etp)
                            if model is not None and moe is not None:
                                try:
                                    _check_model(d, model, moe)
                                except _Invalid:
                                    continue
                            layouts.append(Layout(world_size, **d))
    return layouts


# ---------------------------------------------------------------------------
# Pure rank arithmetic: both views are reshapes of the same arange(world_size)
# ---------------------------------------------------------------------------


def _view_axes(view: str) -> tuple[str, ...]:
    if view not in VIEWS:
        raise ValueError(f"unknown view '{view}'; valid views: {', '.join(VIEWS)}")
    return VIEWS[view]


def axis_view(*axes: str) -> tuple[str, tuple[str, ...]]:
    """Which view holds these axes, and the axes with a flattened name expanded: ("dp",) -> dense, (dp_r, dp_s).

    pp and dp_replicate are in both views with the same groups; they are answered from the dense view.
    """
    if not axes:
        raise ValueError(f"name at least one axis; valid axes: {', '.join((*AXES, *FLATTENED))}")
    for axis in axes:
        if axis not in AXES and axis not in FLATTENED:
            raise ValueError(f"unknown parallel axis '{axis}'; valid axes: {', '.join((*AXES, *FLATTENED))}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes {', '.join(axes)} repeat an axis")
    if any(axis in FLATTENED for axis in axes):
        if len(axes) > 1:
            raise ValueError(f"the flattened axis {', '.join(a for a in axes if a in FLATTENED)} must be asked alone")
        return "dense", FLATTENED[axes[0]]
    for view, names in VIEWS.items():
        if all(axis in names for axis in axes):
            if list(axes) != sorted(axes, key=names.index):
                raise ValueError(f"axes {', '.join(axes)} must be given in {view} view order ({', '.join(names)})")
            return view, tuple(axes)
    raise ValueError(f"axes {', '.join(axes)} do not lie in one view: dense is ({', '.join(DENSE)}), "
                     f"expert is ({', '.join(EXPERT)})")


def rank_grid(layout: Layout, view: str) -> torch.Tensor:
    """The view's mesh tensor: ``arange(world_size)`` reshaped to the view's shape, last axis fastest."""
    return torch.arange(layout.world_size, dtype=torch.int).reshape(layout.shape(view))


def groups_for(layout: Layout, view: str, axes: tuple[str, ...]) -> list[list[int]]:
    """All groups along ``axes`` of ``view`` (several axes: flattened, first axis slowest), each rank in one.

    Groups are ordered by the other axes' coordinates, ranks within a group ascending, so a rank's index in
    its group is its coordinate along ``axes``. ``[n_groups, group_size]`` as lists.
    """
    names = _view_axes(view)
    if list(axes) != sorted(axes, key=names.index) or not set(axes) <= set(names) or len(set(axes)) != len(axes):
        raise ValueError(f"axes {', '.join(axes)} are not distinct axes of the {view} view in order "
                         f"({', '.join(names)})")
    keep = [names.index(axis) for axis in axes]
    other = [i for i in range(len(names)) if i not in keep]
    grid = rank_grid(layout, view)
    size = math.prod(grid.shape[i] for i in keep)
    return grid.permute(*other, *keep).reshape(-1, size).tolist()


def pipeline_ends(layout: Layout) -> list[list[int]]:
    """Per pipeline, its first and last stage's ranks (pp > 1): where the embedding and the last stage's copy of
    it live under multi-token prediction (``parallel/pipeline.py``). Ordered as ``groups_for`` orders the pp
    groups."""
    if layout.pp == 1:
        raise ValueError("parallel.pp=1 has one stage: it has no pipeline ends to join")
    return [[group[0], group[-1]] for group in groups_for(layout, "dense", ("pp",))]


@dataclass(frozen=True)
class ExpertNodes:
    """How the ep groups sit on nodes, when each spans several nodes with several of its ranks in each: every ep
    group cut into ``nodes`` blocks of ``per_node`` consecutive ep coordinates, one block per node. ``intra``: the
    ep ranks of one node (the in-node hop, NVLink); ``inter``: the ep ranks with one in-node position, one in each
    node (the hop across the network). Both ordered as ``groups_for`` orders groups, ranks ascending."""

    nodes: int
    per_node: int
    intra: tuple[tuple[int, ...], ...]
    inter: tuple[tuple[int, ...], ...]


@functools.lru_cache(maxsize=256)
def expert_nodes(layout: Layout, ranks_per_node: int) -> ExpertNodes | None:
    """The ep groups cut by nodes of ``ranks_per_node`` consecutive ranks (torchrun's numbering), or None where
    there is nothing for a second hop to save: an ep group inside one node, one ep rank per node, or nodes holding
    unequal or interleaved shares of a group (then no in-node position pairs the nodes up). Remembered: the
    planner asks for every candidate layout's."""
    intra: list[tuple[int, ...]] = []
    blocks_per_group, ranks_per_block = set(), set()
    for group in groups_for(layout, *axis_view("ep")):
        node_of = [rank // ranks_per_node for rank in group]
        blocks = [tuple(group[start:end]) for start, end in _runs(node_of)]
        if len(set(node_of)) != len(blocks):  # a node's share cut by another's
            return None
        blocks_per_group.add(len(blocks))
        ranks_per_block.update(len(block) for block in blocks)
        intra += blocks
    if len(blocks_per_group) != 1 or len(ranks_per_block) != 1:
        return None
    (nodes,), (per_node,) = blocks_per_group, ranks_per_block
    if nodes < 2 or per_node < 2:
        return None
    inter = tuple(ranks for start in range(0, len(intra), nodes)
                  for ranks in zip(*intra[start:start + nodes], strict=True))
    return ExpertNodes(nodes, per_node, tuple(intra), inter)


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of equal neighbours in ``values``."""
    cuts = [i for i in range(1, len(values)) if values[i] != values[i - 1]]
    return list(zip([0, *cuts], [*cuts, len(values)], strict=True))


def coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """A rank's coordinate on every axis of both views, and on the flattened "dp" (its data-parallel rank)."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside the world of {layout.world_size} ranks")
    coords: dict[str, int] = {}
    for view, names in VIEWS.items():
        index = rank
        for axis, size in reversed(list(zip(names, layout.shape(view), strict=True))):  # last axis fastest
            index, coords[axis] = divmod(index, size)
    coords["dp"] = coords["dp_replicate"] * layout.dp_shard + coords["dp_shard"]
    coords["dp_shard_cp"] = coords["dp_shard"] * layout.cp + coords["cp"]
    coords["dp_cp"] = coords["dp_replicate"] * layout.dp_shard_cp + coords["dp_shard_cp"]
    return {axis: coords[axis] for axis in (*AXES, *FLATTENED)}


def _format_group(ranks: list[int]) -> str:
    # Groups along one axis are arithmetic progressions, so the first three and the last say it all.
    shown = ranks if len(ranks) <= 4 else [*ranks[:3], "...", ranks[-1]]
    return "[" + ", ".join(map(str, shown)) + "]"


def describe_layout(layout: Layout, max_groups: int = 4) -> str:
    """Each axis, its size and its groups' ranks (at most ``max_groups`` shown); rank 0 prints it at start-up."""
    lines = [f"parallel layout of {layout.world_size} ranks: {layout.degrees()}"]
    for view, names in VIEWS.items():
        lines.append(f"  {view:<6} view ({', '.join(names)}) = ({', '.join(map(str, layout.shape(view)))})")
    lines.append(f"  {'axis':<13} {'size':>4}  groups")
    # without context parallelism its axis and the flattenings it adds to are the ones without it: not repeated
    for axis in (a for a in (*AXES, *FLATTENED) if layout.cp > 1 or a not in ("cp", "dp_cp", "dp_shard_cp")):
        if layout.degree(axis) == 1:
            groups = "off (one rank each)"
        else:
            found = groups_for(layout, *axis_view(axis))
            shown = found if len(found) <= max_groups else found[: max_groups - 1]
            groups = " ".join(_format_group(g) for g in shown)
            if len(shown) < len(found):
                groups += f" ... (+{len(found) - len(shown)} more)"
        lines.append(f"  {axis:<13} {layout.degree(axis):>4}  {groups}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Process groups and device meshes
# ---------------------------------------------------------------------------


def _new_groups(partition: list[list[int]], rank: int, desc: str) -> dist.ProcessGroup:
    """One process group per part of ``partition`` (same call order on every rank); returns this rank's."""
    if len(partition) == 1:  # the whole world: the default group already is this group
        return dist.group.WORLD
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    if bound is not None and bound.type != "cpu":
        # An eagerly initialised NCCL world splits all groups of an axis in one collective call, as
        # DeviceMesh itself does; new_group per group would be one ncclCommSplit per group.
        return dist.split_group(split_ranks=partition, group_desc=f"groups_{desc}")
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks, group_desc=f"groups_{desc}")
        if rank in ranks:
            mine = group
    return mine


class ParallelGroups:
    """This rank's meshes and process groups for both views; build once with ``ParallelGroups.build``.

    A single process without ``torch.distributed`` (``python train.py``) gets no process group at all:
    ``distributed`` is False, ``maybe_mesh`` answers None (every degree is 1), ``mesh`` and ``group``
    raise, and coordinates and stage queries answer as rank 0 of one.
    """

    def __init__(self, layout: Layout, rank: int, device_type: str, groups: dict[str, dist.ProcessGroup],
                 meshes: dict[tuple[str, ...], DeviceMesh]):
        self.layout, self.rank, self.device_type = layout, rank, device_type
        self._groups, self._meshes = groups, meshes
        self._node_groups: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup] | None] = {}

    @classmethod
    def build(cls, layout: Layout, device_type: str | torch.device = "cpu") -> ParallelGroups:
        """Create every group of every axis, then the two view meshes from them (collective: all ranks call).

        Groups are made once per distinct partition of the ranks: all degree-1 axes share one singleton
        group per rank, axes with the same ranks (pp and dp_replicate in both views, tp and ep when they
        coincide) share one group, and an axis spanning the world is the default group. NCCL creates a
        communicator only when a collective first runs on it (unless the world was bound to a device, where
        ``split_group`` makes them), so unused singleton groups cost no communicator, and a collective on a
        degree-1 group is correct (an identity), unlike torchtitan's "fake" backend for disabled axes.
        The meshes come from ``DeviceMesh.from_group`` with the mesh tensor ``rank_grid`` gives, so the
        meshes, the groups and the pure arithmetic cannot disagree; ``build`` also checks each group's ranks.
        """
        device_type = device_type.type if isinstance(device_type, torch.device) else device_type
        if not (dist.is_available() and dist.is_initialized()):
            if layout.world_size != 1:
                raise RuntimeError(f"a layout of {layout.world_size} ranks needs torch.distributed initialised "
                                   "(start with torchrun; parallel.runtime.init_runtime joins the job)")
            return cls(layout, 0, device_type, {}, {})
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"the layout is for {layout.world_size} ranks but the job has {dist.get_world_size()}")
        rank = dist.get_rank()
        groups: dict[str, dist.ProcessGroup] = {}
        made: dict[tuple, dist.ProcessGroup] = {}
        for axis in (*AXES, *FLATTENED):  # the same order on every rank: group creation is collective
            partition = groups_for(layout, *axis_view(axis))
            key = tuple(map(tuple, partition))
            if key not in made:
                made[key] = _new_groups(partition, rank, axis)
            groups[axis] = made[key]
            mine = next(g for g in partition if rank in g)
            if dist.get_process_group_ranks(groups[axis]) != mine:
                raise AssertionError(f"rank {rank}: the {axis} group holds ranks "
                                     f"{dist.get_process_group_ranks(groups[axis])}, the layout says {mine}")
        meshes = {names: DeviceMesh.from_group([groups[a] for a in names], device_type,
                                               mesh=rank_grid(layout, view), mesh_dim_names=names)
                  for view, names in VIEWS.items()}
        for flat, names in FLATTENED.items():
            mine = next(g for g in groups_for(layout, "dense", names) if rank in g)
            meshes[(flat,)] = DeviceMesh.from_group(groups[flat], device_type, mesh=mine, mesh_dim_names=(flat,))
        if layout.cp > 1:
            # FSDP shards over dp_shard × cp beside tp's DTensors, which needs one root mesh for both: the dense
            # mesh's own flattening (a collective; it makes its group as DeviceMesh does)
            meshes[("dp_shard_cp",)] = meshes[DENSE]["dp_shard", "cp"]._flatten("dp_shard_cp")
        return cls(layout, rank, device_type, groups, meshes)

    @property
    def distributed(self) -> bool:
        """True when this object holds process groups (False only for a single process without them)."""
        return bool(self._groups)

    def _require_distributed(self, what: str) -> None:
        if not self.distributed:
            raise RuntimeError(f"{what}: a single process without torch.distributed has no meshes or groups; "
                               "use maybe_mesh(), which answers None here")

    def mesh(self, *axes: str) -> DeviceMesh:
        """The mesh over ``axes`` of one view, e.g. mesh("dp_replicate", "dp_shard") for HSDP, mesh("ep").

        Several axes give the N-D sub-mesh (public DeviceMesh slicing, in view order); a flattened name
        ("dp") gives its 1-D mesh. Raises on an unknown axis, naming the valid ones.
        """
        view, names = axis_view(*axes)
        self._require_distributed(f"mesh({', '.join(map(repr, axes))})")
        key = tuple(axes) if axes[0] in FLATTENED else names
        if key not in self._meshes:
            self._meshes[key] = self._meshes[VIEWS[view]][names]
        return self._meshes[key]

    def data_parallel_mesh(self) -> DeviceMesh:
        """FSDP's mesh for the dense weights: (dp_replicate, dp_shard × cp), without dp_replicate when it is 1 (then
        plain FSDP rather than HSDP), dp_shard alone when cp is 1. A sub-mesh of the dense view, as FSDP needs
        when it shards tensor-parallel DTensors too."""
        self._require_distributed("data_parallel_mesh()")
        shard = "dp_shard_cp" if self.layout.cp > 1 else "dp_shard"  # flattened on the dense mesh by ``build``
        axes = ("dp_replicate", shard) if self.layout.dp_replicate > 1 else (shard,)
        return self._meshes[DENSE][axes]

    def maybe_mesh(self, *axes: str) -> DeviceMesh | None:
        """Like ``mesh``, but None when every one of ``axes`` has degree 1 (the parallelism is off)."""
        if all(self.layout.degree(axis) == 1 for axis in axis_view(*axes)[1]):
            return None
        return self.mesh(*axes)

    def group(self, axis: str) -> dist.ProcessGroup:
        """This rank's process group along one axis or flattened axis, for hand-written collectives."""
        axis_view(axis)
        self._require_distributed(f"group({axis!r})")
        return self._groups[axis]

    def background_group(self) -> dist.ProcessGroup | None:
        """A new gloo group over all ranks for collectives run off the training thread (asynchronous checkpoint
        writes): sharing a group with training's collectives would interleave the two streams. Collective:
        every rank calls it, in the same order. None in a single process without torch.distributed."""
        if not self.distributed:
            return None
        return dist.new_group(backend="gloo", group_desc="background")

    def pipeline_ends_group(self) -> dist.ProcessGroup | None:
        """This rank's group of its pipeline's first and last stage (``pipeline_ends``); None on a stage between.

        Made on the first call, not by ``build``: only multi-token prediction under pipeline parallelism needs it.
        Collective the first time: every rank calls it, in the same order as its other group creations. With
        pp = 2 it is the pp group itself."""
        if "pipeline_ends" not in self._groups:
            self._require_distributed("pipeline_ends_group()")
            ends = pipeline_ends(self.layout)
            mine = self.group("pp") if self.layout.pp == 2 else None
            if mine is None:  # every rank creates every group (collective), and keeps its own
                for ranks in ends:
                    group = dist.new_group(ranks, group_desc="groups_pipeline_ends")
                    mine = group if self.rank in ranks else mine
            self._groups["pipeline_ends"] = mine
        return self._groups["pipeline_ends"]

    def expert_node_groups(self, ranks_per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
        """This rank's (in-node, across-node) ep groups for the two-hop exchange (``expert_nodes``), or None where
        the layout has no second hop on nodes of ``ranks_per_node``.

        Made on the first call for a node size, not by ``build``: only that exchange needs them. Collective the
        first time: every rank calls it, in the same order as its other group creations."""
        if ranks_per_node not in self._node_groups:
            self._require_distributed("expert_node_groups()")
            nodes = expert_nodes(self.layout, ranks_per_node)
            self._node_groups[ranks_per_node] = None if nodes is None else (
                _new_groups(list(map(list, nodes.intra)), self.rank, "ep_intra_node"),
                _new_groups(list(map(list, nodes.inter)), self.rank, "ep_inter_node"))
        return self._node_groups[ranks_per_node]

    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every axis of both views (pp and dp_replicate coincide) and on "dp"."""
        return coordinates(self.layout, self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.coords()["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords()["pp"] == self.layout.pp - 1

    def describe(self) -> str:
        return describe_layout(self.layout)

    def __repr__(self) -> str:
        return f"ParallelGroups(rank={self.rank}, {self.layout.degrees()}, world_size={self.layout.world_size})"
