"""Time of collective traffic on its links: NCCL's ring latency (``startup``) plus the bus bytes over the bandwidth
NCCL gets of the link (``bandwidth``: NVLink inside a node, the rank's own network adapter across nodes), with no
overlap with compute (that is ``analysis.step_time``'s business); and the table ``moe-communication`` prints.
"""

from __future__ import annotations

from analysis.gpu_presets import Hardware
from analysis.traffic_items import Traffic, nodes_spanned


def bandwidth(item: Traffic, hardware: Hardware, gpus_per_node: int) -> float:
    """Bytes/s ``item`` gets from its links: NVLink at NCCL's share (``Hardware.intra_efficiency``, ``NCCL_EFFICIENCY``;
    1 for a preset whose link rate is itself measured by collectives) inside a node; across
    nodes the rank's own adapter at ``Hardware.network_efficiency`` (``NETWORK_EFFICIENCY``), for every collective.

    A ring whose group has k ranks in each node could in principle send its bytes over the k adapters of the
    node together (NCCL's channels, one per adapter), and nccl-tests reach that on idle nodes (85 to 96 GB/s
    of all-reduce bus bandwidth over nodes of 8 GPUs and 4 HDR adapters: NVIDIA/nccl-tests issue #119). The training
    steps of Narayanan et al. 2021 Table 2 did not: ZeRO-3 of a 175B model took the same 66.7 s per step on 768
    and on 1,536 A100s (and a 530B model 180 and 184 s on 1,120 and 2,240), with 8 of each node's GPUs in
    every ring. A step that does not shrink as the compute halves is bound by traffic at a fixed rate per GPU;
    its bytes (``predict``: 8 per parameter) over that time are 0.85 to 1.0 of one 25 GB/s HDR adapter per
    GPU, where the node's 8 adapters per ring at NCCL's 80% would have moved them in a sixth or a seventh of
    the time. So rings across nodes are priced at the rank's own adapter, as measured in training, not at the
    node's. (Why those rings did not use the node's adapters is not known here.)
    """
    if item.link(gpus_per_node) == "intra":
        return hardware.intra_node * hardware.intra_efficiency
    return hardware.inter_node * hardware.network_efficiency


def ring_steps(item: Traffic, gpus_per_node: int) -> tuple[int, int]:
    """(steps, of which cross nodes) of one call of ``item``, as NCCL's tuning model counts a ring's
    (``NCCL_LATENCY``): all-reduce 2(n − 1) and 2(k − 1) over k nodes, all-gather and reduce-scatter n − 1 and
    k − 1. A broadcast is a chain of n − 1 steps; a send is one step. An all-to-all posts its sends to and
    receives from all n − 1 peers before it waits for any (gloo/alltoall.cc and alltoallv.cc; PyTorch's NCCL
    all-to-all groups one send and one receive per peer), so its exchanges wait together: one step, across
    nodes if any peer is in another node."""
    n, k = len(item.group), nodes_spanned(item.group, gpus_per_node)
    if item.collective == "all_reduce":
        return 2 * (n - 1), 2 * (k - 1)
    if item.collective == "all_to_all":
        return 1, int(k > 1)
    return n - 1, k - 1  # all-gather, reduce-scatter, broadcast; a send's group is (sender, receiver)


def startup(item: Traffic, hardware: Hardware, gpus_per_node: int) -> float:
    """Seconds ``item``'s calls spend on latency: per call ``Latency.call`` plus each ring step's."""
    steps, crossing = ring_steps(item, gpus_per_node)
    lat = hardware.latency
    return item.calls * (lat.call + (steps - crossing) * lat.intra_step + crossing * lat.inter_step)


def seconds(item: Traffic, hardware: Hardware, gpus_per_node: int) -> float:
    """Time of ``item`` on its links: its latency (``startup``) and its bytes at ``bandwidth`` (no overlap with
    compute)."""
    return startup(item, hardware, gpus_per_node) + item.bus_bytes / bandwidth(item, hardware, gpus_per_node)


def format_table(items: list[Traffic], hardware: Hardware, gpus_per_node: int) -> str:
    """One line per traffic item, then the totals per dimension and per link."""
    rows = [f"{'dim':<5} {'collective':<14} {'ranks':>5} {'link':<5} {'calls':>6} {'MiB':>10} {'ms':>9}  what"]
    for item in items:
        rows.append(f"{item.dimension:<5} {item.collective:<14} {len(item.group):>5} {item.link(gpus_per_node):<5} "
                    f"{item.calls:>6} {item.bus_bytes / 2**20:>10.2f} "
                    f"{seconds(item, hardware, gpus_per_node) * 1e3:>9.3f}  {item.what}")
    rows.append("")

    def total(label: str, chosen: list[Traffic]) -> str:
        time = sum(seconds(i, hardware, gpus_per_node) for i in chosen)
        return f"{label:<26} {sum(i.bus_bytes for i in chosen) / 2**20:>10.2f} {time * 1e3:>9.3f}"

    for label, key in (("dimension", lambda i: i.dimension), ("link", lambda i: i.link(gpus_per_node))):
        for value in dict.fromkeys(map(key, items)):
            rows.append(total(f"total {label} {value}", [i for i in items if key(i) == value]))
    rows.append(total("total", items))
    return "\n".join(rows)
