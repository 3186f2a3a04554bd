"""The ``parallel`` section of a run's config: how the model is spread, passed whole to ``parallel/``.

The degrees are defined here once (``DEGREES``); ``parallel.layout.Layout`` resolves them against a world
size, and ``parallelize`` and ``build_pipeline`` take this config whole rather than a flag per option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from config.schema import require

# The parallel degrees, in the order the rank arithmetic lays out ranks (``parallel/ranks.py``): the one list of them
DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")


@dataclass
class ParallelConfig:
    """Degrees of the parallel dimensions; the dense ones multiply to the world size.

    One degree may be -1: whatever is left. Expert parallelism folds over dp_shard * cp * tp.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1  # -1 = whatever is left of the world size
    # context parallelism: each rank holds 1/cp of every sequence (two chunks of 1/(2 cp), one from each end)
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pp_virtual_stages: int = 1  # pipeline stages per pp rank (v); > 1 with the interleaved schedule
    # micro-batches per optimizer step on one pipeline; None = derived from train.micro_batch_size
    microbatches: int | None = None
    # recompute activations in backward: none, every block ("full"), or only the MoE blocks ("moe")
    activation_checkpointing: Literal["none", "full", "moe"] = "none"
    # keep saved activations in pinned host memory until backward (GPU only): none, every block, or the MoE layers
    activation_offload: Literal["none", "blocks", "moe"] = "none"
    # free each block's gathered FSDP weights after forward (gather again in backward): less memory, more traffic
    reshard_after_forward: bool = True
    # tensor parallelism's options (tp > 1): norms and residual stream on a 1/tp slice of the sequence;
    # embedding, LM head and loss split over the vocabulary
    sequence_parallel: bool = False
    vocab_parallel: bool = False
    # when gradient accumulation reduces gradients over the data-parallel ranks: once per optimizer step, on
    # the last micro-batch (each FSDP unit holds its unsharded gradients in between), or a reduce-scatter per
    # micro-batch (ZeRO-3: sharded gradients only, m times the traffic); HSDP's all-reduce over the replicas
    # runs once per step either way (``parallel.sharding.set_gradient_sync``)
    grad_reduce: Literal["step", "microbatch"] = "step"
    # ranks per node, consecutive (torchrun's numbering): where the experts' exchange crosses the network
    # (``parallel/node_dispatch.py``); null = torchrun's LOCAL_WORLD_SIZE. Set it to simulate nodes on one machine
    ranks_per_node: int | None = None
    # replica slots per expert-parallel rank for hot experts (``parallel/replica_exchange.py``): after routing, each
    # micro-batch copies the hottest experts' weights into under-loaded ranks' slots and splits their rows, so every
    # ep rank computes close to the mean load; the function computed is unchanged. 0 = off
    ep_replicas: int = 0

    def degrees(self) -> dict[str, int]:
        """The seven degrees, as ``parallel.layout.Layout.resolve`` takes them."""
        return {name: getattr(self, name) for name in DEGREES}

    def validate(self) -> None:
        """Per-key checks; the layout as a whole is checked against the world size by ``parallel.layout``."""
        for name in DEGREES:
            value = getattr(self, name)
            require(value >= 1 or value == -1, f"parallel.{name} must be >= 1, or -1 for the rest; got {value}")
        require(self.pp_virtual_stages >= 1, f"parallel.pp_virtual_stages must be >= 1, got {self.pp_virtual_stages}")
        require(self.ranks_per_node is None or self.ranks_per_node >= 1,
                f"parallel.ranks_per_node must be >= 1 or null (torchrun's LOCAL_WORLD_SIZE), "
                f"got {self.ranks_per_node}")
        require(self.ep_replicas >= 0, f"parallel.ep_replicas must be >= 0, got {self.ep_replicas}")
        require(self.ep_replicas == 0 or self.ep != 1,
                f"parallel.ep_replicas={self.ep_replicas} needs expert parallelism (parallel.ep > 1): with one ep "
                "rank every expert is already on it")
        require(self.microbatches is None or self.microbatches >= 1,
                 f"parallel.microbatches must be >= 1 or null, got {self.microbatches}")
        if self.activation_offload != "none":
            require(self.activation_checkpointing == "none",
                     f"parallel.activation_offload={self.activation_offload} with parallel.activation_checkpointing="
                     f"{self.activation_checkpointing}: choose one (recomputing keeps less than offloading moves)")
            require(self.pp == 1, "parallel.activation_offload with pipeline parallelism (parallel.pp > 1) is not "
                                   "supported yet: it assumes one micro-batch in flight")
