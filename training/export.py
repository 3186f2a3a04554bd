"""Export a sharded checkpoint to one consolidated safetensors file, and read such a file back.

    python -m training.export runs/moe-8x/checkpoints/step_0000300 model.safetensors
    python train.py --init-from model.safetensors ...

The export runs in one process whatever layout saved the checkpoint: DCP reassembles every tensor (each
expert of the ep-sharded stacks in order) into the single-process model. The file holds the model's
parameters and buffers (the balancing biases included) under the single-process names, and the resolved
config as metadata, so it is usable for inference and analysis without this toolkit. safetensors is a
plain tensor format: reading it executes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from moe.config import ConfigError
from moe.transformer import MoETransformer
from parallel.checkpoint import CheckpointCorruptError, load_sharded, verify
from training.checkpointing import CONFIG_FILE, published_checkpoints
from training.config import config_from_dict

CONFIG_METADATA_KEY = "config.yaml"


def consolidated_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], str, Path]:
    """(full model state dict, resolved config YAML, checkpoint folder) of a verified checkpoint, in one process.

    ``checkpoint`` is a ``step_NNNNNNN`` folder, or a folder of them (a run's ``checkpoints/``): its newest.
    """
    found = published_checkpoints(checkpoint)
    if found:  # a folder of checkpoints: its newest
        checkpoint = found[0][1]
    verify(checkpoint)
    config_text = (checkpoint / CONFIG_FILE).read_text(encoding="utf-8")
    config = config_from_dict(yaml.safe_load(config_text))
    model = MoETransformer(config.model, config.moe)
    load_sharded(model, None, checkpoint)
    return {name: tensor.contiguous() for name, tensor in model.state_dict().items()}, config_text, checkpoint


def export_checkpoint(checkpoint: Path, out: Path) -> int:
    """Write ``checkpoint``'s model to ``out`` (safetensors); returns the number of tensors written."""
    state, config_text, checkpoint = consolidated_state(checkpoint)
    save_file(state, str(out), metadata={CONFIG_METADATA_KEY: config_text, "checkpoint": str(checkpoint)})
    return len(state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a step_NNNNNNN checkpoint folder, or a folder of them")
    parser.add_argument("out", type=Path, help="the .safetensors file to write")
    args = parser.parse_args(argv)
    try:
        count = export_checkpoint(args.checkpoint, args.out)
    except (ConfigError, OSError, RuntimeError, CheckpointCorruptError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {count} tensors to {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
