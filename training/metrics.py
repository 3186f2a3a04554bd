"""Where a run's metrics go: ``metrics.jsonl`` and ``summary.json`` in the run directory, wandb, and TensorBoard.

Only rank 0 writes; other ranks build the logger with ``enabled=False`` and every method is a no-op,
so the training loop calls it unconditionally.

Key names are the caller's. The groups the training loop uses are:

- ``train/loss``, ``train/lm_loss``, ``train/aux_loss``, ``train/z_loss``, ``train/lr``, ``train/grad_norm``
- ``val/loss``
- ``perf/tokens_per_s``, ``perf/mfu``
- ``router/layer{i}/...``, e.g. ``router/layer0/load`` (a list: tokens per expert)

``metrics.jsonl`` holds one JSON object per :meth:`MetricsLogger.log` call, ``{"step": step, **metrics}``.
JSON has no NaN or infinity, and a diverging run is exactly when they matter, so non-finite floats are
written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (every line stays valid JSON that any parser
reads); :func:`read_metrics` turns them back into floats.

In wandb a list value under key ``k`` becomes one scalar per element under ``k/{j}``
(``router/layer0/load/3``), so wandb draws one line per expert. wandb drops records whose step is
lower than one already logged, so log steps in increasing order (several calls at one step are fine).

TensorBoard (``logging.tensorboard``, for a cluster or laptop where wandb is not wanted) gets the same
scalars, lists expanded the same way, as event files in ``run_dir/tensorboard``. A resumed run opens its
writer with ``purge_step`` at its first step, so TensorBoard drops what the crashed session logged after
the checkpoint, as ``rewind_logs`` does for metrics.jsonl.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import TracebackType
from typing import Any

from config.errors import ConfigError, UserError
from storage.files import atomic_output, open_own_file


class LogWriteError(UserError):
    """A run's log file could not be written (a full disk, say): the run stops, and says where and what to do."""

    def __init__(self, path: Path, step: int, error: OSError):
        super().__init__(f"cannot write {path} at step {step} ({error.strerror or error}); the run stopped. Free "
                         "space there and start the same command again: it resumes from the newest checkpoint and "
                         "rewinds the logs to it (without checkpoints, start over with --resume none)")

WANDB_MODES = ("offline", "online", "disabled")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
TENSORBOARD_DIR = "tensorboard"


def check_loggers(tensorboard: bool) -> None:
    """Refuse, before any work, a logger whose package is missing (``logging.tensorboard`` without tensorboard)."""
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard=true needs the tensorboard package, which is not installed: "
                          "pip install tensorboard (or the project's tensorboard extra), or set "
                          "logging.tensorboard=false")


def _plain(value: Any) -> Any:
    """A tensor, numpy scalar/array or tuple as Python numbers and lists (int stays int)."""
    if hasattr(value, "tolist"):  # torch.Tensor, numpy.ndarray, numpy scalars
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str)) or value is None:
        return value
    return float(value)


def _json_safe(value: Any) -> Any:
    """Non-finite floats as "nan"/"inf"/"-inf" so that the JSON stays valid."""
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    return value


def _wandb_scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    """Lists expanded to one key per element: ``{"k": [a, b]}`` -> ``{"k/0": a, "k/1": b}``."""
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, list):
            flat.update({f"{key}/{j}": element for j, element in enumerate(value)})
        else:
            flat[key] = value
    return flat


class MetricsLogger:
    """Appends metrics to ``run_dir/metrics.jsonl``, sends them to wandb unless its mode is "disabled", and to
    TensorBoard when ``tensorboard`` (``purge_step``: the first step of a resumed session)."""

    def __init__(
        self,
        run_dir: Path,
        config: dict,
        run_name: str,
        wandb_mode: str,
        wandb_project: str,
        enabled: bool = True,
        tensorboard: bool = False,
        purge_step: int | None = None,
    ) -> None:
        if wandb_mode not in WANDB_MODES:
            raise ValueError(
                f"logging.wandb={wandb_mode!r} is not a wandb mode; valid: {', '.join(WANDB_MODES)}"
            )
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._file = None
        self._run = None
        self._tensorboard = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open_own_file(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")  # closed in close()
        try:
            if wandb_mode != "disabled":
                self._run = self._start_wandb(config, run_name, wandb_mode, wandb_project)
            if tensorboard:
                check_loggers(tensorboard)
                from torch.utils.tensorboard import SummaryWriter  # a second to import: only when asked for

                self._tensorboard = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=purge_step)
        except Exception:
            self.close()
            raise

    def _start_wandb(self, config: dict, run_name: str, mode: str, project: str) -> Any:
        import wandb  # imported here: it takes about a second and disabled runs never need it

        settings = wandb.Settings(silent=True, console="off", save_code=False, init_timeout=60)
        try:
            return wandb.init(
                project=project,
                name=run_name,
                dir=str(self.run_dir),
                config=config,
                mode=mode,
                settings=settings,
                reinit="create_new",
            )
        except Exception as exc:
            raise ConfigError(
                f"wandb failed to start in logging.wandb={mode} mode ({type(exc).__name__}: {exc}); "
                "set logging.wandb=disabled (e.g. --set logging.wandb=disabled) to train without wandb"
            ) from exc

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append ``{"step": step, **metrics}`` to metrics.jsonl (flushed) and log it to wandb at ``step``."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"MetricsLogger.log(step={step}) after close() of {self.run_dir}")
        plain = {key: _plain(value) for key, value in metrics.items()}
        record = {"step": int(step), **plain}
        try:
            self._file.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as exc:  # a line cut short is skipped by read_metrics and dropped by the rewind at resume
            raise LogWriteError(self.run_dir / "metrics.jsonl", step, exc) from exc
        if self._run is not None:
            self._run.log(_wandb_scalars(plain), step=int(step))
        if self._tensorboard is not None:
            for key, value in _wandb_scalars(plain).items():
                if isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key, value, int(step))
            self._tensorboard.flush()  # a crash loses nothing logged, as metrics.jsonl's flush

    @property
    def destinations(self) -> dict[str, Path]:
        """Where this logger writes, by name, for the run's closing table (empty on other ranks)."""
        if not self.enabled:
            return {}
        found = {"metrics": self.run_dir / "metrics.jsonl", "summary": self.run_dir / "summary.json"}
        if self._tensorboard is not None:
            found["tensorboard"] = self.run_dir / TENSORBOARD_DIR
        if self._run is not None:
            found["wandb"] = Path(self._run.dir).parent
        return found

    @property
    def uses_wandb(self) -> bool:
        """Whether this logger sends to a wandb run (main rank, mode not "disabled")."""
        return self._run is not None

    def log_wandb(self, step: int, items: dict[str, Any]) -> None:
        """wandb-only values at ``step``: tables, charts and images, which have no place in metrics.jsonl."""
        if self._run is not None:
            self._run.log(items, step=int(step))

    def summary(self, metrics: dict[str, Any]) -> None:
        """Final values: ``run_dir/summary.json`` (replaced atomically) and the wandb run summary."""
        if not self.enabled:
            return
        plain = {key: _plain(value) for key, value in metrics.items()}
        text = json.dumps(_json_safe(plain), indent=2, allow_nan=False) + "\n"
        with atomic_output(self.run_dir / "summary.json", "w", encoding="utf-8", durable=False) as handle:
            handle.write(text)
        if self._run is not None:
            self._run.summary.update(_wandb_scalars(plain))

    def close(self) -> None:
        """Close metrics.jsonl and finish the wandb run; safe to call more than once."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_metrics(path: Path | str) -> list[dict]:
    """The records of a metrics.jsonl file, with "nan"/"inf"/"-inf" back as floats.

    A last line without its newline (a run killed mid-write) is skipped; any other bad line is an error.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # unterminated last line
                break
            raise ValueError(f"{path}:{number} is not a JSON object: {exc}") from exc
        records.append({key: _from_json(value) for key, value in record.items()})
    return records
