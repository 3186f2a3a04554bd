"""Prepare a run's token caches ahead of it, on a CPU box: every source of the config, tokenised and checked.

    python -m data.prepare --config moe-8x-bpe --set data.source=/data/shards data.workers=8
    moe-prepare --config my-run            # the same, as a console script

It does what a run's start does with its data, the training sources and ``data.validation``'s sets
(``data/cache.py``: list, check formats, tokenise into ``data.cache_dir``, check token ids against
``model.vocab_size`` and each split against ``model.seq_len``), and nothing else: a run on the same config then
maps the caches at once. An interrupted preparation resumes where it
left off (from its last checkpoint); several at once build each cache once (``data/build.py``).
"""

from __future__ import annotations

import sys
import time

from config.cli import add_config_arguments, command_parser, load_config_from, run_command
from data.cache import check_source, load_tokens
from data.sampler import split_tokens


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-prepare", __doc__)
    add_config_arguments(parser)
    args = parser.parse_args(argv)

    def prepare() -> None:
        config = load_config_from(args)
        data = config.data
        training = data.corpora()
        for corpus in training + data.validation_sets():
            skipped, end = check_source(corpus.path, data.tokenizer, config.model.vocab_size, corpus.text_key,
                                        data.skip, data.document_end)
            if skipped:
                print(skipped, file=sys.stderr)
            start = time.perf_counter()
            tokens = load_tokens(corpus.path, data.cache_dir, config.model.vocab_size, data.tokenizer,
                                 corpus.text_key, data.skip, corpus.token_dtype, end, data.workers)
            if corpus in training:  # a named validation set is used whole
                split_tokens(tokens, data.val_fraction, config.model.seq_len,
                             f"data.sources[{corpus.name}] ({corpus.path})" if data.sources else None)
            print(f"{corpus.name}: {len(tokens):,} tokens ({tokens.dtype}) in {tokens.filename} "
                  f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)

    return run_command(prepare)


if __name__ == "__main__":
    sys.exit(main())
