"""Checkpoint policy for one run: what a checkpoint holds, when to save, which one to resume, what to keep.

The mechanism (sharded DCP files, manifest, atomic rename, verification) is ``parallel/checkpoint.py``;
finding, checking and reading back checkpoints is ``training/resume.py``.
A checkpoint ``<run_dir>/checkpoints/step_NNNNNNN/`` holds:

- the model and the optimizer's per-parameter state, sharded as they live (DCP files, one per rank);
- ``trainer_state.json``: step, tokens seen, skipped steps, the data sampler's state, the layout;
- ``rng/rank_NNNNN.pt``: each rank's CPU (and CUDA) generator state, read back with ``weights_only``;
- ``config.yaml``: the resolved config it was trained with, to record what changed on resume;
- ``manifest.json``: size and SHA-256 of every file above, written last.

The aux-loss-free balancing biases are buffers of the model and travel with it; the LR schedule is a
pure function of the step. ``latest`` names the newest published checkpoint, for people and tools;
resuming walks the published checkpoints newest first and takes the first that verifies.

Only a state known good is published: its weights are finite on every rank, and its own loss (the next
step's forward, or the final validation for the last state) is finite. A save is written when it is taken
and published once that loss is seen; a state that turns out bad is discarded before anything published is
pruned, so a divergence never evicts the checkpoints from before it, and ``--resume auto`` takes the last good one.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from config.errors import ConfigError
from config.run import RunConfig
from config.tokenizer_identity import tokenizer_fingerprint
from data.sampler import TokenSampler
from parallel.checkpoint import (
    CONFIG_FILE,
    LATEST,
    TMP_PREFIX,
    CheckpointCorruptError,
    async_save_sharded,
    load_sharded,
    publish,
    published_checkpoints,
    save_sharded,
    sharded_state,
    step_dir_name,
    write_manifest,
)
from parallel.groups import ParallelGroups
from parallel.materialize import InitialWeights
from parallel.runtime import Runtime
from storage.files import remove_tree, write_text_atomic
from training.checkpoint_interval import AutoInterval
from training.optim import restretch_note
from training.resume import (
    TRAINER_STATE,
    candidates,
    check_fits,
    checkpoint_root,
    record_changes,
    rewind_logs,
    rng_state,
    set_rng,
    tokenizer_change,
    verified,
)
from training.run_dir import rank0_verdict


class CheckpointWriteError(ConfigError):
    """A save could not be written (a full disk, say); ``quiet`` on ranks other than 0, which says it."""

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def _cause(error: BaseException) -> str:
    """The first underlying error of ``error`` (DCP wraps each rank's failure), in one line."""
    failures = getattr(error, "failures", None)
    if failures:  # {rank: (exception, traceback summary)}
        first = next(iter(failures.values()))
        error = first[0] if isinstance(first, tuple) else first
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error).splitlines()[0]


def weights_finite(model: torch.nn.Module, runtime: Runtime) -> bool:
    """Whether every parameter of the whole model is finite, the same answer on every rank.

    Each rank checks only what it holds (a DTensor's local shard, its own pipeline stages): one isfinite-all per
    local tensor, then one all-reduce of a one-element flag over all ranks; no weights are gathered.
    """
    with torch.no_grad():
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        flag = (torch.stack([torch.isfinite(t).all() for t in local]).all() if local
                else torch.ones((), dtype=torch.bool))
        flag = flag.to(device=runtime.device, dtype=torch.int32).reshape(1)  # NCCL: device tensors
        if runtime.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


@dataclass
class _Save:
    """A save written (or being written, ``future``) to ``tmp`` and not yet published."""

    future: Any  # the async write's future; None when written synchronously
    step: int
    tmp: Path
    started: float
    blocked: float | None  # seconds training was blocked (async); None: the whole save
    written: list[float] = field(default_factory=list)  # when the background write ended
    good: bool = False  # the state's own loss was seen finite: it may be published


class Checkpointer:
    """Saves, resumes and guards one run; every rank makes the same calls in the same order (they are collective).

    ``resume``: "auto" continues from the newest complete checkpoint in the run's checkpoint folder (a
    fresh start when there is none), "none" starts fresh (refused when checkpoints exist, so none is
    overwritten), or a path: a checkpoint folder, or a folder of them (its newest complete one).
    """

    def __init__(self, config: RunConfig, run_dir: Path, runtime: Runtime, groups: ParallelGroups,
                 resume: str = "auto", init_weights: InitialWeights | None = None):
        self.config, self.runtime, self.groups, self.resume = config, runtime, groups, resume
        self.init_weights = init_weights
        self.policy = config.checkpoint
        self.run_dir = Path(run_dir)
        self.root = checkpoint_root(config, self.run_dir)
        # what the run's token ids mean, read once: recorded in every save, compared at a resume
        self.tokenizer = tokenizer_fingerprint(config.data.tokenizer)
        self.tokens_per_step = config.train.global_batch_size * config.model.seq_len
        self.step, self.tokens_seen, self.skipped_steps, self.bad_in_a_row = 0, 0, 0, 0
        self.auto = AutoInterval(self.policy.mtbf_hours * 3600.0) if self.policy.interval == "auto" else None
        # async writes run collectives from a background thread: they get a group of their own
        self.async_group = groups.background_group() if self.policy.async_save else None
        self.last_saved_step: int | None = None
        self.resumed_step: int | None = None  # the checkpoint this run started from
        self.confirmed_step: int | None = None  # the newest state whose own loss this process saw finite
        self._last_save_time = time.monotonic()
        self._pending: _Save | None = None  # the save waiting for its state to be known good, or for its write
        self.log_metrics = None  # set to MetricsLogger.log to record save times in metrics.jsonl
        self.saves: list[dict[str, float]] = []  # per save: step, seconds, blocked seconds, bytes

    def say(self, text: str) -> None:
        if self.runtime.is_main:
            print(text, file=sys.stderr)

    # --- resume ---------------------------------------------------------------------------------------

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sampler: TokenSampler) -> int:
        """Load the checkpoint ``resume`` selects into the live objects; returns the last completed step (0: fresh)."""
        if self.runtime.is_main:
            for stale in self.root.glob(f"{TMP_PREFIX}*") if self.root.is_dir() else []:
                self.say(f"removing {stale}: an incomplete save (the job stopped before it was written and known good)")
                remove_tree(stale)
        found, exact = candidates(self.resume, self.root, self.policy.dir)
        for _, path in found:
            error = verified(path, self.runtime)
            if error is None:
                return self._load(path, model, optimizer, sampler)
            if exact:
                raise CheckpointCorruptError(f"--resume {self.resume}: {error}")
            self.say(f"skipping damaged checkpoint {path.name}: {error}; trying the previous one")
        if found:
            raise CheckpointCorruptError(f"no complete checkpoint in {self.root}: every one failed verification "
                                         "(see above); restore one, or move them away and start with --resume none")
        if self.init_weights is not None:
            self._init_weights(model)
        return 0

    def _init_weights(self, model: torch.nn.Module) -> None:
        """Start from ``init_weights`` (a consolidated safetensors file or a Hugging Face folder:
        ``interop/weights.py``), with a fresh optimizer. Each rank reads only its own shards of each tensor."""
        count = sum(self.init_weights.load(part) for part in getattr(model, "stages", [model]))
        self.say(f"initialised from {self.init_weights.label} ({count} tensors on this rank); optimizer state starts "
                 "fresh")

    def _load(self, path: Path, model, optimizer, sampler: TokenSampler) -> int:
        if self.init_weights is not None:
            self.say(f"--init-from {self.init_weights.label} ignored: the run resumes its own checkpoint")
        started = time.perf_counter()
        saved_config = yaml.safe_load((path / CONFIG_FILE).read_text(encoding="utf-8"))
        check_fits(path, model, saved_config, self.config)
        check_same_optimizer(path, saved_config, self.config)
        state = json.loads((path / TRAINER_STATE).read_text(encoding="utf-8"))
        tokenizer = tokenizer_change(path, state, saved_config, self.config, self.tokenizer)
        load_sharded(model, optimizer, path)
        sampler.load_state_dict(state["sampler"])
        self.step, self.tokens_seen, self.skipped_steps = state["step"], state["tokens_seen"], state["skipped_steps"]
        self.last_saved_step = self.resumed_step = self.step
        same_world = state["world_size"] == self.runtime.world_size
        if same_world:
            set_rng(torch.load(path / "rng" / f"rank_{self.runtime.rank:05d}.pt", weights_only=True))
        self.say(f"resumed from {path} at step {self.step} ({self.tokens_seen:,} tokens seen) in "
                 f"{time.perf_counter() - started:.2f} s"
                 + ("" if same_world else f"; saved on {state['world_size']} ranks, now {self.runtime.world_size}: "
                    "resharded, and random generators keep this run's seeding"))
        note = restretch_note(saved_config.get("train") or {}, self.config.train, self.step)
        if note:
            self.say(note)
        error = None
        if self.runtime.is_main:  # rank 0 alone touches the run's logs; every rank learns if that failed
            try:
                record_changes(self.run_dir, path, self.step, saved_config, self.config, tokenizer)
                rewind_logs(self.run_dir, self.step)
            except ConfigError as exc:
                error = exc
        rank0_verdict(self.runtime, error)
        return self.step

    # --- per step ------------------------------------------------------------------------------------

    def check_finite(self, step: int, loss: float, grad_norm: float, model, optimizer,
                     sampler: TokenSampler) -> str | None:
        """Judge ``step``; returns the message to stop with, or None to go on (collective: every rank calls it).

        ``loss`` was computed on the weights the step started from, so it is that state's own loss: a finite one
        lets the save of that state be published, a non-finite one discards it. A non-finite loss or gradient norm
        skipped the update (``train_step``); after ``train.max_bad_steps`` such steps in a row the run stops, and
        at once when an update with finite loss and gradient wrote non-finite weights (nothing can undo it).
        """
        self.step = step
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self._judge_pending(step - 1, finite)
        if finite:
            self.confirmed_step = step - 1
            self.bad_in_a_row = 0
            self.tokens_seen += self.tokens_per_step
            if weights_finite(model, self.runtime):
                return None
            return (f"step {step}: the update gave non-finite weights (loss {loss} and gradient norm {grad_norm} "
                    f"were finite); stopping. {self._advice()}")
        self.bad_in_a_row += 1
        self.skipped_steps += 1
        limit = self.config.train.max_bad_steps
        self.say(f"step {step}: loss {loss}, gradient norm {grad_norm}: update skipped "
                 f"({self.bad_in_a_row} in a row, limit train.max_bad_steps={limit})")
        if self.bad_in_a_row < limit:
            return None
        return (f"step {step}: {limit} non-finite steps in a row (loss {loss}, gradient norm {grad_norm}); "
                f"stopping. {self._advice()}")

    def _judge_pending(self, step: int, good: bool) -> None:
        """The save of the state after ``step`` (if one waits) is good: publish it (a synchronous one now, an
        asynchronous one once written); or bad: discard it."""
        pending = self._pending
        if pending is None or pending.step != step or pending.good:
            return
        if not good:
            self._discard_pending()
            return
        pending.good = True
        if pending.future is None:
            self._finalize_pending()

    def _advice(self) -> str:
        """What to do after a divergence: the last good checkpoint and how to resume it with other settings.
        Publishes a save still pending if its state was confirmed good (discards it otherwise) first."""
        self._finalize_pending()
        published = published_checkpoints(self.root)
        lr = f"a lower train.lr (now {self.config.train.lr}) or train.grad_clip (now {self.config.train.grad_clip})"
        if published and published[0][0] == self.resumed_step and self.confirmed_step is None:
            # not one good step since resuming: the checkpoint itself gives non-finite losses (the lr cannot:
            # the first step's loss and gradient come before any update)
            older = [path for step, path in published if step < self.resumed_step]
            where = (f"resume from the one before it with --resume {older[0]}" if older else
                     "no earlier checkpoint is kept: start again with --resume none (this run's files are moved "
                     "aside)")
            return (f"The checkpoint this run resumed from, {published[0][1]}, gives non-finite steps itself; "
                    f"{where}, with {lr}")
        if published:
            return (f"The last good state is {published[0][1]} (nothing after it was published); run again in "
                    f"this run directory to resume it, with {lr}")
        return (f"No checkpoint of a good state was saved; start again with {lr}, with --resume none (this run's "
                "files are moved aside) or another --run-dir")

    def plan(self) -> str:
        """When this run saves, and where, for the start-up banner."""
        if not self.policy.enabled:
            return "checkpoints: none (checkpoint.interval=null, checkpoint.final=false): nothing will be saved"
        when = []
        if isinstance(self.policy.interval, int):
            when.append(f"every {self.policy.interval} steps")
        elif self.auto is not None:
            when.append(f"at the Young/Daly interval (checkpoint.interval=auto: from the measured save time and "
                        f"an MTBF of {self.policy.mtbf_hours:g} h; the first save after step 1 measures it)")
        if self.policy.interval_minutes is not None:
            when.append(f"every {self.policy.interval_minutes:g} minutes")
        if self.policy.final:
            when.append("at the end")
        return f"checkpoints: {' and '.join(when)}, in {self.root} (the newest {self.policy.keep} kept)"

    def _due(self, step: int) -> bool:
        """Whether the policy asks for a save after ``step``; the same answer on every rank."""
        interval, minutes = self.policy.interval, self.policy.interval_minutes
        if isinstance(interval, int) and step % interval == 0:
            return True
        if self.auto is None and minutes is None:
            return False
        elapsed = time.monotonic() - self._last_save_time
        due = ((minutes is not None and elapsed >= 60.0 * minutes)
               or (self.auto is not None and elapsed >= self.auto.interval_s))
        if self.runtime.distributed:  # clocks differ between ranks: rank 0 decides
            flag = torch.tensor([int(due)], device=self.runtime.device)
            dist.broadcast(flag, src=0)
            due = bool(flag.item())
        return due

    def after_step(self, step: int, model, optimizer, sampler: TokenSampler) -> None:
        """Save if the policy says so, and the step was good (a skipped step leaves weights that gave non-finite
        values: not a state to save). The save is published once the next step's loss is finite."""
        if (self.policy.periodic and step != self.config.train.steps and self.bad_in_a_row == 0
                and self._due(step)):
            self.save(step, model, optimizer, sampler)

    def finish(self, step: int, model, optimizer, sampler: TokenSampler, val_loss: float) -> str | None:
        """Save the final state, whose own loss is the final validation ``val_loss``, and publish every save still
        pending. Returns the message to stop with when the final state is not good (nothing of it is saved)."""
        if self.bad_in_a_row or not math.isfinite(val_loss):
            why = (f"the last {self.bad_in_a_row} step(s) were non-finite and skipped" if self.bad_in_a_row else
                   f"the final weights give a non-finite validation loss ({val_loss})")
            return f"step {step}: {why}; the final state is not saved. {self._advice()}"
        if self.policy.final and self.last_saved_step != step:
            self.save(step, model, optimizer, sampler, reason="final")
        self._judge_pending(step, good=True)
        self._finalize_pending()
        return None

    # --- saving --------------------------------------------------------------------------------------

    def save(self, step: int, model, optimizer, sampler: TokenSampler, reason: str = "interval") -> Path:
        """Write a checkpoint of the state after ``step`` to a temporary folder; returns its final folder. It is
        published once the state is known good (``check_finite`` of the next step, or ``finish``) and, with async
        saving, its background write is done (at the next save or at the end)."""
        self._finalize_pending()
        started = time.perf_counter()
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"

        def start() -> None:
            remove_tree(tmp)  # a link standing there is removed, not written through
            (tmp / "rng").mkdir(parents=True)
            trainer_state = {"step": step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps,
                             "sampler": sampler.state_dict(), "world_size": self.runtime.world_size,
                             "layout": self.config.parallel.degrees(), "reason": reason,
                             "tokenizer": self.tokenizer}
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1), encoding="utf-8")
            (tmp / CONFIG_FILE).write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False), encoding="utf-8")

        self._on_every_rank(start, step, tmp, main_only=True)
        self._on_every_rank(lambda: torch.save(rng_state(), tmp / "rng" / f"rank_{self.runtime.rank:05d}.pt"),
                            step, tmp)
        state = sharded_state(model, optimizer)
        if self.policy.async_save:
            future = self._on_every_rank(lambda: async_save_sharded(state, tmp, self.async_group), step, tmp)
            written: list[float] = []  # when the background write ended (publication waits for the next save)
            future.add_done_callback(lambda _: written.append(time.perf_counter()))
            self._pending = _Save(future, step, tmp, started, time.perf_counter() - started, written)
        else:
            self._on_every_rank(lambda: save_sharded(state, tmp), step, tmp)
            self._pending = _Save(None, step, tmp, started, None)
        self.last_saved_step = step
        self._last_save_time = time.monotonic()
        return final

    def _discard_pending(self) -> None:
        """Drop the pending save: its state is not known good (waits for its write first)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            self._on_every_rank(pending.future.result, pending.step, pending.tmp)
        self._on_every_rank(lambda: remove_tree(pending.tmp), pending.step, pending.tmp,
                            main_only=True)
        self.last_saved_step = None
        self.say(f"checkpoint {step_dir_name(pending.step)} discarded: the state it holds gives non-finite values")

    def _finalize_pending(self) -> None:
        """Wait for the pending write on every rank, then publish it (manifest, rename, ``latest``, pruning);
        a save whose state was not confirmed good is discarded instead."""
        if self._pending is None:
            return
        if not self._pending.good:
            self._discard_pending()
            return
        pending, self._pending = self._pending, None
        step, tmp, started, blocked, written = (pending.step, pending.tmp, pending.started, pending.blocked,
                                                pending.written)
        def publish_it() -> int:
            manifest = write_manifest(tmp, {"step": step})
            final = self.root / step_dir_name(step)
            publish(tmp, final)
            write_text_atomic(self.root / LATEST, final.name + "\n")
            self._prune()
            return sum(entry["bytes"] for entry in manifest["files"].values())

        # every rank's write is done (an async one waited for) before rank 0 publishes
        self._on_every_rank(pending.future.result if pending.future is not None else lambda: None, step, tmp)
        size = self._on_every_rank(publish_it, step, tmp, main_only=True) or 0
        # an async save's time is its write's; publishing (manifest, rename) happens here and is small
        seconds = (written[0] if written else time.perf_counter()) - started
        blocked = seconds if blocked is None else blocked
        if self.auto is not None:
            self.auto.observe(blocked)
        self.saves.append({"step": step, "seconds": seconds, "blocked_s": blocked, "bytes": size})
        self.say(f"checkpoint {step_dir_name(step)}: {size / 1e6:.2f} MB in {seconds:.2f} s "
                 f"(training blocked {blocked:.2f} s)" + (f"; {self.auto.describe()}" if self.auto else ""))
        if self.log_metrics is not None:
            self.log_metrics(step, {"checkpoint/save_s": seconds, "checkpoint/blocked_s": blocked,
                                    "checkpoint/bytes": size})

    def _on_every_rank(self, action: Callable[[], Any], step: int, tmp: Path, main_only: bool = False) -> Any:
        """``action()`` on every rank (or rank 0), then one all-reduce so that all agree whether it worked (the
        barrier between a save's phases). A failed write (a full disk, say) removes the unpublished ``tmp`` and
        raises ``CheckpointWriteError`` on every rank; nothing published is touched."""
        result, error = None, None
        if not main_only or self.runtime.is_main:
            try:
                result = action()
            except (OSError, CheckpointException) as exc:
                error = exc
        failed = error is not None
        if self.runtime.distributed:
            flag = torch.tensor([int(failed)], device=self.runtime.device)  # NCCL: device tensors
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failed = bool(flag.item())
        if not failed:
            return result
        self._pending = None
        if self.runtime.is_main:
            remove_tree(tmp)
        elif error is not None:
            print(f"rank {self.runtime.rank}: checkpoint {step_dir_name(step)}: {_cause(error)}", file=sys.stderr)
        newest = published_checkpoints(self.root)
        raise CheckpointWriteError(
            f"checkpoint {step_dir_name(step)} could not be written to {self.root} ("
            + (_cause(error) if error is not None else "on another rank: see its message")
            + f"); the run stops. Nothing published was lost (newest: "
            f"{newest[0][1].name if newest else 'none'}). Free space there, or lower checkpoint.keep (now "
            f"{self.policy.keep}), then run again to resume", quiet=not self.runtime.is_main)

    def _prune(self) -> None:
        """Keep the newest ``checkpoint.keep`` published checkpoints; delete older ones and stray temporary folders."""
        for _, path in published_checkpoints(self.root)[self.policy.keep:]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob(f"{TMP_PREFIX}*"):
            remove_tree(stale)


def check_same_optimizer(path: Path, saved_config: dict, config: RunConfig) -> None:
    """Refuse, before any tensor is read, a checkpoint whose optimizer is not this run's: AdamW's moments and Muon's
    momentum buffers are different state, and DCP would fail with a bare missing-key traceback. Starting the other
    optimizer fresh from the weights is an explicit choice, so the message says how. A checkpoint from before
    ``train.optimizer`` existed was saved with AdamW."""
    saved = (saved_config.get("train") or {}).get("optimizer", "adamw")
    wanted = config.train.optimizer
    if saved != wanted:
        raise ConfigError(
            f"checkpoint {path} was saved with train.optimizer={saved}, but this run has train.optimizer={wanted}: "
            f"its optimizer state does not fit {wanted}'s. Resume with --set train.optimizer={saved}, or start "
            f"{wanted} with fresh optimizer state from these weights: python -m interop.export {path} FILE, then "
            "train.py --init-from FILE --resume none (in a new run directory)")
