"""The run configuration: one YAML file per named config, plus ``--set key=value`` overrides.

Sections: ``model``, ``moe`` (``config/model.py``), ``parallel`` (``config/parallel.py``), ``data``, ``train``,
``logging``, ``checkpoint``. ``load_config("moe-8x", ["train.steps=50"])`` reads
``configs/moe-8x.yaml``, applies the overrides (CLI > file > dataclass defaults),
builds the typed tree and validates it, all before any process group or tensor exists.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from config.parallel import ParallelConfig
from config.schema import apply_override, from_dict, nearest, parse_yaml, require, to_dict

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class SourceConfig:
    """One source of a weighted mixture (``data.sources``): a corpus as ``data.source`` takes it, and its weight."""

    path: str = ""  # as data.source: "stdlib", a file or folder in any format taken, or a .bin
    weight: float = 1.0  # relative share of training samples (normalised over the sources)
    name: str = ""  # how logs and the realised mixture name it; default: the path's last component
    text_key: str | None = None  # this source's field or column; default data.text_key
    token_dtype: Literal["uint16", "uint32"] | None = None  # for a .bin path: its ids' dtype

    @property
    def label(self) -> str:
        return self.name or Path(self.path.rstrip("/")).name or self.path


def _same_corpus(a: str, b: str) -> bool:
    """Whether two ``data.source`` values name the same corpus (``stdlib``, or one path however it is written)."""
    return a == b or (a != "stdlib" and b != "stdlib" and os.path.realpath(a) == os.path.realpath(b))


@dataclass
class DataConfig:
    """Where the training text comes from and how it is split."""

    # "stdlib" (the running Python's standard-library sources); a file or folder of plain text, .jsonl, .json,
    # .parquet or datasets .arrow files, each optionally .gz or .zst (docs/data.md); or a pre-tokenised .bin
    source: str = "stdlib"
    text_key: str = "text"  # the field (jsonl, json) or column (parquet, arrow) that holds each record's text
    # glob patterns (matched against a file's path in the folder and its name) of files to leave out, listed at start;
    # any other file in no format taken is an error
    skip: list[str] = field(default_factory=list)
    token_dtype: Literal["uint16", "uint32"] | None = None  # the ids' dtype of a .bin source: stated, never guessed
    # a weighted mixture instead of data.source: [{path: ..., weight: ...}, ...] (docs/data.md)
    sources: list[SourceConfig] = field(default_factory=list)
    # named validation sets, each a whole corpus evaluated beside the split's and logged as val/<name>:
    # [{name: wiki, path: ...}, ...] (weight does not apply)
    validation: list[SourceConfig] = field(default_factory=list)
    workers: int = 1  # processes tokenising files in parallel when a cache is built (the same tokens whatever it is)
    val_fraction: float = 0.005  # held-out tail of the token stream used for validation
    cache_dir: str = ".cache/data"  # where tokenised corpora are memory-mapped from
    # "bytes" (one token per byte, vocab 256) or the path of a Hugging Face tokenizer.json (data/tokenizer.py)
    tokenizer: str = "bytes"
    # what ends each document: "auto" (the tokenizer.json's end-of-text token, e.g. <|endoftext|>; "\n\n" as text
    # for bytes or a tokenizer without one), an added token's content, or a text; the run's config holds it resolved
    document_end: str = "auto"
    # packed documents attend only within themselves, positions restarting at each (moe/documents.py); the
    # boundaries are read from data.document_end, which must then be one token (docs/data.md)
    document_mask: bool = False

    def corpora(self) -> list[SourceConfig]:
        """Every corpus the run reads, each with its own text key and dtype resolved: the sources of a mixture,
        or data.source as the one source of weight 1."""
        if not self.sources:
            return [SourceConfig(self.source, 1.0, self.source, self.text_key, self.token_dtype)]
        return [SourceConfig(s.path, s.weight, s.label, s.text_key or self.text_key, s.token_dtype)
                for s in self.sources]

    def validation_sets(self) -> list[SourceConfig]:
        """The named validation sets, each with its name, text key and dtype resolved."""
        return [SourceConfig(v.path, 1.0, v.label, v.text_key or self.text_key, v.token_dtype)
                for v in self.validation]

    def validate(self) -> None:
        require(0 < self.val_fraction < 0.5, f"data.val_fraction must be in (0, 0.5), got {self.val_fraction}")
        require(bool(self.source.strip()), "data.source is empty; use 'stdlib', a file or folder of text, "
                                            "jsonl, json, parquet or arrow files, or a .bin file")
        require(bool(self.tokenizer.strip()), "data.tokenizer is empty; use 'bytes' or a tokenizer.json path")
        require(bool(self.text_key), "data.text_key is empty; name the field or column that holds the text")
        require(bool(self.document_end), "data.document_end is empty; use 'auto', a token such as '<|endoftext|>', or "
                                         "a text such as '\\n\\n' (documents need a boundary)")
        require(all(isinstance(p, str) and p for p in self.skip), "data.skip: each pattern must be a non-empty glob")
        require((self.token_dtype is not None) == self.source.endswith(".bin"),
                 f"data.token_dtype={self.token_dtype!r} with data.source={self.source!r}: a pre-tokenised .bin source "
                 "needs its dtype stated (uint16 or uint32), and only a .bin takes one")
        require(not self.sources or self.source == "stdlib",
                 f"data.source={self.source!r} and data.sources: a mixture names every corpus in data.sources; leave "
                 "data.source out (or make it one of the sources)")
        labels = [source.label for source in self.sources]
        require(len(set(labels)) == len(labels),
                 f"data.sources: names {labels} repeat; give each source a distinct data.sources[].name")
        for source in self.sources:
            where = f"data.sources[{source.label}]"
            require(bool(source.path.strip()), f"{where}.path is empty; give a corpus as data.source takes it")
            require(source.weight > 0, f"{where}.weight={source.weight}: must be positive (leave out a source you "
                                       "do not want)")
            require((source.token_dtype is not None) == source.path.endswith(".bin"),
                     f"{where}.token_dtype={source.token_dtype!r} with path {source.path!r}: a .bin needs its dtype "
                     "stated (uint16 or uint32), and only a .bin takes one")
            require(self.tokenizer == "bytes" or not source.path.endswith(".bin"),
                     f"{where}: a .bin is already tokenised, so data.tokenizer={self.tokenizer!r} does not apply to it")
            require(source.text_key is None or bool(source.text_key), f"{where}.text_key is empty")
        require(1 <= self.workers <= 256, f"data.workers={self.workers}: must be in [1, 256]")
        names = [v.label for v in self.validation]
        require(len(set(names)) == len(names) and "loss" not in names,
                 f"data.validation: names {names} must differ, and none may be 'loss' (val/loss is the split's)")
        for validation in self.validation:
            where = f"data.validation[{validation.label}]"
            require(bool(validation.path.strip()), f"{where}.path is empty; give a corpus as data.source takes it")
            require(validation.weight == 1.0, f"{where}.weight={validation.weight}: a validation set has no weight; "
                                              "leave it out")
            require((validation.token_dtype is not None) == validation.path.endswith(".bin"),
                     f"{where}.token_dtype={validation.token_dtype!r} with path {validation.path!r}: a .bin needs its "
                     "dtype stated (uint16 or uint32), and only a .bin takes one")
            require(self.tokenizer == "bytes" or not validation.path.endswith(".bin"),
                     f"{where}: a .bin is already tokenised (by some tokenizer), so data.tokenizer={self.tokenizer!r} "
                     "does not say what its ids mean; give the text it came from")
            trained = next((c for c in self.corpora() if _same_corpus(c.path, validation.path)), None)
            require(trained is None, f"{where}.path={validation.path!r} is the training source "
                                     f"{trained.path if trained else ''!r}: its loss would be measured on text the "
                                     "model trains on; give held-out text (the training source's own held-out tail "
                                     "is val/loss, data.val_fraction)")
        require(not self.document_mask or not any(c.path.endswith(".bin")
                                                  for c in self.corpora() + self.validation_sets()),
                 "data.document_mask=true finds each document's end by its data.document_end token, which a "
                 "pre-tokenised .bin does not state; give the text it came from (tokenised with data.document_end), "
                 "or set data.document_mask=false")
        require(self.tokenizer == "bytes" or not self.source.endswith(".bin"),
                 f"data.tokenizer={self.tokenizer!r} with data.source={self.source!r}: a .bin is already tokenised, "
                 "so no tokenizer applies to it; give the text it came from, or leave data.tokenizer as 'bytes'")


@dataclass
class TrainConfig:
    """Optimisation: steps, batch, the optimizer (AdamW or Muon) with warmup + cosine decay, precision, evaluation."""

    steps: int = 300
    seed: int = 0
    global_batch_size: int = 16  # sequences per optimizer step, across all data-parallel ranks
    micro_batch_size: int | None = None  # sequences per forward pass on one rank; None = no accumulation
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30  # linear warmup; runs shorter than this warm up for all their steps
    weight_decay: float = 0.1  # decoupled (lr * weight_decay per step), on matrices only, under either optimizer
    # adamw, or muon: orthogonalised updates for hidden matrices and each routed expert, AdamW for embeddings,
    # output head, router, norms (docs/optimizers.md)
    optimizer: Literal["adamw", "muon"] = "adamw"
    beta1: float = 0.9  # AdamW's (under muon, for the parameters AdamW keeps)
    beta2: float = 0.95
    muon_momentum: float = 0.95  # Muon's momentum (an average: buf = m * buf + (1 - m) * grad)
    muon_nesterov: bool = True  # orthogonalise Nesterov's look-ahead (1 - m) * grad + m * buf rather than buf
    muon_ns_steps: int = 5  # Newton-Schulz iterations per orthogonalisation
    # RMS of each matrix's update per unit lr: the update is scaled by muon_update_rms * sqrt(max(A, B)); 0.2
    # matches AdamW's, so AdamW's lr and weight decay carry over (Liu et al. 2025, "Muon is Scalable for LLM Training")
    muon_update_rms: float = 0.2
    # the dtype Newton-Schulz iterates in: bf16 as torch.optim.Muon and Jordan et al. (fast on GPUs), or fp32 (as
    # exact as the layout's arithmetic: the parity tests prove the distributed Muon with it, docs/optimizers.md)
    muon_ns_dtype: Literal["bf16", "fp32"] = "bf16"
    # QK-clip (Kimi K2's MuonClip, docs/optimizers.md): after each optimizer step, every attention head whose largest
    # pre-softmax logit of the step exceeded this has its query and key weights scaled to bring that logit down to
    # it; under either optimizer. null = off; Kimi K2 trained with 100
    qk_clip_threshold: float | None = None
    grad_clip: float = 1.0  # global gradient-norm clip; 0 disables
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # where the run must compute: auto (a GPU when torch sees one, else the CPU) or cuda (a GPU config: refused
    # before any work on a machine without one)
    device: Literal["auto", "cuda"] = "auto"
    compile: bool = False  # torch.compile each transformer block (parallel/compile.py)
    eval_interval: int = 100  # steps between validation passes; 0 = only at the end
    eval_batches: int = 8  # micro-batches per validation pass
    # non-finite steps in a row (each skipped, weights untouched) before the run stops with a checkpoint
    max_bad_steps: int = 3
    # sparse attention (model.index_topk; DeepSeek-V4's compressed sparse layers): the first indexer_warmup_steps
    # steps are DeepSeek-V3.2's dense warm-up (attention dense, only the lightning indexers learn, every other weight
    # frozen), the rest the sparse stage
    # (training/indexer_stages.py); 0 = sparse from the first step (DeepSeek-V3.2: 1,000 warm-up steps)
    indexer_warmup_steps: int = 0

    def validate(self) -> None:
        require(self.steps >= 1, f"train.steps must be >= 1, got {self.steps}")
        require(self.global_batch_size >= 1, f"train.global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.micro_batch_size is not None:
            require(
                self.micro_batch_size >= 1 and self.global_batch_size % self.micro_batch_size == 0,
                f"train.micro_batch_size={self.micro_batch_size} must divide "
                f"train.global_batch_size={self.global_batch_size}",
            )
        require(self.lr > 0, f"train.lr must be positive, got {self.lr}")
        require(0 <= self.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
        require(self.weight_decay >= 0 and self.grad_clip >= 0, "train.weight_decay and train.grad_clip must be >= 0")
        require(0 <= self.muon_momentum < 1, f"train.muon_momentum={self.muon_momentum} must be in [0, 1)")
        require(1 <= self.muon_ns_steps <= 99, f"train.muon_ns_steps={self.muon_ns_steps} must be in [1, 99] "
                                                "(5 is Muon's usual count)")
        require(math.isfinite(self.muon_update_rms) and self.muon_update_rms > 0,
                 f"train.muon_update_rms={self.muon_update_rms} must be a positive finite number (0.2 matches "
                 "AdamW's update RMS)")
        require(self.qk_clip_threshold is None or (math.isfinite(self.qk_clip_threshold)
                                                   and self.qk_clip_threshold > 0),
                 f"train.qk_clip_threshold={self.qk_clip_threshold} must be a positive finite logit (Kimi K2 used "
                 "100), or null to turn QK-clip off")
        require(self.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {self.max_bad_steps}")
        require(self.indexer_warmup_steps >= 0,
                f"train.indexer_warmup_steps must be >= 0 (0: no dense warm-up), got {self.indexer_warmup_steps}")
        require(self.eval_interval >= 0 and self.eval_batches >= 1,
                 "train.eval_interval must be >= 0 and train.eval_batches >= 1")


@dataclass
class LoggingConfig:
    """What a person sees while the run trains, and where metrics go."""

    log_interval: int = 10  # steps between metric records (metrics.jsonl, wandb, plain lines)
    progress: Literal["auto", "bar", "lines"] = "auto"  # auto = a bar on a terminal, plain lines otherwise
    wandb: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "moe-toolkit"
    router_charts_every: int = 5  # log intervals between wandb expert-load charts (and the last); 0 = never
    # the same scalars as TensorBoard event files in run_dir/tensorboard (needs the tensorboard package)
    tensorboard: bool = False
    # PNGs of loss, throughput, peak memory per rank and routing imbalance in run_dir/plots at the end of the run
    # (needs matplotlib; without it the run says so once and writes none)
    plots: bool = True
    # a CPU run measures its live tensor peak on steps 1, 2, 4, 8, ... (training/live_memory.py; about 0.4 s a
    # measured step) and logs it as perf/memory_peak_gib; false: neither measured nor logged on a CPU (the tests'
    # short runs that do not read it). A GPU's peak costs nothing and is always logged.
    memory_peak: bool = True

    def validate(self) -> None:
        require(self.log_interval >= 1, f"logging.log_interval must be >= 1, got {self.log_interval}")
        require(self.router_charts_every >= 0,
                 f"logging.router_charts_every must be >= 0 (0 = no charts), got {self.router_charts_every}")


# Mean time between failures of the whole job when checkpoint.mtbf_hours is not set: about 3 h, what
# Llama 3 pre-training saw on up to 16K H100 (419 unexpected interruptions in 54 days, arXiv:2407.21783
# sec. 3.3.4; shared/REFERENCES.md 6.2). A large cluster's figure: set your own for a small job.
DEFAULT_MTBF_HOURS = 3.0


@dataclass
class CheckpointConfig:
    """When and how checkpoints are saved (``training/checkpointing.py``) into ``run_dir/dir``."""

    # steps between saves, "auto" (Young/Daly optimum from the measured save time and mtbf_hours), or null (no
    # periodic saves). auto by default because it is right at every scale from the same setting: a fixed step count
    # is too often for a laptop run (saves dominate) or too rare for a cluster job (hours lost per failure).
    interval: int | Literal["auto"] | None = "auto"
    interval_minutes: float | None = None  # wall-clock minutes between saves (with or instead of interval)
    keep: int = 3  # complete checkpoints kept; older ones are deleted after each save
    async_save: bool = False  # write in a background thread while training goes on (torch DCP async_save)
    mtbf_hours: float = DEFAULT_MTBF_HOURS  # mean time between failures of the job, for interval: auto
    dir: str = "checkpoints"  # relative to the run directory, or absolute
    # save the state after the last step, whatever the interval: every finished run leaves a model to export,
    # sample, evaluate or continue (false only for throwaway runs, e.g. benchmarks)
    final: bool = True

    @property
    def periodic(self) -> bool:
        """Whether the run saves during training (``interval`` or ``interval_minutes``)."""
        return self.interval is not None or self.interval_minutes is not None

    @property
    def enabled(self) -> bool:
        """Whether the run saves at all: periodically, at its end, or both."""
        return self.periodic or self.final

    def validate(self) -> None:
        require(self.interval is None or self.interval == "auto" or (isinstance(self.interval, int)
                                                                      and self.interval >= 1),
                 f"checkpoint.interval={self.interval!r} must be a number of steps >= 1, 'auto' or null")
        require(self.interval_minutes is None or self.interval_minutes > 0,
                 f"checkpoint.interval_minutes={self.interval_minutes} must be positive or null")
        require(self.keep >= 1, f"checkpoint.keep={self.keep} must be >= 1 (the newest checkpoint is always kept)")
        require(self.mtbf_hours > 0, f"checkpoint.mtbf_hours={self.mtbf_hours} must be positive")
        require(bool(self.dir), "checkpoint.dir must not be empty")


@dataclass
class RunConfig:
    """The whole configuration of one training run."""

    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> None:
        for section in (self.model, self.moe, self.parallel, self.data, self.train, self.logging, self.checkpoint):
            section.validate()
        require(
            self.model.vocab_size >= 256 or self.data.tokenizer != "bytes"
            or all(c.path.endswith(".bin") for c in self.data.corpora()),
            f"model.vocab_size={self.model.vocab_size} is below 256, too small for byte-level text",
        )
        require(not (self.train.compile and self.parallel.activation_offload != "none"),
                 "train.compile with parallel.activation_offload is not supported yet (its saved-tensor hooks would "
                 "split every compiled block); set one of them off")
        require(not self.train.indexer_warmup_steps or self.model.lightning_indexer,
                f"train.indexer_warmup_steps={self.train.indexer_warmup_steps} warms up sparse attention's indexer, "
                "but the model has none: set model.index_topk (with its index_n_heads and index_head_dim; with "
                "model.compressed_attention, compressed_sparse_attention layers) or 0")
        require(not (self.data.document_mask and self.model.mtp_depth),
                 f"data.document_mask=true with model.mtp_depth={self.model.mtp_depth}: the multi-token prediction "
                 "modules do not take the document mask yet; set model.mtp_depth=0 or data.document_mask=false")
        require(not (self.train.compile and self.parallel.pp > 1),
                 "train.compile with pipeline parallelism (parallel.pp > 1) is not supported yet; set one of them off")
        require(not ("shared" in (self.model.indexer_types or ()) and self.parallel.pp > 1),
                 f"model.indexer_types with 'shared' layers under parallel.pp={self.parallel.pp}: a shared layer "
                 "reads the selection its full layer left in the same process, and a stage's micro-batches "
                 "interleave; set parallel.pp=1 or every layer 'full'")
        require(self.train.qk_clip_threshold is None or not self.model.qk_norm,
                 f"train.qk_clip_threshold={self.train.qk_clip_threshold} with model.qk_norm=true: the per-head q/k "
                 "RMSNorm undoes any scaling of the query and key weights (and already bounds the logits), and its "
                 "gains are shared by all heads, so no head can be clipped alone; set one of them off")
        ep, replicas = self.parallel.ep, self.parallel.ep_replicas
        others = self.moe.num_experts - self.moe.num_experts // ep if ep >= 1 else replicas
        require(replicas <= others, f"parallel.ep_replicas={replicas} is more slots than the {others} experts other "
                                    f"ep ranks own (moe.num_experts={self.moe.num_experts}, parallel.ep={ep})")
        self._validate_linear_attention()
        self._validate_compressed_attention()
        require(self.moe.backend != "megablocks" or self.train.precision != "fp32",
                 "moe.backend=megablocks computes in bf16 only (grouped_gemm's kernels), but train.precision=fp32; "
                 "set train.precision=bf16 (or auto), or moe.backend=torch")

    def _validate_linear_attention(self) -> None:
        """What Gated DeltaNet layers (``model.layer_types``' linear_attention) do not take yet."""
        if not self.model.linear_attention:
            return
        refused = {"data.document_mask=true": self.data.document_mask,
                   "train.qk_clip_threshold": self.train.qk_clip_threshold is not None}
        for setting, given in refused.items():
            require(not given, f"{setting} is not implemented for linear attention (model.layer_types has "
                               "linear_attention layers) yet; turn it off")

    def _validate_compressed_attention(self) -> None:
        """What DeepSeek-V4's attention (``model.compressed_attention``) does not take yet."""
        if self.model.compressed_attention is None:
            return
        refused = {"data.document_mask=true": self.data.document_mask,
                   "train.qk_clip_threshold": self.train.qk_clip_threshold is not None}
        for setting, given in refused.items():
            require(not given, f"{setting} is not implemented for DeepSeek-V4's attention (model.compressed_attention"
                               ") yet; turn it off")

    def to_dict(self) -> dict:
        return to_dict(self)


def resolve_config_path(name_or_path: str) -> Path:
    """``moe-8x`` -> ``configs/moe-8x.yaml``; an existing path is taken as it is."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file '{path}' " + ("is a folder; give a YAML file or a config name"
                                                          if path.is_dir() else "does not exist"))
        return path
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    names = [p.stem for p in CONFIG_DIR.glob("*.yaml")]
    raise ConfigError(f"no config named '{name_or_path}': {nearest(name_or_path, names)}")


def config_from_dict(tree: dict) -> RunConfig:
    """Build and validate a config from a resolved tree (e.g. the ``config.yaml`` a checkpoint carries)."""
    config = from_dict(RunConfig, tree)
    config.validate()
    return config


def load_config(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a named config or YAML path, apply overrides, build and validate the typed tree."""
    path = resolve_config_path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {exc.start}): save it as UTF-8") from exc
    tree = parse_yaml(text, f"config file '{path}'") or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections")
    tree = copy.deepcopy(tree)
    tree.setdefault("name", path.stem)
    for assignment in overrides:
        apply_override(tree, assignment)
    return config_from_dict(tree)
