"""Load a trained model in one call, whatever holds it: a run directory, a checkpoint, an export or an HF folder.

    loaded = load_model("runs/moe-8x", device="cuda")
    loaded.model, loaded.config, loaded.tokenizer

The model is built on the meta device (no memory, no initialisation) and then given storage and filled tensor
by tensor from the source (``parallel.materialize.load_weights``): a checkpoint is reassembled one tensor at a
time by DCP whatever layout saved it, a safetensors file and an HF folder are read in place. So the peak is the
model plus one tensor, never two copies of the model.

The model is made for inference: ``eval()`` (no router jitter), and dropless (``moe.capacity_factor`` null). A
capacity limit is a training device for throughput; at inference it would make a token's output depend on the
other tokens in its batch (the experts they fill), so a cached token-by-token generation, a whole-sequence
forward and a batched evaluation could all disagree. Hugging Face's Mixtral and Qwen3-MoE are dropless too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import Tensor

from config.errors import ConfigError, UserError
from config.run import RunConfig, config_from_dict, load_config
from config.tokenizer_identity import check_same_tokenizer
from data.tokenizer import Tokenizer, load_tokenizer
from interop.export import model_tensors, weights_tokenizer
from interop.hf import hf_run_config, load_hf_weights, split_init_from
from interop.hf_tokenizer import folder_fingerprint
from moe.transformer import MoETransformer
from parallel.checkpoint import CONFIG_FILE, MANIFEST, CheckpointCorruptError, published_checkpoints
from parallel.materialize import allocate, load_weights
from parallel.runtime import requested_device


@dataclass
class LoadedModel:
    """A model ready for inference, the config it was trained with, and its tokenizer (None when the config's
    ``data.tokenizer`` file is not where the run found it: pass ``tokenizer=`` to ``load_model``)."""

    model: MoETransformer
    config: RunConfig
    tokenizer: Tokenizer | None
    source: str  # what was loaded, for messages: the checkpoint folder, the file or hf:DIR


class _WholeTensors:
    """A ``WeightSource`` over a reader of whole tensors (a checkpoint: DCP assembles one tensor at a time)."""

    def __init__(self, entries: dict[str, tuple[torch.Size, torch.dtype]], read: Callable[[str], Tensor]):
        self.entries, self.read_whole = entries, read

    def shape(self, name: str) -> tuple[int, ...] | None:
        return tuple(self.entries[name][0]) if name in self.entries else None

    def read(self, name: str, box: tuple[slice, ...]) -> Tensor:
        return self.read_whole(name)[box]


def resolve_source(source: str | Path) -> str | Path:
    """``source`` as ``model_tensors`` takes it: a run directory becomes its checkpoint folder (``checkpoint.dir``
    of the run's ``config.yaml``); a checkpoint folder, a folder of them, a file or ``hf:DIR`` stay as they are."""
    if isinstance(source, str) and split_init_from(source) is not None:
        return source
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"{path}: no such file or folder (give a run directory, a checkpoint folder, a "
                          ".safetensors file or hf:DIR)")
    # a checkpoint folder holds a config.yaml too, and its shards (a partial one may lack its manifest)
    is_checkpoint = (path / MANIFEST).is_file() or any(path.glob("*.distcp"))
    if path.is_dir() and (path / CONFIG_FILE).is_file() and not is_checkpoint:
        folder = path / _checkpoint_dir(path / CONFIG_FILE)
        if not published_checkpoints(folder):
            raise ConfigError(f"{path}: a run directory without a checkpoint in {folder} (it was run with "
                              "checkpoint.final=false and checkpoint.interval=null, or stopped before its first "
                              "save); run it again to finish it, then load it")
        return folder
    return path


def _checkpoint_dir(run_config: Path) -> str:
    """``checkpoint.dir`` of a run directory's ``config.yaml``, or a ConfigError naming the file when it is damaged
    (not YAML, not UTF-8, not a mapping of sections)."""
    try:
        tree = yaml.safe_load(run_config.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        reason = " ".join(str(exc).split())[:160]
    else:
        section = (tree.get("checkpoint") or {}) if isinstance(tree, dict) else None
        folder = section.get("dir", "checkpoints") if isinstance(section, dict) else None
        if isinstance(folder, str):
            return folder
        reason = "no mapping of sections with checkpoint.dir"
    raise ConfigError(f"{run_config} is damaged ({reason}); it is the run's resolved config, which train.py wrote: "
                      "restore it, or load one of the run's checkpoint folders (RUN/checkpoints/step_NNNNNNN) directly")


def _check_still_there(checkpoint: Path) -> None:
    """A checkpoint that failed to read because it is gone (a running job's ``checkpoint.keep`` pruned it while it was
    read) is said so, not called damaged."""
    if not checkpoint.exists():
        raise UserError(f"{checkpoint} disappeared while it was read (a running job's checkpoint.keep pruned it?); "
                        "load again (its newest checkpoint is then a later one), or copy the checkpoint out of the "
                        "job's folder first")


def weights_of(source: str | Path, base_config: str = "moe-8x", seq_len: int | None = None
               ) -> tuple[str | Path, RunConfig, Callable[[torch.nn.Module], None], str | None]:
    """(the resolved source, the config it was trained with, a function filling a model's tensors from it, the
    fingerprint of the tokenizer it was trained with: ``config.tokenizer_identity``). The filling reads only the
    box of each tensor that a module holds, so it fills a whole model or one rank's shards of a parallelized one
    alike (``parallel.materialize.load_weights``)."""
    resolved = resolve_source(source)
    hf_folder = split_init_from(resolved) if isinstance(resolved, str) else None
    if hf_folder is not None:
        # the model's context (not base_config's) unless told, and the folder's tokenizer.json
        config = hf_run_config(load_config(base_config), hf_folder, seq_len, model_context=True)
        read_into = lambda model: load_hf_weights(model, hf_folder, config)  # noqa: E731
        trained_with = folder_fingerprint(hf_folder)
    else:
        found = published_checkpoints(Path(resolved))  # a folder of checkpoints is read as its newest
        chosen = found[0][1] if found else Path(resolved)
        trained_with = weights_tokenizer(chosen)
        try:
            entries, read, config = model_tensors(chosen)
        except RuntimeError as exc:  # DCP's reader on a checkpoint it cannot read (or that went while it read)
            _check_still_there(chosen)
            if isinstance(exc, CheckpointCorruptError):
                raise
            raise CheckpointCorruptError(f"{resolved}: {exc}") from exc
        read_into = lambda model: load_weights(model, _WholeTensors(entries, read), str(resolved))  # noqa: E731

    def fill(model: torch.nn.Module) -> None:
        try:
            read_into(model)
        except RuntimeError as exc:
            if hf_folder is None:
                _check_still_there(chosen)
            if isinstance(exc, CheckpointCorruptError):
                raise
            raise CheckpointCorruptError(f"{resolved}: cannot read its tensors ({exc})") from exc
    return resolved, config, fill, trained_with


def inference_config(config: RunConfig, seq_len: int | None = None) -> RunConfig:
    """``config`` for inference: dropless (see the module docstring), and ``seq_len`` as the context if given."""
    tree = config.to_dict()
    tree["moe"]["capacity_factor"] = None
    if seq_len is not None:
        tree["model"]["seq_len"] = seq_len
    return config_from_dict(tree)


def load_model(source: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               tokenizer: str | None = None, seq_len: int | None = None, base_config: str = "moe-8x") -> LoadedModel:
    """The model in ``source``, on ``device``, in eval mode and dropless, with its config and tokenizer.

    ``source``: a run directory (its newest checkpoint), a ``step_NNNNNNN`` checkpoint folder or a folder of them,
    a safetensors file this toolkit wrote (``moe-export``, ``moe-hf import``), or ``hf:DIR`` (a Hugging Face
    Mixtral or Qwen3-MoE folder; the rest of its config is ``base_config``'s, its context the folder's
    ``max_position_embeddings`` and its tokenizer the folder's ``tokenizer.json``). ``dtype`` casts the weights
    (default: as stored). ``tokenizer`` overrides the config's ``data.tokenizer`` (a ``tokenizer.json`` path, or
    ``bytes``); ``seq_len`` the context length (the rotary tables' size; a model trained at one length may be run at
    another, at its own risk).
    """
    device = requested_device(device)  # before any reading: a GPU asked for where there is none is refused at once
    resolved, config, fill, trained_with = weights_of(source, base_config, seq_len)
    reader = model_tokenizer(config, tokenizer, trained_with, str(resolved))  # before the weights are read
    config = inference_config(config, seq_len)
    with torch.device("meta"):
        model = MoETransformer(config.model, config.moe)
    allocate(model, device)
    model.reset_buffers()  # the rotary tables (not stored); the balancing biases are then loaded
    fill(model)
    if dtype is not None:  # the weights only: the rotary tables and balancing biases keep fp32
        for parameter in model.parameters():  # the same objects, so the embedding stays tied to the LM head
            parameter.data = parameter.data.to(dtype)
    model.eval()
    return LoadedModel(model, config, reader, str(resolved))


def model_tokenizer(config: RunConfig, tokenizer: str | None = None, trained_with: str | None = None,
                    source: str = "the model") -> Tokenizer | None:
    """The tokenizer ``tokenizer`` names, which must load (and fit the model's vocabulary), else the config's
    ``data.tokenizer``, which may be missing here (the run was elsewhere): None then, and the model is still usable
    on token ids. Refused when it is not the tokenizer the model was trained with (``trained_with``, a fingerprint:
    ``config.tokenizer_identity``), as after a ``moe-tokenizer train --overwrite`` of the run's own file."""
    spec = tokenizer or config.data.tokenizer
    advice = ("give the model's own tokenizer with --tokenizer PATH" if tokenizer is not None else
              f"data.tokenizer {spec} changed since the model was saved (retrained in place?): put the model's "
              "tokenizer back, or give a copy of it with --tokenizer PATH")
    check_same_tokenizer(trained_with, spec, source, advice)
    if tokenizer is not None or spec == "bytes" or Path(spec).is_file():
        return load_tokenizer(spec, config.model.vocab_size)
    return None
