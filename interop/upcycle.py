"""Sparse upcycling: an MoE model that starts from a trained dense one (Komatsuzaki et al. 2022, "Sparse Upcycling:
Training Mixture-of-Experts from Dense Checkpoints", arXiv:2212.05055).

    python -m interop.upcycle runs/dense/checkpoints --experts 8 --top-k 2 --out upcycled.safetensors
    python -m interop.upcycle LLAMA_DIR --experts 8 --top-k 2 --out upcycled.safetensors --config moe-8x
    python train.py --config upcycled.yaml --init-from upcycled.safetensors

DENSE is a checkpoint of this toolkit's dense model (a ``step_NNNNNNN`` folder or a run's ``checkpoints/``; e.g. a
run of ``configs/dense.yaml``), our safetensors file of one (``interop.export``), or a Hugging Face
``LlamaForCausalLM`` or ``Qwen3ForCausalLM`` folder (``interop/hf_dense.py``). The choices this makes, each a flag
where it is one:

- which layers: ``--moe-every`` (default 1, every layer) and ``--first-moe-layer`` (default 0) become
  ``model.moe_every``/``first_moe_layer``; the other layers keep their dense FFN as it is;
- the experts: each of an MoE layer's ``--experts`` E experts is a copy of that layer's dense SwiGLU
  (``w_gate[e] = ffn.w_gate.weight.T``, likewise ``w_in``, ``w_out``), so ``moe.expert_hidden`` is the dense
  ``model.ffn_hidden``. ``--noise S`` adds to each copy its own N(0, (S · the dense matrix's std)^2), drawn from
  ``--seed``; the default 0 keeps the copies identical, and so the model's function (below);
- the router: a fresh gate drawn as a new model's is, N(0, ``model.init_std``) seeded by ``--seed`` (small:
  near-uniform scores), and a zero balancing bias;
- routing that keeps the dense function: ``moe.renormalize: true`` (the k weights sum to 1) and
  ``moe.capacity_factor: null`` (no token dropped), no shared experts. With identical experts an MoE layer then
  outputs sum_e w_e FFN(x) = FFN(x), whatever the router picks, so the upcycled model starts at the dense model's
  loss. Identical experts get different gradients (each sees its own tokens, weighted by the router) and drift
  apart, and then the router's choices start to matter and it learns. With ``--top-k 1`` the one weight is always
  1, so the router learns only from the balancing losses: prefer k >= 2;
- every other tensor (embeddings, attention, norms, head) is copied as it is, in its dtype; the router is fp32.
  The optimizer starts fresh (``train.py --init-from`` loads weights only).

The file holds our names and layouts with the MoE run's resolved config as its ``config.yaml`` metadata, and the
same config is written beside it as ``FILE.yaml`` for ``train.py --config``: the dense run's own config (or, for an
HF folder, ``--config``, default ``moe-8x``; ``--config`` replaces it for ours too; ``--set`` overrides its keys)
with the dense model's shape and the MoE settings above. Training may change the capacity factor and the rest
(``train.py --set``): the weights do not depend on them. Everything streams: one dense tensor is read at a time
and one of ours (an expert stack, E copies) is written at a time, so peak memory is one expert stack.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import Tensor

from config.cli import add_config_arguments, add_overwrite, check_outputs, command_parser, run_command
from config.errors import ConfigError
from config.run import RunConfig, config_from_dict, load_config
from config.schema import apply_override, to_dict
from interop.export import CONFIG_METADATA_KEY, model_tensors, write_safetensors_streaming
from interop.hf import expected_tensors
from interop.hf_dense import dense_tensors, open_dense_folder
from interop.hf_family import check_context
from moe.init import chunk_seed
from storage.files import write_text_atomic

EXPERT_STACKS = ("w_gate", "w_in", "w_out")


@dataclass
class DenseSource:
    """A dense model's weights under our names: the config, each tensor's shape and dtype, a reader of one
    tensor, and each name's name in the source (for errors)."""

    config: RunConfig
    entries: dict[str, tuple[torch.Size, torch.dtype]]
    read: Callable[[str], Tensor]
    names: dict[str, str]


def upcycled_config(dense: RunConfig, base: RunConfig, experts: int, top_k: int, moe_every: int = 1,
                    first_moe_layer: int = 0, name: str = "upcycled") -> RunConfig:
    """``base`` (data, training, balancing) with the dense model's shape, made MoE as the module docstring says."""
    tree = base.to_dict()
    tree["name"] = name
    tree["model"] = to_dict(dense.model) | {"moe_every": moe_every, "first_moe_layer": first_moe_layer,
                                            "seq_len": base.model.seq_len}
    tree["moe"] |= {"num_experts": experts, "top_k": top_k, "expert_hidden": dense.model.ffn_hidden,
                    "activation": "swiglu", "renormalize": True, "capacity_factor": None,
                    "num_shared_experts": 0, "shared_expert_hidden": None, "force_balance": False}
    config = config_from_dict(tree)
    if config.model.n_moe_layers == 0:
        raise ConfigError(f"--moe-every {moe_every} --first-moe-layer {first_moe_layer} makes no layer of "
                          f"{config.model.n_layers} MoE")
    return config


def upcycle(source: DenseSource, config: RunConfig, out: Path, noise: float = 0.0, seed: int = 0) -> int:
    """Write the upcycled model of ``source`` for ``config`` (``upcycled_config``) to ``out``; returns the tensor
    count. Every dense tensor is checked against the dense shape first: the first that differs is named."""
    dense_model = source.config.model
    if dense_model.n_moe_layers:
        raise ConfigError(f"the source has {dense_model.n_moe_layers} MoE layers (model.moe_every="
                          f"{dense_model.moe_every}); upcycling starts from a dense model (model.moe_every: 0)")
    if not 0 <= noise < math.inf:  # NaN fails this too
        raise ConfigError(f"--noise {noise}: must be a finite number >= 0 (a fraction of each dense matrix's std)")
    for name, shape in expected_tensors(dense_model, source.config.moe).items():
        where = source.names.get(name, name)
        if name not in source.entries:
            raise ConfigError(f"the source has no tensor '{where}', which the dense model needs")
        if tuple(source.entries[name][0]) != shape:
            raise ConfigError(f"tensor '{where}' has shape {tuple(source.entries[name][0])}, the dense model's "
                              f"config needs {shape} for our '{name}'")

    def dense_name(name: str) -> tuple[str, str | None]:
        """(the dense tensor ``name`` comes from, its expert stack or None)."""
        parts = name.split(".")
        if parts[2:4] == ["moe", "experts"] and parts[4] in EXPERT_STACKS:
            return f"layers.{parts[1]}.ffn.{parts[4]}.weight", parts[4]
        return name, None

    experts = config.moe.num_experts
    entries = {}
    for name, shape in expected_tensors(config.model, config.moe).items():
        ours, stack = dense_name(name)
        routing = name.endswith(("moe.router.gate", "moe.router.expert_bias"))
        entries[name] = (torch.Size(shape), torch.float32 if routing else source.entries[ours][1])

    def tensor(name: str) -> Tensor:
        if name.endswith("moe.router.expert_bias"):
            return torch.zeros(experts)
        if name.endswith("moe.router.gate"):
            generator = torch.Generator().manual_seed(chunk_seed(seed, name, ()))
            return torch.randn(entries[name][0], generator=generator) * config.model.init_std
        ours, stack = dense_name(name)
        dense = source.read(ours)
        if stack is None:
            return dense
        copies = dense.t().unsqueeze(0).repeat(experts, 1, 1)  # [E, in, out]: our experts are input-major
        if noise > 0:
            scale = noise * dense.float().std()
            for e in range(experts):
                generator = torch.Generator().manual_seed(chunk_seed(seed, name, (e,)))
                copies[e] += (torch.randn(copies[e].shape, generator=generator) * scale).to(copies.dtype)
        return copies

    metadata = {CONFIG_METADATA_KEY: yaml.safe_dump(config.to_dict(), sort_keys=False), "format": "pt"}
    write_safetensors_streaming(out, entries, tensor, metadata)
    return len(entries)


def base_config(dense: RunConfig | None, name: str | None, overrides: list[str]) -> RunConfig:
    """The config whose non-model keys the MoE run takes: ``name`` if given, else the dense run's own (``dense``),
    else ``moe-8x``; with ``overrides`` (``section.key=value``) applied."""
    for assignment in overrides:
        key = assignment.split("=", 1)[0].strip()
        if key.startswith("model.") and key != "model.seq_len":
            raise ConfigError(f"--set {assignment}: the model's shape is the dense model's; of the model keys only "
                              "model.seq_len may be set")
    if name is not None or dense is None:
        return load_config(name or "moe-8x", overrides)
    tree = dense.to_dict()
    for assignment in overrides:
        apply_override(tree, assignment)
    return config_from_dict(tree)


@contextlib.contextmanager
def open_dense(path: Path, config_name: str | None = None, overrides: list[str] = ()):
    """(the dense source at ``path``, ours or a Llama folder; the ``base_config`` of the MoE run)."""
    if path.is_dir() and (path / "config.json").is_file():
        folder, shape = open_dense_folder(path)
        with folder:
            base = base_config(None, config_name, list(overrides))
            tree = base.to_dict()
            tree["model"] |= shape.model
            dense = config_from_dict(tree)
            check_context(shape, dense.model.seq_len)
            entries, read, names = dense_tensors(folder, dense.model)
            yield DenseSource(dense, entries, read, names), base
        return
    if not path.exists():
        raise ConfigError(f"{path}: no such file or folder (a dense checkpoint folder, our .safetensors, or a "
                          "Hugging Face LlamaForCausalLM or Qwen3ForCausalLM folder)")
    entries, read, dense = model_tensors(path)
    yield DenseSource(dense, entries, read, {}), base_config(dense, config_name, list(overrides))


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-upcycle", __doc__)
    parser.add_argument("dense", type=Path,
                        help="a dense checkpoint folder, our .safetensors, or an HF Llama/Qwen3 folder")
    parser.add_argument("--experts", type=int, required=True, help="experts per MoE layer (moe.num_experts)")
    parser.add_argument("--top-k", type=int, required=True, help="experts per token (moe.top_k)")
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write (and FILE.yaml)")
    parser.add_argument("--moe-every", type=int, default=1, help="model.moe_every of the MoE model (default 1)")
    parser.add_argument("--first-moe-layer", type=int, default=0, help="model.first_moe_layer (default 0)")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="std of the noise added to each expert copy, as a fraction of the dense matrix's std")
    parser.add_argument("--seed", type=int, default=0, help="seeds the router and the noise")
    add_overwrite(parser)
    add_config_arguments(parser, default=None,
                         config_help="config whose data, training and balancing keys the MoE run takes (default: "
                                     "the dense run's own; moe-8x for an HF folder)",
                         set_help="override keys of that config, e.g. --set model.seq_len=1024 train.lr=1e-3")
    args = parser.parse_args(argv)

    def upcycle_dense() -> None:
        if args.out.suffix != ".safetensors":
            raise ConfigError(f"--out {args.out}: give a .safetensors path (its config goes beside it as .yaml)")
        if not args.out.parent.is_dir():
            raise ConfigError(f"--out {args.out}: its folder {args.out.parent} does not exist")
        check_outputs([args.out, args.out.with_suffix(".yaml")],
                      [args.dense] + ([Path(args.config)] if args.config and args.config.endswith(".yaml") else []),
                      args.overwrite)
        with open_dense(args.dense, args.config, args.overrides) as (source, base):
            config = upcycled_config(source.config, base, args.experts, args.top_k, args.moe_every,
                                     args.first_moe_layer, name=args.out.stem)
            count = upcycle(source, config, args.out, args.noise, args.seed)
        config_file = args.out.with_suffix(".yaml")
        write_text_atomic(config_file, yaml.safe_dump(config.to_dict(), sort_keys=False))
        print(f"wrote {args.out} ({count} tensors, {config.model.n_moe_layers} MoE layers of {args.experts} "
              f"experts, top-{args.top_k}) and {config_file}; train it with: python train.py --config {config_file} "
              f"--init-from {args.out}", file=sys.stderr)

    return run_command(upcycle_dense)


if __name__ == "__main__":
    sys.exit(main())
