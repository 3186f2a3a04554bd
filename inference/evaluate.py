"""Loss, perplexity and bits per byte of a trained model on held-out text.

    moe-evaluate runs/moe-8x --text held_out.txt
    moe-evaluate runs/moe-8x --source /data/val.bin        # any source the data pipeline reads

The text is cut into windows of ``model.seq_len`` + 1 tokens that overlap by one token, so every token after
the first is predicted exactly once, from the tokens before it in its window (the last window may be shorter).
The loss is the mean cross-entropy in nats over those predictions; perplexity is its exponential; bits per byte
is the total in bits over the text's UTF-8 bytes, which compares models with different tokenizers (it is
reported for ``--text``, whose bytes are known). The model is the dropless inference model of
``inference.load_model``, so the figure does not depend on the batch size.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from config.cli import command_parser, run_command
from config.errors import ConfigError
from data.cache import load_tokens
from inference.load import load_model
from moe.transformer import MoETransformer


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
def evaluate_tokens(model: MoETransformer, tokens: np.ndarray, batch_size: int = 8,
                    text_bytes: int | None = None) -> Evaluation:
    """``model``'s loss on ``tokens`` [N] (see the module docstring), ``batch_size`` windows per forward pass."""
    seq_len = model.rope_cos.shape[0]
    if len(tokens) < 2:
        raise ConfigError(f"the text is {len(tokens)} token(s): at least 2 are needed, one to predict the next")
    device = model.tok_embeddings.weight.device
    spans = windows(len(tokens), seq_len)
    total, count = 0.0, 0
    by_length: dict[int, list[tuple[int, int]]] = {}
    for start, end in spans:  # only the last window may be shorter: it goes in a batch of its own
        by_length.setdefault(end - start, []).append((start, end))
    for length, group in by_length.items():
        for first in range(0, len(group), batch_size):
            batch = torch.as_tensor(np.stack([tokens[s:e] for s, e in group[first:first + batch_size]]).astype(
                np.int64), device=device)
            logits = model(batch[:, :-1])
            total += float(F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"))
            count += batch.shape[0] * (length - 1)
    loss = total / count
    bits_per_byte = None if text_bytes is None else total / math.log(2) / text_bytes
    return Evaluation(loss, math.exp(loss), count, bits_per_byte)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-evaluate", __doc__)
    parser.add_argument("model", help="a run directory, a checkpoint folder, a .safetensors export or hf:DIR")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", type=Path, help="a UTF-8 text file of held-out text")
    what.add_argument("--source", help="a data.source: a text file or folder, stdlib, or a tokenised .bin")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json or 'bytes' (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    parser.add_argument("--cache-dir", default=".cache/data", help="where --source is tokenised to (as data.cache_dir)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
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
        loaded = load_model(args.model, args.device, tokenizer=args.tokenizer)
        vocab = loaded.config.model.vocab_size
        if text is not None:
            if loaded.tokenizer is None:
                raise ConfigError(f"the model's tokenizer {loaded.config.data.tokenizer!r} (data.tokenizer) is not "
                                  "there; give it with --tokenizer PATH")
            tokens, text_bytes = loaded.tokenizer.encode(text), len(text.encode("utf-8"))
        else:
            tokens = load_tokens(args.source, args.cache_dir, vocab, args.tokenizer or loaded.config.data.tokenizer)
            text_bytes = None
        result = evaluate_tokens(loaded.model, np.asarray(tokens), args.batch_size, text_bytes)
        print(result.describe())
        print(f"model {loaded.source}", file=sys.stderr)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
