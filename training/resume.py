"""Finding, checking and reading back a run's checkpoints: the folder layout, which checkpoint a run resumes,
whether it fits the model, and what changed since it was saved.

``training/checkpointing.py`` (the ``Checkpointer``) decides when to save and resume; the files themselves
are written and verified by ``parallel/checkpoint.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from config.errors import ConfigError
from config.run import RunConfig, config_from_dict
from config.schema import apply_override
from config.tokenizer_identity import check_same_tokenizer
from parallel.checkpoint import (
    CONFIG_FILE,
    MANIFEST,
    TRAINER_STATE,
    CheckpointCorruptError,
    SafeFileSystemReader,
    published_checkpoints,
    stateful_module,
    verify,
)
from parallel.runtime import Runtime
from storage.files import write_text_atomic
from training.routing_stats import truncate_routing

RESUME_CHANGES = "resume_changes.yaml"


def checkpoint_root(config: RunConfig, run_dir: Path) -> Path:
    """The folder a run's checkpoints go to: ``checkpoint.dir``, under the run directory unless absolute."""
    folder = Path(config.checkpoint.dir)
    return folder if folder.is_absolute() else Path(run_dir) / folder


def tokenizer_change(path: Path, trainer_state: dict, saved_config: dict, config: RunConfig,
                     now: str) -> dict[str, dict]:
    """The tokenizer's change since the checkpoint at ``path`` (``now``: this run's ``tokenizer_fingerprint``), as a
    change to record with the config's ({} when none, or when the checkpoint predates fingerprints). Refused when
    the content changed under the same ``data.tokenizer`` (``config.tokenizer_identity``'s rule): the model learned
    the old ids, and nothing asked for new ones. Given under another path the change is deliberate, and recorded."""
    saved = trainer_state.get("tokenizer")
    if saved is None or saved == now:
        return {}
    if saved_config.get("data", {}).get("tokenizer") == config.data.tokenizer:
        check_same_tokenizer(saved, config.data.tokenizer, str(path),
                             "data.tokenizer changed in place since the save: put the old file back to resume; or, "
                             "to go on with the new tokenizer deliberately, give it under another path "
                             f"(--set data.tokenizer=NEW), which is recorded in {RESUME_CHANGES}")
    return {"data.tokenizer (content)": {"saved": saved, "now": now}}


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved: dict, current: dict) -> dict[str, dict[str, Any]]:
    """Keys whose value differs between the saved and the current resolved config: {key: {saved, now}}."""
    before, after = _flatten(saved), _flatten(current)
    return {key: {"saved": before.get(key), "now": after.get(key)}
            for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)}


# How this session runs and reports, not what the run is: a resumed run takes them from the command (a checkpoint
# loads into any layout), and every other section from the run's own record.
SESSION_SECTIONS = ("parallel", "logging")


def recorded_config(config: RunConfig, overrides: list[str], run_dir: Path, resume: str) -> RunConfig:
    """The config a run continues with: the one recorded in the checkpoint it resumes, with this command's
    ``--set`` ``overrides`` applied on top and ``SESSION_SECTIONS`` from the command. So a setting left out of the
    command keeps the run's value (a forgotten ``--set train.warmup_steps=1`` would otherwise redraw the schedule);
    one the command sets explicitly is changed, and ``record_changes`` records it. A fresh start, a checkpoint of a
    run under another config's name (``--config`` chose another), or one without a readable config (or one this
    version cannot load) keeps ``config``: the changes are then recorded and checked as before (``check_fits``)."""
    if resume == "none":
        return config
    found, _ = candidates(resume, checkpoint_root(config, run_dir), config.checkpoint.dir)
    try:
        saved = yaml.safe_load((found[0][1] / CONFIG_FILE).read_text(encoding="utf-8")) if found else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        saved = None  # a damaged checkpoint: restore skips it, names the damage, and checks the next one
    if not isinstance(saved, dict) or saved.get("name") != config.name:
        return config
    tree, command = dict(saved), config.to_dict()
    tree.update({section: command[section] for section in SESSION_SECTIONS if section in command})
    try:
        for assignment in overrides:
            apply_override(tree, assignment)
        resumed = config_from_dict(tree)
    except ConfigError as exc:  # a record this version no longer reads (a key renamed since): the command's config
        _say_once(f"resume: the checkpoint's config does not load here ({exc}); going on with this command's config, "
                  "its differences recorded")
        return config
    kept = {key: change for key, change in config_changes(resumed.to_dict(), command).items()
            if not key.startswith(SESSION_SECTIONS) and change["now"] != "auto"}  # auto: resolved at the start
    if kept:
        _say_once("resume: the run's own settings kept where this command's config differs (change one with --set): "
                  + ", ".join(f"{key}={change['saved']!r} (the command's config: {change['now']!r})"
                              for key, change in kept.items()))
    return resumed


def _say_once(text: str) -> None:
    """On stderr, by the first rank only (this runs before the job's process group exists)."""
    if os.environ.get("RANK", "0") == "0":
        print(text, file=sys.stderr)


def candidates(resume: str, root: Path, checkpoint_dir: str) -> tuple[list[tuple[int, Path]], bool]:
    """Checkpoints ``--resume`` asks to try, newest first, and whether it named exactly one (no fallback then).

    ``root`` is the run's own checkpoint folder; ``checkpoint_dir`` is ``checkpoint.dir``, looked for under a
    run directory given as ``--resume PATH``.
    """
    if resume == "none":
        existing = published_checkpoints(root)
        if existing:
            raise ConfigError(f"--resume none, but {root} already holds checkpoints (newest "
                              f"{existing[0][1].name}); resume them (--resume auto), move them away, "
                              "or use another --run-dir")
        return [], False
    if resume == "auto":
        return published_checkpoints(root), False
    path = Path(resume)
    if (path / MANIFEST).is_file() or (path / TRAINER_STATE).is_file():
        return [(-1, path)], True
    for folder in (path, path / checkpoint_dir):
        found = published_checkpoints(folder)
        if found:
            return found, False
    raise ConfigError(f"--resume {resume}: no checkpoint there (expected a step_NNNNNNN folder with "
                      f"{MANIFEST}, or a folder holding such folders)")


def verified(path: Path, runtime: Runtime) -> str | None:
    """None when every rank's share of ``path`` checks out, else the first error this rank or rank 0 saw."""
    try:
        verify(path, runtime.rank, runtime.world_size)
        error = None
    except CheckpointCorruptError as exc:
        error = str(exc)
        print(f"rank {runtime.rank}: checkpoint damaged: {error}", file=sys.stderr)
    if runtime.distributed:
        flag = torch.tensor([0 if error is None else 1], device=runtime.device)  # NCCL: device tensors
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and error is None:
            error = f"{path}: another rank found a damaged file (see its message)"
    return error


def check_fits(path: Path, model, saved_config: dict, config: RunConfig) -> None:
    """Refuse, naming the first tensor that differs and the changed model keys, a checkpoint of another model
    shape (the checkpoint library's own error is a long traceback). Names and global shapes only: the
    checkpoint's metadata against this rank's state dict, read, not loaded."""
    saved = {name.removeprefix("model."): meta.size
             for name, meta in SafeFileSystemReader(path).read_metadata().state_dict_metadata.items()
             if name.startswith("model.")}
    module = stateful_module(model)
    live = {name: value.shape for name, value in
            get_model_state_dict(module, options=StateDictOptions(full_state_dict=False)).items()}
    problem = next((f"{name} is {list(saved[name]) if name in saved else 'missing'} there, {list(shape)} here"
                    for name, shape in live.items() if saved.get(name) != shape), None)
    if problem is None and module is model:  # the whole model here: the checkpoint holds nothing more
        problem = next((f"{name} is there, not in this model" for name in saved if name not in live), None)
    if problem is None:
        return
    changed = {key: change for key, change in config_changes(saved_config, config.to_dict()).items()
               if key.startswith(("model.", "moe."))}
    keys = ", ".join(f"{key} {change['saved']!r} -> {change['now']!r}" for key, change in changed.items())
    raise ConfigError(f"{path} holds another model shape: {problem}" + (f" (changed: {keys})" if keys else "")
                      + "; resume it with its own model settings, or start a new run in another --run-dir")


def record_changes(run_dir: Path, path: Path, step: int, saved_config: dict, config: RunConfig,
                   more: dict[str, dict] | None = None) -> None:
    """Print and append to ``resume_changes.yaml`` every config key that differs from the checkpoint's, and the
    ``more`` changes found otherwise (the tokenizer's content), on rank 0."""
    changes = config_changes(saved_config, config.to_dict()) | (more or {})
    if not changes:
        return
    for key, change in changes.items():
        print(f"resume: {key} changed from {change['saved']!r} to {change['now']!r}", file=sys.stderr)
    log = run_dir / RESUME_CHANGES
    try:
        entries = (yaml.safe_load(log.read_text(encoding="utf-8")) or []) if log.is_file() else []
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{log} is damaged ({' '.join(str(exc).split())[:160]}); move it aside to resume (it only "
                          "records config changes made at resumes)") from exc
    if not isinstance(entries, list):
        raise ConfigError(f"{log} holds a {type(entries).__name__}, not a list of resumes; move it aside to resume")
    entries.append({"step": step, "checkpoint": str(path), "changes": changes})
    write_text_atomic(log, yaml.safe_dump(entries, sort_keys=False))


def rewind_logs(run_dir: Path, step: int) -> None:
    """Drop metric records and routing rows past ``step``, so metrics.jsonl and routing/*.npy read as one run's
    (rank 0)."""
    truncate_routing(run_dir, step)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return
    kept = []
    for number, line in enumerate(metrics.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True), 1):
        if not line.endswith("\n"):
            continue  # a record cut off by a crash
        try:
            record = json.loads(line)
            if record.get("step", 0) <= step:
                kept.append(line)
        except (ValueError, AttributeError) as exc:
            raise ConfigError(f"{metrics}:{number} is not a metrics record ({exc}); the file was damaged after the "
                              "run wrote it: repair or remove that line to resume") from exc
    write_text_atomic(metrics, "".join(kept))


def rng_state() -> dict[str, Any]:
    """This process's CPU (and CUDA) generator states."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
