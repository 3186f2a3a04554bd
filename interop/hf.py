"""Hugging Face model folders in and out: import to our weights, export to a folder, and ``--init-from hf:DIR``.

    python -m interop.hf import HF_DIR --out model.safetensors [--config moe-8x] [--seq-len 4096]
    python -m interop.hf export runs/NAME/checkpoints/step_0000300 --out HF_DIR [--architecture NAME]
        [--dtype bf16|fp32] [--max-shard-size 5GB]
    python train.py --config moe-8x --init-from hf:HF_DIR

Families (``FAMILIES``, by the architecture config.json names): Mixtral (``interop/hf_mixtral.py``), Qwen3-MoE
(``interop/hf_qwen3_moe.py``), DeepSeek-V3 (``interop/hf_deepseek_v3.py``), GLM-4.5 (``interop/hf_glm4_moe.py``),
GPT-OSS (``interop/hf_gpt_oss.py``), DeepSeek-V3.2 (``interop/hf_deepseek_v32.py``), GLM-5
(``interop/hf_glm_moe_dsa.py``), Qwen3-Next (``interop/hf_qwen3_next.py``), Qwen3.5-MoE's text model
(``interop/hf_qwen3_5_moe.py``), MiniMax-M2 (``interop/hf_minimax_m2.py``) and DeepSeek-V4
(``interop/hf_deepseek_v4.py``), each a config mapping and its tensor names over the pieces they share
(``interop/hf_family.py``). A folder (``interop/hf_folder.py``) is ``config.json`` plus ``model.safetensors``, or
shards named in ``model.safetensors.index.json``; quantised weights (DeepSeek-V3's block-scaled fp8, GPT-OSS's MXFP4
expert stacks) are dequantised to bf16 box by box as they are read. Everything streams:
import reads one HF tensor at a time (an expert stack, one of our tensors, needs its E experts), export one of our
tensors at a time, and ``--init-from hf:DIR`` converts on the fly, each rank reading just its box of each tensor
(see ``HFWeights``). ``transformers`` is not needed (nor imported): only tests use it, as the oracle.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import sys
from pathlib import Path

import torch
import yaml
from torch import Tensor

from config.cli import add_config_arguments, add_overwrite, check_outputs, command_parser, load_config_from, run_command
from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from config.run import RunConfig, config_from_dict
from config.tokenizer_identity import FINGERPRINT_METADATA_KEY
from interop import (
    hf_deepseek_v3,
    hf_deepseek_v4,
    hf_deepseek_v32,
    hf_glm4_moe,
    hf_glm_moe_dsa,
    hf_gpt_oss,
    hf_minimax_m2,
    hf_mixtral,
    hf_qwen3_5_moe,
    hf_qwen3_moe,
    hf_qwen3_next,
)
from interop.export import (
    CONFIG_METADATA_KEY,
    model_tensors,
    write_safetensors_streaming,
)
from interop.hf_family import Family, Source, check_context, hf_targets
from interop.hf_folder import HFFolder
from interop.hf_shards import INDEX_FILE, parse_size, write_weights
from interop.hf_stored import COMPANION_SUFFIXES, DTYPES, StoredTensors
from interop.hf_tokenizer import (
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    folder_fingerprint,
    folder_tokenizer,
    special_token_ids,
    write_tokenizer_files,
)
from moe.transformer import MoETransformer
from parallel.materialize import load_weights
from storage.files import atomic_folder

# the families we convert, by the architecture config.json names; export tries them in this order
FAMILIES: dict[str, Family] = {family.architecture: family for family in (
    hf_mixtral.FAMILY, hf_qwen3_moe.FAMILY, hf_deepseek_v3.FAMILY, hf_glm4_moe.FAMILY, hf_gpt_oss.FAMILY,
    hf_deepseek_v32.FAMILY, hf_glm_moe_dsa.FAMILY, hf_qwen3_next.FAMILY, hf_qwen3_5_moe.TEXT_FAMILY,
    hf_qwen3_5_moe.FAMILY, hf_minimax_m2.FAMILY, hf_deepseek_v4.FAMILY)}

HF_PREFIX = "hf:"
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def family_of(hf_config: dict) -> Family:
    """The family of a config.json, by its ``architectures`` (or, without them, its ``model_type``); an error
    naming the architecture and the supported ones otherwise."""
    architectures = list(hf_config.get("architectures") or [])
    model_type = hf_config.get("model_type")
    if len(architectures) == 1 and architectures[0] in FAMILIES:
        family = FAMILIES[architectures[0]]
        if model_type is not None and not family.has_model_type(model_type):
            raise ConfigError(f"config.json names architecture {family.architecture} with model_type "
                              f"{model_type!r}, not its '{family.model_type}'")
        return family
    if not architectures:
        for family in FAMILIES.values():
            if family.has_model_type(model_type):
                return family
    what = ", ".join(architectures) or f"model_type {model_type!r}"
    supported = ", ".join(f"{name} (model_type '{family.model_type}')" for name, family in FAMILIES.items())
    raise ConfigError(f"unsupported architecture {what}: supported are {supported}")


class HFWeights:
    """An HF folder seen under our names and layouts (``parallel.materialize.WeightSource``).

    Converts per tensor and per box: a box of an expert stack [e0:e1, i0:i1, j0:j1] is read as the
    [j0:j1, i0:i1] slice of each of those experts' HF matrices, transposed. So a rank of any layout reads
    only its own part, and nothing is converted or written ahead (``--init-from hf:DIR``).
    """

    def __init__(self, folder: HFFolder, sources: dict[str, Source], num_experts: int, architecture: str):
        self.folder, self.sources, self.num_experts, self.architecture = folder, sources, num_experts, architecture
        self.stored = StoredTensors(folder)  # floats, or quantised ones dequantised as read

    def _index_dtype(self, hf_name: str) -> torch.dtype:
        """An integer table's dtype (``Source`` "index"); a float one refused: its values would be cast to ids."""
        code = self.folder.slice(hf_name).get_dtype()
        dtype = DTYPES.get(code)
        if dtype is None or dtype.is_floating_point or dtype == torch.bool:
            raise ConfigError(f"{self.folder.folder}: tensor '{hf_name}' is an index table (token id -> experts) "
                              f"stored as {code}: it must hold integers")
        return dtype

    @classmethod
    def of_family(cls, folder: HFFolder, model: ModelConfig, moe: MoEConfig) -> HFWeights:
        """The folder's weights under our names, through the family its config.json names."""
        family = family_of(folder.config)
        if family.stored_names is not None:
            folder.rename(family.stored_names)
        weights = cls(folder, family.hf_sources(model, moe), moe.num_experts, family.architecture)
        mtp = [name for ours, source in weights.sources.items() if ours.startswith("mtp.") for name in source.names]
        if mtp and not any(name in folder.files for name in mtp):  # (transformers saves no MTP layer of V4's)
            raise ConfigError(f"{folder.folder}: model.mtp_depth={model.mtp_depth}, but the folder stores no "
                              f"multi-token-prediction layer (no '{mtp[0]}'): set model.mtp_depth=0")
        weights.check_all_read(model, family.left_out_for(model))
        return weights

    def check_all_read(self, model: ModelConfig, left_out: tuple[str, ...] = ()) -> None:
        """Refuse, naming it, a tensor of the folder that the model its config.json describes does not use (a layer
        more, q/k/v biases under ``attention_bias: false``, q/k norms under ``use_qk_norm: false``): dropped, the
        rest would be another model than the folder's. Not read on purpose: the block scales of what is read, the
        tied head, rotary tables, and of the multi-token-prediction layers config.json declares
        (``num_nextn_predict_layers``, each with its ``eh_proj``) those the run does not ask for and their copies of
        the embedding and head; and what the family leaves out by name (``left_out``: Qwen3.5-MoE's vision tower)."""
        read = {name for source in self.sources.values() for name in source.names}
        missing = [name for source in self.sources.values() for name in source.names
                   if name not in self.folder.files and not self.stored.blocked(name)]
        if missing:  # a tensor the model needs and the folder lacks says more than one it has and the model does not
            self.folder.slice(missing[0])  # its error names it
        read |= {name + suffix for name in read for suffix in COMPANION_SUFFIXES}
        declared = self.folder.config.get("num_nextn_predict_layers") or 0
        mtp_layers = [f"model.layers.{model.n_layers + k}." for k in range(declared if isinstance(declared, int) else 0)
                      if f"model.layers.{model.n_layers + k}.eh_proj.weight" in self.folder.files]  # one, not a block
        spare = (*mtp_layers[model.mtp_depth:], *left_out)
        copies = {layer + name for layer in mtp_layers for name in ("embed_tokens.weight", "shared_head.head.weight")}
        if model.tie_embeddings:
            copies.add("lm_head.weight")
        unread = sorted(name for name in self.folder.files if name not in read and name not in copies
                        and not name.startswith(spare) and not name.endswith("rotary_emb.inv_freq"))
        if unread:
            raise ConfigError(f"{self.folder.folder}: tensor '{unread[0]}' is not used by the model its config.json "
                              f"describes ({len(unread)} such tensor(s): {', '.join(unread[:4])}"
                              f"{', ...' if len(unread) > 4 else ''}); dropping it would give another model than the "
                              "folder's. Correct config.json (num_hidden_layers, attention_bias, use_qk_norm, ...) "
                              "to describe every tensor, or remove the tensors the model does not have")

    def _source(self, name: str) -> Source:
        if name not in self.sources:
            raise ConfigError(f"{self.folder.folder}: our tensor '{name}' has no {self.architecture} counterpart")
        return self.sources[name]

    def shape(self, name: str) -> tuple[int, ...]:
        source = self._source(name)
        if source.kind == "zeros":
            return (self.num_experts,)
        first = self.stored.shape(source.names[0])
        if source.kind == "copy" and source.columns is not None:
            return (*first[:-1], first[-1] // source.columns[1])
        if source.kind == "copy" and source.rows is not None:
            return (len(source.rows), *first[1:])
        if source.kind in ("copy", "index"):
            return first
        for hf_name in source.names[1:]:
            shape = self.stored.shape(hf_name)
            if shape != first:
                raise ConfigError(f"{self.folder.folder}: tensor '{hf_name}' has shape {shape}, its layer's other "
                                  f"experts {first}")
        return (len(source.names), first[1], first[0])

    def dtype(self, name: str) -> torch.dtype:
        source = self._source(name)
        if source.kind == "zeros" or source.offset:
            return torch.float32
        if source.kind == "index":
            return self._index_dtype(source.names[0])
        # every tensor of a stack checked (one expert may be stored otherwise); the stack has their common dtype
        read_as = [self.stored.dtype(hf_name) or torch.bfloat16
                   for hf_name in source.names]  # MXFP4, fp4 and fp8 are dequantised to bf16 as read
        return functools.reduce(torch.promote_types, read_as)

    def read(self, name: str, box: tuple[slice, ...]) -> Tensor:
        source = self._source(name)
        box = box or tuple(slice(0, n) for n in self.shape(name))  # () is the whole tensor
        if source.kind == "zeros":
            return torch.zeros(box[0].stop - box[0].start)
        if source.kind == "index":
            self._index_dtype(source.names[0])
            return self.folder.slice(source.names[0])[box]
        if source.kind == "copy" and source.columns is not None:  # our columns [c0:c1] of every parts-th HF one
            part, parts = source.columns
            *outer, cols = box
            span = self.stored.box(source.names[0], (*outer, slice(cols.start * parts, cols.stop * parts)))
            return span[..., part::parts]
        if source.kind == "copy" and source.offset:
            return self.stored.box(source.names[0], box).float() + source.offset
        if source.kind == "copy" and source.rows is None:
            return self.stored.box(source.names[0], box)
        if source.kind == "copy":  # our rows [r0:r1] are HF rows rows[r0:r1]: read their span, then pick
            wanted = source.rows[box[0]]
            low = min(wanted)
            span = self.stored.box(source.names[0], (slice(low, max(wanted) + 1), *box[1:]))
            return span[torch.tensor(wanted) - low]
        experts, rows, cols = box  # our [E, in, out] box: HF's [out, in] matrices, transposed
        return torch.stack([self.stored.box(hf_name, (cols, rows)).t() for hf_name in source.names[experts]])


def hf_run_config(config: RunConfig, folder: Path | str, seq_len: int | None = None,
                  model_context: bool = False) -> RunConfig:
    """``config`` with the model and router settings of an HF folder's config.json (they override), and the
    folder's ``tokenizer.json`` for its data (``interop.hf_tokenizer.folder_tokenizer``).

    ``model.seq_len`` is ``seq_len`` if given, else with ``model_context`` the model's own context (its
    ``max_position_embeddings``: what a use that is not a training run takes — an import, ``moe-generate``,
    ``moe-evaluate``), else the config's. The rest (data, training, layout, balancing coefficients) stays the
    config's; our context must fit the model's ``max_position_embeddings`` and any sliding window.
    """
    with HFFolder(folder) as hf:
        shape = family_of(hf.config).shape_from_hf(hf.config)
        tokens = special_tokens_of(hf.config)
    tree = config.to_dict()
    tree["model"].update(shape.model)
    tree["moe"].update(shape.moe)
    tree["model"].update(context_length=shape.max_positions, **tokens)  # kept for the export
    folder_tokenizer(tree["data"], Path(folder))  # the model's own tokenizer reads the run's data
    if seq_len is not None or model_context:
        tree["model"]["seq_len"] = seq_len if seq_len is not None else shape.max_positions
    check_context(shape, tree["model"]["seq_len"])  # before validation: its errors name config.json's keys
    return config_from_dict(tree)


def special_tokens_of(hf_config: dict) -> dict:
    """config.json's ``bos_token_id`` and ``eos_token_id`` (one id or a list: GLM-4.5 ends on any of three) as our
    ``model.bos_token_id`` and ``model.eos_token_ids``."""
    eos = hf_config.get("eos_token_id")
    return {"bos_token_id": hf_config.get("bos_token_id"),
            "eos_token_ids": None if eos is None else [int(i) for i in (eos if isinstance(eos, list) else [eos])]}


def split_init_from(init_from: str | None) -> Path | None:
    """The folder of an ``hf:DIR`` ``--init-from``, else None."""
    return Path(init_from[len(HF_PREFIX):]) if init_from and init_from.startswith(HF_PREFIX) else None


def load_hf_weights(module: torch.nn.Module, folder: Path | str, config: RunConfig) -> int:
    """Fill ``module``'s tensors (this rank's shards) from an HF folder, converting on the fly."""
    with HFFolder(folder) as hf:
        return load_weights(module, HFWeights.of_family(hf, config.model, config.moe), str(folder))


def expected_tensors(model: ModelConfig, moe: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Our state dict's names and shapes for a config, from a meta-device build (no memory)."""
    with torch.device("meta"):
        built = MoETransformer(model, moe)
    return {name: tuple(value.shape) for name, value in built.state_dict().items()}


def import_folder(folder: Path, out: Path, config: RunConfig, seq_len: int | None = None,
                  model_context: bool = False) -> RunConfig:
    """Write an HF folder's model as our safetensors file (our names and layouts, source dtypes kept), with
    our resolved config as the ``config.yaml`` metadata; returns that config (``seq_len`` and ``model_context``:
    as ``hf_run_config``)."""
    config = hf_run_config(config, folder, seq_len, model_context)
    with HFFolder(folder) as hf:
        weights = HFWeights.of_family(hf, config.model, config.moe)
        entries = {}
        for name, shape in expected_tensors(config.model, config.moe).items():
            found = weights.shape(name)
            if found != shape:
                hf_name = weights.sources[name].names[0] if weights.sources[name].names else name
                raise ConfigError(f"{folder}: tensor '{hf_name}' gives our '{name}' the shape {found}, the "
                                  f"config.json's model needs {shape}")
            entries[name] = (torch.Size(shape), weights.dtype(name))
        metadata = {CONFIG_METADATA_KEY: yaml.safe_dump(config.to_dict(), sort_keys=False),
                    "source": f"{HF_PREFIX}{folder}", "format": "pt"}
        if (fingerprint := folder_fingerprint(folder)) is not None:  # what its ids mean travels with the weights
            metadata[FINGERPRINT_METADATA_KEY] = fingerprint
        write_safetensors_streaming(out, entries, lambda name: weights.read(name, ()), metadata)
    return config


def export_family(model: ModelConfig, moe: MoEConfig, architecture: str | None = None) -> Family:
    """The family to export our model as: ``architecture``, or the first of ``FAMILIES`` that can express it;
    an error with each family's reason when none can."""
    if architecture is not None:
        if architecture not in FAMILIES:
            raise ConfigError(f"--architecture {architecture}: supported are {', '.join(FAMILIES)}")
        _check_expresses(FAMILIES[architecture], model, moe)
        return FAMILIES[architecture]
    reasons = []
    for family in FAMILIES.values():
        try:
            _check_expresses(family, model, moe)
            return family
        except ConfigError as exc:
            reasons.append(str(exc))
    raise ConfigError("no Hugging Face family expresses this model: " + "; ".join(reasons))


def _check_expresses(family: Family, model: ModelConfig, moe: MoEConfig) -> None:
    """The family's refusal of a setting, if any; and every one of our tensors must have its place in the family's
    folder (a tensor it has no name for, such as GPT-OSS's sinks in a Mixtral, would be dropped silently)."""
    family.hf_from_config(model, moe)
    sources = family.hf_sources(model, moe)
    missing = [name for name in expected_tensors(model, moe) if name not in sources]
    if missing:
        raise ConfigError(f"cannot export as {family.architecture}: it has no place for our tensor '{missing[0]}'"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")


def export_folder(source: Path, out: Path, architecture: str | None = None, dtype: str | None = None,
                  max_shard_bytes: int | None = None) -> tuple[int, RunConfig]:
    """Write our checkpoint (a step folder, a folder of them, or our safetensors file) as an HF folder of
    ``architecture`` (by default the first family that expresses the model, see ``export_family``).

    One of our tensors in memory at a time (an expert stack is split into its E transposed matrices, or one
    interleaved pair joined). The weights keep their dtype (or take the family's ``export_dtype``: GPT-OSS's
    bf16) unless ``dtype`` (``EXPORT_DTYPES``) casts each as it is written; with
    ``max_shard_bytes`` they go into shards of at most that size and an index (``interop/hf_shards.py``).
    Returns the number of HF tensors written, and our config.
    """
    entries, read, config = model_tensors(source)
    family = export_family(config.model, config.moe, architecture)
    hf_config = family.hf_from_config(config.model, config.moe) | special_token_ids(config)
    targets = hf_targets(family.hf_sources(config.model, config.moe))
    for ours in {ours for target in targets.values() for ours in target.ours}:
        if ours not in entries:
            raise ConfigError(f"{source}: has no tensor '{ours}' that a {family.architecture} export needs")
    if dtype is None and family.export_dtype is not None:
        dtype, why = family.export_dtype
        print(f"note: writing {family.architecture} in {dtype} ({why}; --dtype fp32 keeps full precision)",
              file=sys.stderr)
    cast = EXPORT_DTYPES[dtype] if dtype is not None else None
    cache: dict[str, Tensor] = {}

    def values(ours: tuple[str, ...]) -> list[Tensor]:
        if set(cache) != set(ours):
            cache.clear()  # tensors are asked for in order: one of ours (or one interleaved pair) in memory at a time
            cache.update({name: read(name) if cast is None or not entries[name][1].is_floating_point
                          else read(name).to(cast) for name in ours})  # integer tables (tid2eid) as they are
        return [cache[name] for name in ours]

    def hf_tensor(name: str) -> Tensor:
        target = targets[name]
        parts = [] if target.offset else values(target.ours)
        if target.rows is not None:
            return torch.cat(parts)[list(target.rows)]
        if len(parts) > 1:
            return torch.stack(parts, dim=-1).flatten(-2)
        if target.offset:  # subtracted in fp32, before any cast
            return (read(target.ours[0]).float() - target.offset).to(cast or entries[target.ours[0]][1])
        return parts[0] if target.expert is None else parts[0][target.expert].t().contiguous()

    hf_entries = {}
    for name, target in targets.items():
        shape, stored = entries[target.ours[0]]
        if target.expert is not None:
            shape = (shape[2], shape[1])
        if target.rows is not None:
            hf_entries[name] = (torch.Size((len(target.rows), *shape[1:])), cast or stored)
            continue
        kept = stored if not stored.is_floating_point else cast or stored
        hf_entries[name] = (torch.Size((*shape[:-1], shape[-1] * len(target.ours))), kept)
    hf_config["torch_dtype"] = str(next(iter(hf_entries.values()))[1]).removeprefix("torch.")
    foreign = sorted(path.name for path in out.iterdir() if not is_export_file(path.name)) if out.is_dir() else []
    if foreign:  # the folder is replaced whole: never what this command did not write
        raise ConfigError(f"{out} holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}, which an export "
                          "does not write; an export replaces its folder whole, so give another --out")
    with atomic_folder(out) as folder:  # whole or not at all: never a mix of this export and an earlier one
        write_weights(folder, hf_entries, hf_tensor, max_shard_bytes)
        (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        said = write_tokenizer_files(config, folder).replace(str(folder), str(out))
    print(said, file=sys.stderr)
    return len(hf_entries), config


def is_export_file(name: str) -> bool:
    """Whether ``export_folder`` writes files of this name (an earlier export's, which a new one may replace)."""
    return name in ("config.json", INDEX_FILE, GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE) \
        or fnmatch.fnmatch(name, "model*.safetensors")


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-hf", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="an HF model folder -> our safetensors file (with our config)")
    imp.add_argument("folder", type=Path)
    imp.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    add_overwrite(imp)
    add_config_arguments(imp, config_help="the config whose non-model keys the file records",
                         set_help="override keys of that config, e.g. --set train.lr=1e-4")
    imp.add_argument("--seq-len", type=int, default=None,
                     help="model.seq_len to record (default: the folder's max_position_embeddings)")
    exp = commands.add_parser("export", help="our checkpoint (or safetensors file) -> an HF model folder")
    exp.add_argument("checkpoint", type=Path, help="a step_NNNNNNN folder, a folder of them, or our .safetensors")
    exp.add_argument("--out", type=Path, required=True, help="the folder to write")
    add_overwrite(exp)
    exp.add_argument("--architecture", choices=list(FAMILIES), default=None,
                     help="the HF architecture to write (default: the first that expresses the model)")
    exp.add_argument("--dtype", choices=list(EXPORT_DTYPES), default=None,
                     help="cast the weights as they are written (default: the checkpoint's dtype; GPT-OSS: bf16)")
    exp.add_argument("--max-shard-size", default=None, metavar="SIZE",
                     help="write shards of at most SIZE (5GB, 500MB, 2GiB) and model.safetensors.index.json "
                          "(default: one model.safetensors)")
    args = parser.parse_args(argv)

    def convert() -> None:
        check_outputs([args.out], [args.folder if args.command == "import" else args.checkpoint], args.overwrite)
        if args.command == "import":
            import_folder(args.folder, args.out, load_config_from(args), args.seq_len, model_context=True)
            print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)
        else:
            max_bytes = parse_size(args.max_shard_size) if args.max_shard_size is not None else None
            count, config = export_folder(args.checkpoint, args.out, args.architecture, args.dtype, max_bytes)
            print(f"wrote {count} tensors and config.json to {args.out}", file=sys.stderr)
            if config.moe.capacity_factor is not None:
                print(f"note: trained with moe.capacity_factor={config.moe.capacity_factor}; Hugging Face routes "
                      "dropless, so its outputs equal ours with moe.capacity_factor=null", file=sys.stderr)

    return run_command(convert)


if __name__ == "__main__":
    sys.exit(main())
