"""The group manager: layout resolution and validation, the pure rank arithmetic against brute force at
thousands of ranks, the printed layout, and real gloo groups on 4 processes."""

import datetime
import itertools
import math
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from config.parallel import DEGREES
from parallel.groups import ParallelGroups
from parallel.layout import AXES, DENSE, EXPERT, VIEWS, Layout, valid_layouts, validate_for_model
from parallel.ranks import axis_view, coordinates, describe_layout, groups_for, pipeline_ends, rank_grid
from parallel.runtime import exit_process

# ---------------------------------------------------------------------------
# Resolution and validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "request_", "expected", "rest"),
    [
        (8, {}, dict(dp_shard=8), "dp_shard"),
        (8, dict(tp=2, ep=4), dict(dp_shard=4, tp=2, ep=4), "dp_shard"),
        (16, dict(pp=2, dp_shard=2, tp=-1), dict(pp=2, dp_shard=2, tp=4), "tp"),
        (16, dict(dp_shard=4, tp=4, ep=-1), dict(dp_shard=4, tp=4, ep=16), "ep"),  # ep=-1: edp = 1
        (16, dict(dp_shard=4, tp=4, ep=4, etp=-1), dict(dp_shard=4, tp=4, ep=4, etp=4), "etp"),
        (12, dict(pp=3, dp_replicate=2, dp_shard=2), dict(pp=3, dp_replicate=2, dp_shard=2), None),
    ],
)
def test_resolve_fills_the_one_minus_one(world, request_, expected, rest):
    layout = Layout.resolve(world, **request_)
    assert {k: getattr(layout, k) for k in DEGREES} == {**dict.fromkeys(DEGREES, 1), **expected}
    assert layout.rest == rest
    assert math.prod(layout.shape("dense")) == math.prod(layout.shape("expert")) == world
    assert layout.edp * layout.ep * layout.etp == layout.dp_shard * layout.tp
    assert layout.dp == layout.dp_replicate * layout.dp_shard


def test_derived_degrees_and_enabled_flags():
    layout = Layout.resolve(16, dp_replicate=2, tp=2, ep=2)
    assert (layout.dp_shard, layout.edp, layout.dp) == (4, 4, 8)
    assert layout.dp_replicate_enabled and layout.tp_enabled and layout.ep_enabled
    assert not (layout.pp_enabled or layout.etp_enabled)
    assert layout.enabled("edp") and not layout.enabled("etp")
    assert layout.requested() == dict(pp=1, dp_replicate=2, dp_shard=-1, cp=1, tp=2, ep=2, etp=1)
    assert (layout.dp_cp, layout.dp_shard_cp) == (8, 4) and not layout.cp_enabled
    folded = Layout.resolve(16, dp_replicate=2, cp=2, tp=2, ep=4)  # ep folds over dp_shard × cp × tp = 2 × 2 × 2
    assert (folded.dp_shard, folded.dp, folded.dp_cp, folded.dp_shard_cp, folded.edp) == (2, 4, 8, 4, 2)


@pytest.mark.parametrize(
    ("world", "request_", "message"),
    [
        (8, dict(dp_shard=3, tp=4),
         "parallel degrees pp=1 × dp_replicate=1 × dp_shard=3 × tp=4 = 12 do not match the world of 8 ranks "
         "(a degree of -1 fills the rest); nearest valid layouts for 8 ranks: "
         "pp=1 dp_replicate=1 dp_shard=2 tp=4 ep=1 etp=1; pp=1 dp_replicate=1 dp_shard=4 tp=2 ep=1 etp=1; "
         "pp=1 dp_replicate=1 dp_shard=2 tp=4 ep=2 etp=1"),
        (8, dict(dp_shard=-1, tp=-1),
         "parallel.dp_shard and parallel.tp are -1; at most one degree may be -1 (whatever is left); "
         "nearest valid layouts for 8 ranks: pp=1 dp_replicate=1 dp_shard=8 tp=1 ep=1 etp=1; "
         "pp=1 dp_replicate=1 dp_shard=4 tp=2 ep=1 etp=1; pp=1 dp_replicate=1 dp_shard=2 tp=4 ep=1 etp=1"),
        (8, dict(tp=3),
         "parallel.dp_shard=-1 cannot fill the rest: pp=1 × dp_replicate=1 × tp=3 = 3 does not divide the world "
         "of 8 ranks; nearest valid layouts for 8 ranks: pp=1 dp_replicate=1 dp_shard=2 tp=4 ep=1 etp=1; "
         "pp=1 dp_replicate=1 dp_shard=4 tp=2 ep=1 etp=1; pp=1 dp_replicate=1 dp_shard=1 tp=8 ep=1 etp=1"),
        (8, dict(tp=0),
         "parallel.tp=0 must be a positive integer, or -1 for whatever is left; "
         "valid tp for this world of 8 ranks: 1, 2, 4, 8"),
        (8, dict(tp=2, ep=3),
         "parallel.ep=3 × parallel.etp=1 does not divide parallel.dp_shard × parallel.tp = 4 × 2 = 8 (expert "
         "parallelism folds over the sharded-data- and tensor-parallel ranks); "
         "valid ep for this world of 8 ranks with tp=2: 1, 2, 4, 8"),
        (16, dict(pp=2, dp_shard=2, tp=4, ep=16),
         "parallel.ep=16 × parallel.etp=1 does not divide parallel.dp_shard × parallel.tp = 2 × 4 = 8 (expert "
         "parallelism folds over the sharded-data- and tensor-parallel ranks); "
         "valid ep for this world of 16 ranks with pp=2, dp_shard=2, tp=4: 1, 2, 4, 8"),
        (8, dict(tp=2, etp=4),
         "parallel.etp=4 does not divide parallel.tp=2 (expert-tensor-parallel groups nest inside "
         "tensor-parallel groups); valid etp for this world of 8 ranks with tp=2: 1, 2"),
    ],
)
def test_impossible_layouts_name_the_key_and_the_nearest_valid_ones(world, request_, message):
    with pytest.raises(ConfigError) as info:
        Layout.resolve(world, **request_)
    assert str(info.value) == message


def test_a_layout_is_validated_at_construction_too():
    with pytest.raises(ConfigError, match=r"^parallel degrees pp=1 × dp_replicate=1 × dp_shard=1 × tp=1 = 1 do "
                                          r"not match the world of 4 ranks"):
        Layout(4)
    with pytest.raises(ConfigError, match="use Layout.resolve to fill a -1"):
        Layout(4, dp_shard=-1)
    with pytest.raises(ConfigError, match="world size must be a positive integer, got 0"):
        Layout.resolve(0)


MODEL = ModelConfig(n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden=96, d_model=64)
MOE = MoEConfig(num_experts=8, expert_hidden=40)


@pytest.mark.parametrize(
    ("world", "request_", "model", "moe", "message"),
    [
        # ep=1 is not among them: 8 experts over edp=16 would be sharded on expert_hidden=40, unevenly
        (16, dict(tp=2, ep=16), MODEL, MOE,
         "parallel.ep=16 does not divide moe.num_experts=8; valid ep for this world of 16 ranks with tp=2: 2, 4, 8"),
        (8, dict(pp=8), MODEL, MOE,
         "parallel.pp=8 is more pipeline stages than model.n_layers=4; valid pp for this world of 8 ranks: 1, 2, 4"),
        # tp=2 is not among them: its 8 experts over edp=12 would be sharded on d_model=64, unevenly
        (12, dict(tp=3), MODEL, MOE,
         "parallel.tp=3 does not divide model.n_heads=8; valid tp for this world of 12 ranks: 1"),
        (8, dict(tp=4), MODEL, MOE,
         "parallel.tp=4 does not divide the key/value heads model.n_kv_heads=2; "
         "valid tp for this world of 8 ranks: 1, 2"),
        (8, dict(tp=4), ModelConfig(ffn_hidden=90, moe_every=2), MOE,
         "parallel.tp=4 does not divide model.ffn_hidden=90; valid tp for this world of 8 ranks: 1, 2"),
        (8, dict(tp=2, ep=2), ModelConfig(), MoEConfig(num_shared_experts=1, shared_expert_hidden=33),
         "parallel.tp=2 does not divide the shared-expert hidden size 33; "
         "valid tp for this world of 8 ranks with ep=2: 1"),
        (8, dict(tp=2, etp=2), ModelConfig(), MoEConfig(expert_hidden=45),
         "parallel.etp=2 does not divide moe.expert_hidden=45; valid etp for this world of 8 ranks with tp=2: 1"),
        (8, dict(tp=2, ep=2), ModelConfig(moe_every=0), MOE,
         "parallel.ep=2 needs MoE layers, but the model has none; valid ep for this world of 8 ranks with tp=2: 1"),
        # No tp works while etp=4 is kept (etp must divide tp), so the nearest whole layouts are named.
        (8, dict(tp=4, etp=4), MODEL, MOE,
         "parallel.tp=4 does not divide the key/value heads model.n_kv_heads=2; nearest valid layouts for 8 "
         "ranks: pp=1 dp_replicate=1 dp_shard=4 tp=2 ep=1 etp=2; pp=1 dp_replicate=1 dp_shard=4 tp=2 ep=1 etp=1; "
         "pp=1 dp_replicate=1 dp_shard=8 tp=1 ep=1 etp=1"),
    ],
)
def test_model_limits_name_the_key_and_the_valid_values(world, request_, model, moe, message):
    layout = Layout.resolve(world, **request_)
    with pytest.raises(ConfigError) as info:
        validate_for_model(layout, model, moe)
    assert str(info.value) == message


def fsdp_can_shard_experts(dp_s: int, tp: int, ep: int, etp: int, cp: int = 1) -> bool:
    """FSDP2 splits a dim other than the first only evenly: experts in their own unit (ep, etp or tp > 1) whose
    E/ep do not split over edp are sharded on d_model (w_in, w_gate; and w_out under etp) or expert_hidden (w_out)."""
    edp = dp_s * cp * tp // (ep * etp)
    if max(ep, etp, tp) == 1 or (MOE.num_experts // ep) % edp == 0:
        return True
    widths = [MODEL.d_model] + ([] if etp > 1 else [MOE.expert_hidden])
    return all(width % edp == 0 for width in widths)


def test_valid_layouts_are_exactly_those_the_rules_allow():
    # Brute force over every 7-tuple of divisors, with the rules written out independently.
    world = 24
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    expected = set()
    for pp, dp_r, dp_s, cp, tp, ep, etp in itertools.product(divisors, repeat=7):
        if (pp * dp_r * dp_s * cp * tp == world and tp % etp == 0
                and (dp_s * cp * tp) % (ep * etp) == 0 and MODEL.seq_len % (2 * cp) == 0
                and MODEL.n_layers >= pp and MODEL.n_heads % tp == 0
                and MODEL.kv_heads % tp == 0 and MODEL.ffn_hidden % tp == 0
                and MOE.num_experts % ep == 0 and MOE.expert_hidden % etp == 0
                and fsdp_can_shard_experts(dp_s, tp, ep, etp, cp)):
            expected.add((pp, dp_r, dp_s, cp, tp, ep, etp))
    assert any(layout[3] > 1 for layout in expected) and not any(layout[3] == 3 for layout in expected)
    found = [tuple(getattr(layout, k) for k in DEGREES) for layout in valid_layouts(world, MODEL, MOE)]
    assert len(found) == len(set(found)) and set(found) == expected
    assert len(valid_layouts(world)) > len(found)


# ---------------------------------------------------------------------------
# Pure rank arithmetic against brute force
# ---------------------------------------------------------------------------

AXIS_SETS = {
    "dense": [("pp",), ("dp_replicate",), ("dp_shard",), ("cp",), ("tp",), ("dp_replicate", "dp_shard"),
              ("dp_shard", "cp"), ("dp_replicate", "dp_shard", "cp"), ("dp_shard", "cp", "tp")],
    "expert": [("pp",), ("dp_replicate",), ("edp",), ("ep",), ("etp",), ("ep", "etp"), ("edp", "ep", "etp")],
}


def _random_layout(rng: random.Random, world: int) -> Layout:
    """A random valid layout: the dense degrees in a random order, each a random divisor of what is left."""
    def pick(n):
        return rng.choice([d for d in range(1, n + 1) if n % d == 0])
    left, dense = world, {}
    for axis in rng.sample(DENSE, len(DENSE)):
        dense[axis] = pick(left) if len(dense) < 3 else left
        left //= dense[axis]
    etp = pick(dense["tp"])
    return Layout(world, **dense, ep=pick(dense["dp_shard"] * dense["cp"] * dense["tp"] // etp), etp=etp)


# Hand-picked layouts of thousands of ranks and a seeded sample of random ones (cheap to make at import,
# which the spawned processes of the last test repeat).
_rng = random.Random(0)
BIG = [Layout.resolve(4096, pp=4, dp_replicate=2, tp=8, ep=16, etp=2),
       Layout.resolve(6144, pp=3, dp_replicate=4, tp=8, ep=32, etp=4),
       Layout.resolve(6144, pp=6, dp_replicate=1, tp=4, ep=64, etp=1),
       *(_random_layout(_rng, world) for world in (4096, 4096, 4096, 6144, 6144, 6144))]
SMALL = valid_layouts(12) + valid_layouts(16)  # every layout of two small worlds


LAYOUT_SETS = pytest.mark.parametrize("layouts", [SMALL, *([layout] for layout in BIG)],
                                      ids=["all-of-12-and-16", *(f"{x.world_size}:{x.degrees()}" for x in BIG)])


def _brute_force(layout, view):
    """Each rank's coordinates by explicit div/mod, and the groups of ranks sharing all other coordinates."""
    names, shape = VIEWS[view], layout.shape(view)
    coords = []
    for rank in range(layout.world_size):
        c, rest = {}, rank
        for name, size in zip(reversed(names), reversed(shape), strict=True):
            c[name] = rest % size
            rest //= size
        coords.append(c)
    groups = {}
    for axes in AXIS_SETS[view]:
        by_other = {}
        for rank, c in enumerate(coords):
            by_other.setdefault(tuple(c[n] for n in names if n not in axes), []).append(rank)
        groups[axes] = [by_other[key] for key in sorted(by_other)]
    return coords, groups


@LAYOUT_SETS
def test_rank_arithmetic_matches_brute_force(layouts):
    for layout in layouts:
        for view in VIEWS:
            coords, groups = _brute_force(layout, view)
            for axes, expected in groups.items():
                assert groups_for(layout, view, axes) == expected, (layout, view, axes)
            pure = [coordinates(layout, rank) for rank in range(layout.world_size)]
            assert all(p[n] == c[n] for p, c in zip(pure, coords, strict=True) for n in VIEWS[view]), layout


@LAYOUT_SETS
def test_views_share_pipeline_replica_and_folded_ranks(layouts):
    for layout in layouts:
        world = layout.world_size
        for view, axis_sets in AXIS_SETS.items():
            for axes in axis_sets:  # every rank in exactly one group per axis set
                flat = sorted(r for g in groups_for(layout, view, axes) for r in g)
                assert flat == list(range(world)), (layout, axes)
        assert rank_grid(layout, "dense").flatten().tolist() == rank_grid(layout, "expert").flatten().tolist()
        for axis in ("pp", "dp_replicate"):
            assert groups_for(layout, "dense", (axis,)) == groups_for(layout, "expert", (axis,))
        # ep × etp × edp of one (pp, dp_replicate) slice are that slice's dp_shard × cp × tp ranks
        assert (groups_for(layout, "dense", ("dp_shard", "cp", "tp"))
                == groups_for(layout, "expert", ("edp", "ep", "etp")))
        innermost = [("dense", ("tp",)), ("expert", ("etp",)), ("expert", ("ep", "etp"))]
        if layout.etp == 1:
            innermost.append(("expert", ("ep",)))
        for view, axes in innermost:  # contiguous rank ranges
            assert all(g == list(range(g[0], g[0] + len(g))) for g in groups_for(layout, view, axes)), (layout, axes)
        tp_of = {r: tuple(g) for g in groups_for(layout, "dense", ("tp",)) for r in g}
        assert all(set(g) <= set(tp_of[g[0]]) for g in groups_for(layout, "expert", ("etp",)))  # etp nests in tp


def test_a_small_layout_against_a_golden_table():
    # 16 ranks: pp=2 stages of 8; each stage is dp_shard=4 × tp=2, folded for experts as edp=2 × ep=4.
    layout = Layout.resolve(16, pp=2, tp=2, ep=4)
    assert layout.shape("dense") == (2, 1, 4, 1, 2) and layout.shape("expert") == (2, 1, 2, 4, 1)
    assert groups_for(layout, "dense", ("pp",)) == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14],
                                                    [7, 15]]
    assert groups_for(layout, "dense", ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                                    [14, 15]]
    assert groups_for(layout, "dense", ("dp_shard",)) == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14],
                                                          [9, 11, 13, 15]]
    assert groups_for(layout, "expert", ("ep",)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert groups_for(layout, "expert", ("edp",)) == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14],
                                                      [11, 15]]
    assert coordinates(layout, 13) == dict(pp=1, dp_replicate=0, dp_shard=2, cp=0, tp=1, edp=1, ep=1, etp=0, dp=2,
                                           dp_cp=2, dp_shard_cp=2)


def test_context_parallel_ranks_sit_beside_tp_and_fold_into_the_experts():
    # 8 ranks: dp_shard=2 × cp=2 × tp=2; cp next to tp, so a cp group is ranks two apart; ep=4 over cp × tp
    layout = Layout.resolve(8, cp=2, tp=2, ep=4)
    assert layout.shape("dense") == (1, 1, 2, 2, 2) and layout.shape("expert") == (1, 1, 2, 4, 1)
    assert groups_for(layout, "dense", ("cp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups_for(layout, *axis_view("dp_shard_cp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups_for(layout, *axis_view("dp")) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # cp ranks share sequences
    assert groups_for(layout, "expert", ("ep",)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert coordinates(layout, 6) == dict(pp=0, dp_replicate=0, dp_shard=1, cp=1, tp=0, edp=1, ep=2, etp=0, dp=1,
                                          dp_cp=3, dp_shard_cp=3)


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        (("ed",), "unknown parallel axis 'ed'; valid axes: pp, dp_replicate, dp_shard, cp, tp, edp, ep, etp, dp, "
                  "dp_cp, dp_shard_cp"),
        (("dp_shard", "ep"), "axes dp_shard, ep do not lie in one view: dense is (pp, dp_replicate, dp_shard, cp, "
                             "tp), expert is (pp, dp_replicate, edp, ep, etp)"),
        (("tp", "dp_shard"), "axes tp, dp_shard must be given in dense view order (pp, dp_replicate, dp_shard, cp, "
                             "tp)"),
        (("tp", "tp"), "axes tp, tp repeat an axis"),
        (("dp", "tp"), "the flattened axis dp must be asked alone"),
    ],
)
def test_axis_requests_that_name_no_mesh(axes, message):
    with pytest.raises(ValueError) as info:
        axis_view(*axes)
    assert str(info.value) == message


def test_axis_view_answers_shared_axes_from_the_dense_view():
    assert axis_view("pp", "dp_replicate") == ("dense", ("pp", "dp_replicate"))
    assert axis_view("dp_replicate", "edp") == ("expert", ("dp_replicate", "edp"))
    assert axis_view("dp") == ("dense", ("dp_replicate", "dp_shard"))


def test_describe_lists_each_axis_and_its_groups():
    assert describe_layout(Layout.resolve(8, tp=2, ep=4)).splitlines() == [
        "parallel layout of 8 ranks: pp=1 dp_replicate=1 dp_shard=4 tp=2 ep=4 etp=1",
        "  dense  view (pp, dp_replicate, dp_shard, cp, tp) = (1, 1, 4, 1, 2)",
        "  expert view (pp, dp_replicate, edp, ep, etp) = (1, 1, 2, 4, 1)",
        "  axis          size  groups",
        "  pp               1  off (one rank each)",
        "  dp_replicate     1  off (one rank each)",
        "  dp_shard         4  [0, 2, 4, 6] [1, 3, 5, 7]",
        "  tp               2  [0, 1] [2, 3] [4, 5] [6, 7]",
        "  edp              2  [0, 4] [1, 5] [2, 6] [3, 7]",
        "  ep               4  [0, 1, 2, 3] [4, 5, 6, 7]",
        "  etp              1  off (one rank each)",
        "  dp               4  [0, 2, 4, 6] [1, 3, 5, 7]",
    ]


def test_describe_shortens_a_big_world():
    lines = describe_layout(Layout.resolve(4096, pp=4, tp=8, ep=8)).splitlines()
    assert "  pp               4  [0, 1024, 2048, 3072] [1, 1025, 2049, 3073] [2, 1026, 2050, 3074] " \
           "... (+1021 more)" in lines
    assert "  dp_shard       128  [0, 8, 16, ..., 1016] [1, 9, 17, ..., 1017] [2, 10, 18, ..., 1018] " \
           "... (+29 more)" in lines
    assert "  tp               8  [0, 1, 2, ..., 7] [8, 9, 10, ..., 15] [16, 17, 18, ..., 23] ... (+509 more)" in lines
    assert max(map(len, lines)) < 120


# ---------------------------------------------------------------------------
# ParallelGroups: one process without torch.distributed, and 4 gloo processes
# ---------------------------------------------------------------------------


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs a process without a process group")
def test_a_single_process_needs_no_process_group():
    groups = ParallelGroups.build(Layout.resolve(1), "cpu")
    assert not groups.distributed
    assert groups.coords() == dict.fromkeys((*AXES, "dp", "dp_cp", "dp_shard_cp"), 0)
    assert groups.is_first_stage and groups.is_last_stage
    assert groups.maybe_mesh("dp_replicate", "dp_shard") is None and groups.maybe_mesh("ep") is None
    with pytest.raises(RuntimeError, match=r"mesh\('tp'\): a single process without torch.distributed"):
        groups.mesh("tp")
    with pytest.raises(RuntimeError, match="use maybe_mesh"):
        groups.group("dp")
    with pytest.raises(ValueError, match="unknown parallel axis 'tpp'"):
        groups.maybe_mesh("tpp")
    with pytest.raises(RuntimeError, match="a layout of 2 ranks needs torch.distributed initialised"):
        ParallelGroups.build(Layout.resolve(2))


def _check_groups(groups: ParallelGroups, rank: int) -> None:
    """On this rank: every group holds the ranks the pure arithmetic says, by a real all_gather over it."""
    layout, coords = groups.layout, groups.coords()
    for axis in (*AXES, "dp", "dp_cp", "dp_shard_cp"):
        expected = next(g for g in groups_for(layout, *axis_view(axis)) if rank in g)
        gathered = [torch.zeros(1, dtype=torch.long) for _ in expected]
        dist.all_gather(gathered, torch.tensor([rank]), group=groups.group(axis))
        assert [t.item() for t in gathered] == expected, (axis, gathered, expected)
        assert groups.mesh(axis).mesh.tolist() == expected, axis
        assert dist.get_group_rank(groups.group(axis), rank) == coords[axis], axis
    dense, expert = rank_grid(layout, "dense"), rank_grid(layout, "expert")
    assert groups.mesh(*DENSE).get_coordinate() == tuple(coords[a] for a in DENSE)
    assert groups.mesh(*EXPERT).get_coordinate() == tuple(coords[a] for a in EXPERT)
    hsdp = groups.mesh("dp_replicate", "dp_shard")
    assert hsdp.mesh.tolist() == dense[coords["pp"], :, :, coords["cp"], coords["tp"]].tolist()
    assert hsdp.get_group("dp_shard") is groups.group("dp_shard")
    fsdp = dense[coords["pp"], :, :, :, coords["tp"]].reshape(layout.dp_replicate, layout.dp_shard_cp)
    assert groups.data_parallel_mesh().mesh.tolist() == (fsdp if layout.dp_replicate > 1 else fsdp[0]).tolist()
    assert groups.mesh("edp", "ep").mesh.tolist() == expert[coords["pp"], coords["dp_replicate"], :, :, 0].tolist()
    assert groups.is_first_stage and groups.is_last_stage


def _worker(rank: int, world: int, store_path: str) -> None:
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        # dp_shard=2 × tp=2, folded as edp=2 × ep=2: ep groups are the tp groups, so they share one group.
        groups = ParallelGroups.build(Layout.resolve(world, dp_shard=2, tp=2, ep=2), "cpu")
        _check_groups(groups, rank)
        assert groups.group("ep") is groups.group("tp")
        assert groups.maybe_mesh("pp") is None and groups.maybe_mesh("ep") is not None
        # HSDP: dp_replicate=2 × dp_shard=2, experts over ep=2 inside each replica.
        groups = ParallelGroups.build(Layout.resolve(world, dp_replicate=2, dp_shard=2, ep=2), "cpu")
        _check_groups(groups, rank)
        assert groups.maybe_mesh("tp") is None and groups.maybe_mesh("dp_replicate", "dp_shard") is not None
        # context parallelism: FSDP's mesh flattens dp_shard × cp, a sub-mesh of the dense view beside tp
        groups = ParallelGroups.build(Layout.resolve(world, dp_shard=1, cp=2, tp=2, ep=4), "cpu")
        _check_groups(groups, rank)
        assert groups.data_parallel_mesh().mesh_dim_names == ("dp_shard_cp",)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # skip the interpreter's shutdown: parallel/runtime.py says why


def test_real_groups_on_four_gloo_processes_match_the_arithmetic(tmp_path):
    mp.spawn(_worker, args=(4, str(tmp_path / "store")), nprocs=4, join=True)


def test_a_layout_fsdp_cannot_shard_the_experts_of_is_refused_before_anything_is_built():
    """E/ep experts that do not split over edp are sharded on a width, which FSDP2 refuses to split unevenly
    (NotImplementedError deep in fully_shard); the layout check refuses it first, naming the width."""
    model = ModelConfig(n_layers=2, n_heads=4, d_model=72, ffn_hidden=128)
    odd = MoEConfig(num_experts=6, expert_hidden=45)
    with pytest.raises(ConfigError, match=r"the 3 experts per expert-parallel rank \(moe.num_experts=6 / "
                                          r"parallel.ep=2\) do not split over the 2 expert-data-parallel ranks.*"
                                          r"moe.expert_hidden=45 does not divide by 2"):
        validate_for_model(Layout(4, dp_shard=4, ep=2), model, odd)
    even = MoEConfig(num_experts=6, expert_hidden=90)  # the width splits: FSDP shards it (dry-run tested)
    validate_for_model(Layout(4, dp_shard=4, ep=2), model, even)
    validate_for_model(Layout(4, dp_shard=4, ep=2), model, MoEConfig(num_experts=8, expert_hidden=45))  # 4 per rank
    assert all((layout.ep, layout.dp_shard) != (2, 4) for layout in valid_layouts(4, model, odd))


def test_pipeline_ends_pair_each_pipelines_first_and_last_stage():
    """The ranks that sum the embedding's gradient with the last stage's copy under multi-token prediction: per
    pipeline (same coordinates on every other axis) its pp = 0 and pp = last ranks, by the rank arithmetic."""
    layout = Layout.resolve(8, pp=4, dp_shard=1, tp=2)  # pp outermost: stage s of tp rank t is rank 2s + t
    assert pipeline_ends(layout) == [[0, 6], [1, 7]]
    for first, last in pipeline_ends(layout):
        assert coordinates(layout, first)["pp"] == 0 and coordinates(layout, last)["pp"] == 3
        assert coordinates(layout, first)["tp"] == coordinates(layout, last)["tp"]
    with pytest.raises(ValueError, match="parallel.pp=1 has one stage"):
        pipeline_ends(Layout.resolve(2))
