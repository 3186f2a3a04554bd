"""Loss, perplexity and bits per byte of a trained model on held-out text.

    moe-evaluate runs/moe-8x --text held_out.txt
    moe-evaluate runs/moe-8x --source /data/val.bin        # any source the data pipeline reads
    torchrun --nproc-per-node 4 -m inference.evaluate runs/moe-8x --text held_out.txt --set parallel.ep=4

The text is cut into windows of ``model.seq_len`` + 1 tokens that overlap by one token, so every token after
the first is predicted exactly once, from the tokens before it in its window (the last window may be shorter).
The loss is the mean cross-entropy in nats over those predictions; perplexity is its exponential; bits per byte
is the total in bits over the text's UTF-8 bytes, which compares models with different tokenizers (it is
reported for ``--text``, whose bytes are known). The model is the dropless inference model of
``inference.load_model``, so the figure does not depend on the batch size, nor on the layout it runs under
(``inference/parallel_eval.py``).
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from config.cli import command_parser, run_command
from config.errors import ConfigError
from config.run import RunConfig
from data.cache import load_tokens
from data.tokenizer import Tokenizer
from inference.load import inference_config, load_model, model_tokenizer, weights_of
from inference.parallel_eval import batch_tensor, dealt_rows, evaluate_under_layout, layout_config
from moe.transformer import MoETransformer
from parallel.runtime import launch_environment
from parallel.tensor import IGNORED, lm_loss, loss_context


@dataclass
class Evaluation:
    loss: float  # mean cross-entropy per predicted token, nats
    perplexity: float
    predicted_tokens: int
    bits_per_byte: float | None  # None when the text's bytes are unknown (a tokenised .bin)

    def describe(self) -> str:
        bpb = "" if self.bits_per_byte is None else f", {self.bits_per_byte:.4f} bits per byte"
        return (f"loss {self.loss:.4f} nats per token, perplexity {self.perplexity:.3f}{bpb} "
                f"({self.predicted_tokens:,} predicted tokens)")


def windows(count: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, end) of each window over ``count`` tokens: ``seq_len`` + 1 long, consecutive ones sharing a token."""
    return [(start, min(start + seq_len + 1, count)) for start in range(0, count - 1, seq_len)]


@torch.no_grad()
def evaluate_tokens(model: MoETransformer, tokens: np.ndarray, batch_size: int = 8, text_bytes: int | None = None,
                    dp_rank: int = 0, dp_size: int = 1, dp_group: dist.ProcessGroup | None = None,
                    vocab_parallel: bool = False) -> Evaluation:
    """``model``'s loss on ``tokens`` [N] (see the module docstring), ``batch_size`` windows per forward pass.

    Under a parallel layout (``inference/parallel_eval.py``) each batch's windows are dealt out over the
    ``dp_size`` data-parallel ranks and the sums added over ``dp_group`` (with context parallelism the ranks holding
    the windows' other positions too): the same windows, the same figure."""
    seq_len = model.rope_cos.shape[0]
    if len(tokens) < 2:
        raise ConfigError(f"the text is {len(tokens)} token(s): at least 2 are needed, one to predict the next")
    device = model.tok_embeddings.weight.device
    sums = torch.zeros(2, dtype=torch.float64)  # summed loss in nats, predicted tokens
    by_length: dict[int, list[tuple[int, int]]] = {}
    for start, end in windows(len(tokens), seq_len):  # only the last window may be shorter: a batch of its own
        by_length.setdefault(end - start, []).append((start, end))
    shards = model.sequence_shards  # under context parallelism this rank's positions of each window
    for group in by_length.values():
        for first in range(0, len(group), batch_size):
            rows, counted = dealt_rows(group[first:first + batch_size], dp_rank, dp_size)
            batch = batch_tensor(tokens, rows, device)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            if shards is not None:  # whole chunks for every rank: a shorter window's tail padded, its targets ignored
                pad = -inputs.shape[1] % (2 * shards.cp)  # (causal: the padding comes after every real position)
                inputs, targets = F.pad(inputs, (0, pad)), F.pad(targets, (0, pad), value=IGNORED)
                inputs, targets = shards.shard(inputs), shards.shard(targets)
            with loss_context(vocab_parallel):
                loss = lm_loss(model(inputs).float(), targets, reduction="sum")
            if counted:
                predicted = int((targets != IGNORED).sum())
                sums += torch.tensor([float(loss), predicted], dtype=torch.float64)
    if dp_group is not None:
        dist.all_reduce(sums, group=dp_group)
    total, count = float(sums[0]), int(sums[1])
    loss = total / count
    bits_per_byte = None if text_bytes is None else total / math.log(2) / text_bytes
    return Evaluation(loss, math.exp(loss), count, bits_per_byte)


# the data keys a --source is read with, and the flags moe-evaluate takes them as: the data pipeline's messages name
# the keys (they are train.py's), and this command's say its own flags instead
SOURCE_FLAGS = {"data.source": "--source", "data.text_key": "--text-key", "data.skip": "--skip",
                "data.token_dtype": "--token-dtype", "data.cache_dir": "--cache-dir"}


def _source_tokens(args, config: RunConfig) -> np.ndarray:
    """The tokens of ``--source``, read as ``data.source`` is, with this command's flags for the data keys."""
    try:
        return np.asarray(load_tokens(args.source, args.cache_dir, config.model.vocab_size,
                                      args.tokenizer or config.data.tokenizer, args.text_key, args.skip,
                                      args.token_dtype))
    except ValueError as exc:
        message = str(exc)
        for key, flag in SOURCE_FLAGS.items():
            message = re.sub(rf"\b{re.escape(key)}\b", flag, message)
        raise ConfigError(message) from exc


def _tokens(args, text: str | None, config: RunConfig, tokenizer: Tokenizer | None) -> tuple[np.ndarray, int | None]:
    """The token ids to evaluate on, and the text's UTF-8 bytes (None for a --source)."""
    if text is None:
        return _source_tokens(args, config), None
    if tokenizer is None:
        raise ConfigError(f"the model's tokenizer {config.data.tokenizer!r} (data.tokenizer) is not there; give it "
                          "with --tokenizer PATH")
    return np.asarray(tokenizer.encode(text)), len(text.encode("utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-evaluate", __doc__)
    parser.add_argument("model", help="a run directory, a checkpoint folder, a .safetensors export or hf:DIR")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", type=Path, help="a UTF-8 text file of held-out text")
    what.add_argument("--source", help="a data.source: a text file or folder, stdlib, or a tokenised .bin")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json or 'bytes' (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    parser.add_argument("--cache-dir", default=".cache/data", help="where --source is tokenised to (as data.cache_dir)")
    parser.add_argument("--text-key", default="text", help="the field of --source's records that holds the text "
                                                           "(as data.text_key)")
    parser.add_argument("--skip", nargs="+", default=[], metavar="GLOB",
                        help="files of a --source folder to leave out (as data.skip)")
    parser.add_argument("--token-dtype", choices=("uint16", "uint32"), default=None,
                        help="the dtype a --source .bin's ids were written in (as data.token_dtype)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (one process; under torchrun each "
                                                        "rank takes its own device)")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="parallel.KEY=V",
                        help="the layout to evaluate under, under torchrun (e.g. parallel.ep=2): each rank holds "
                             "and reads only its shards; the figure is one process's")
    args = parser.parse_args(argv)

    def body() -> None:
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
        text = None
        if args.text is not None:
            try:
                text = args.text.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{args.text}: not UTF-8 text (byte {exc.start}); give --source for other data") \
                    from exc
        world_size = launch_environment().world_size
        if world_size == 1 and not args.overrides:
            loaded = load_model(args.model, args.device, tokenizer=args.tokenizer)
            tokens, text_bytes = _tokens(args, text, loaded.config, loaded.tokenizer)
            result = evaluate_tokens(loaded.model, tokens, args.batch_size, text_bytes)
            source = loaded.source
        else:  # every check and all the data before the job is joined
            source, config, fill, trained_with = weights_of(args.model)
            config, resolved = layout_config(inference_config(config), args.overrides, world_size)
            tokenizer = model_tokenizer(config, args.tokenizer, trained_with, str(source))
            tokens, text_bytes = _tokens(args, text, config, tokenizer)
            result = evaluate_under_layout(config, resolved, fill, lambda model, *dp: evaluate_tokens(
                model, tokens, args.batch_size, text_bytes, *dp))
            if result is None:  # not rank 0: it said nothing
                return
        print(result.describe())
        print(f"model {source}", file=sys.stderr)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
