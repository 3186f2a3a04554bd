"""A parallel layout: the degrees of the parallel axes over a world size, pure (no processes, no tensors).

The axes form two views over the same ranks (``parallel/ranks.py`` lays the ranks out on them):

    dense  (pp, dp_replicate, dp_shard, cp, tp)   attention, dense FFNs, embeddings
    expert (pp, dp_replicate, edp, ep, etp)       routed experts

Expert parallelism folds over the sharded-data-, context- and tensor-parallel ranks (Megatron-Core "MoE
parallel folding"; torchtitan keeps EP inside dp_shard·cp·tp the same way): ep · etp · edp = dp_shard · cp · tp.

Context-parallel ranks hold different tokens of the same sequences, so for the gradients they are data-parallel
ranks: FSDP shards and reduces over dp_shard × cp (the flattened ``dp_shard_cp``), the loss and the routing
statistics are reduced over dp_replicate × dp_shard × cp (``dp_cp``), and only the sampler asks for "dp" (the
ranks that draw different sequences).

Rule for etp: etp must divide tp, so every expert-tensor-parallel group lies inside one tensor-parallel
group. The tokens entering an MoE layer are the same (or sequence-sharded) across a tp group, so an etp
group nested in it needs no gather across data-parallel ranks, and stays within a node as tp does. This
admits both torchtitan-classic cases (etp = 1, etp = tp) and Megatron's usual etp < tp; a wider etp
spanning dp_shard ranks (which Megatron also allows) can be admitted later without breaking layouts.

Here: the axis names, ``Layout`` (degrees, the one -1 resolved and validated at construction, the nearest valid
layouts suggested for an impossible one), ``validate_for_model`` (the model's shapes) and ``valid_layouts``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

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


def view_axes(view: str) -> tuple[str, ...]:
    """The axes of a view, "dense" or "expert"; ValueError names the valid views."""
    if view not in VIEWS:
        raise ValueError(f"unknown view '{view}'; valid views: {', '.join(VIEWS)}")
    return VIEWS[view]


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
        ("tp", not model.linear_attention or model.linear_key_heads % d["tp"] == 0,
         f"parallel.tp={d['tp']} does not divide model.linear_key_heads={model.linear_key_heads}"),
        ("tp", model.compressed_attention is None or model.compressed_attention.o_groups % d["tp"] == 0,
         f"parallel.tp={d['tp']} does not divide model.compressed_attention.o_groups="
         f"{model.compressed_attention and model.compressed_attention.o_groups} (each rank holds whole output groups)"),
        ("pp", d["pp"] <= model.n_layers, f"parallel.pp={d['pp']} is more pipeline stages than "
                                          f"model.n_layers={model.n_layers}"),
        ("tp", model.n_heads % d["tp"] == 0, f"parallel.tp={d['tp']} does not divide model.n_heads={model.n_heads}"),
        ("tp", d["tp"] == 1 or not model.qk_norm or model.qk_norm_type == "per_head",
         f"parallel.tp={d['tp']} with model.qk_norm_type=per_layer: each q/k norm spans every head's channels, "
         "which tp splits over ranks (not served yet); use parallel.tp=1"),
        ("tp", model.compressed_attention is not None or model.kv_heads % d["tp"] == 0,  # V4: one head, whole
         f"parallel.tp={d['tp']} does not divide the key/value heads model.n_kv_heads={model.kv_heads}"),
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
        return tuple(self.degree(axis) for axis in view_axes(view))

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
