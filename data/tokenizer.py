"""Tokenizers: bytes (the default) or a Hugging Face ``tokenizer.json``, and training a BPE with no download.

    python -m data.tokenizer train --vocab-size 8192 --out .cache/tokenizers/stdlib-bpe-8192.json
    python train.py --config moe-8x-bpe          # data.tokenizer names that file

``data.tokenizer: bytes`` is one token per byte (vocab 256), nothing to download or train. Any other value is
the path of a ``tokenizer.json`` read with the ``tokenizers`` package (the format every Hugging Face model
ships). ``data/cache.py`` tokenises the corpus once with it into the memory-mapped cache, uint16 when every
id fits (vocabulary of at most 65,536) and uint32 otherwise; the cache's name hashes the tokenizer's identity
(the file's SHA-256 and the ``tokenizers`` version), so two tokenizers never share a cache.

``train`` fits a byte-level BPE (GPT-2's scheme: text as UTF-8 bytes mapped to 256 printable symbols, then
merges) on a corpus, the standard-library sources by default: about 10 s for 32 MB on 2 cores, and the same
file every time from the same corpus (read in a fixed order; a test trains twice and compares). Byte-level means
every text encodes with no unknown token, and decoding gives the text back.

Each document ends with ``data.document_end`` (``document_end``): by default (``auto``) a ``tokenizer.json``'s
end-of-text token (the first of ``EOS_TOKENS`` among its special added tokens: ``<|endoftext|>`` for GPT-2, Qwen and
GPT-OSS, ``</s>`` for Mistral and Llama 2, ``<|end_of_text|>`` for Llama 3 ...), as the model it came with was
trained; a tokenizer without one, and the byte tokenizer, end documents with the text ``"\\n\\n"``. Any other value
is the content of one of the tokenizer's added tokens (its id is appended) or else a text (encoded and appended).
``train.py`` writes the resolved value into the run's config.
"""

from __future__ import annotations

import codecs
import hashlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from config.cli import add_overwrite, check_outputs, command_parser, run_command
from config.errors import ConfigError
from config.tokenizer_identity import BYTES
from storage.files import write_text_atomic

DOCUMENT_SEPARATOR = "\n\n"  # the text that ends a document when the tokenizer has no end-of-text token
AUTO = "auto"
# End-of-text tokens of published tokenizers, in the order they are looked for among a tokenizer's special tokens.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]",
              "<\uff5cend\u2581of\u2581sentence\uff5c>")  # the last: DeepSeek-V3's


@dataclass(frozen=True)
class DocumentEnd:
    """What ends each document in the token stream: one token's id, or a text encoded after the document."""

    spec: str  # the resolved data.document_end: the token's content, or the text
    token_id: int | None = None  # the token's id; None: ``spec`` is text

    @property
    def legacy(self) -> bool:
        """The "\\n\\n" text every cache was built with before this was configurable (their names stay)."""
        return self.token_id is None and self.spec == DOCUMENT_SEPARATOR


def document_end(tokenizer: Tokenizer, spec: str = AUTO) -> DocumentEnd:
    """Resolve ``data.document_end`` against ``tokenizer`` (see the module docstring)."""
    added = tokenizer.added_tokens()
    if spec == AUTO:
        found = next((name for name in EOS_TOKENS if added.get(name, (None, False))[1]), None)
        return DocumentEnd(found, added[found][0]) if found else DocumentEnd(DOCUMENT_SEPARATOR)
    if spec in added:
        return DocumentEnd(spec, added[spec][0])
    return DocumentEnd(spec)

# the largest vocabulary a uint16 cache holds (ids 0..65535)
UINT16_VOCAB = 1 << 16
# A document is encoded whole up to this many characters; a longer one is cut into pieces of at most this
# many, each after its last newline (anywhere in a line longer than that), so memory stays bounded. The cuts
# depend on the text alone, not on how it was read, so the stream is the same on every run. Pieces go to the
# tokenizers library several at a time (encode_batch), which spreads them over every core.
MAX_PIECE_CHARS = 1 << 20
BATCH_CHARS = 1 << 22


class ByteTokenizer:
    """One token per byte of the UTF-8 text: vocabulary 256, uint16 cache (kept for the caches it has built)."""

    spec = BYTES
    identity = "bytes-v1"  # bump when byte tokenisation changes, so old caches are not mistaken for new ones
    label = ""  # nothing added to cache names: byte caches keep the names they have always had
    vocab_size = 256
    dtype = np.dtype(np.uint16)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(self.dtype)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")

    def added_tokens(self) -> dict[str, tuple[int, bool]]:
        return {}  # bytes only: every document end is text

    def stream(self, end: DocumentEnd = DocumentEnd(DOCUMENT_SEPARATOR)) -> ByteStream:
        return ByteStream(end)


class ByteStream:
    """Tokenises a corpus chunk by chunk: bytes in, tokens out at once (see ``HFStream`` for the protocol)."""

    def __init__(self, end: DocumentEnd):
        self.end = end.spec.encode("utf-8")

    def feed(self, chunk: bytes) -> np.ndarray:
        return np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16)

    def end_document(self) -> np.ndarray:
        return self.feed(self.end)

    def finish(self) -> np.ndarray:
        return np.empty(0, dtype=np.uint16)


class HFTokenizer:
    """A ``tokenizer.json`` (``tokenizers.Tokenizer``); ``vocab_size`` is its largest id + 1, added tokens too."""

    label = "hf"

    def __init__(self, path: Path, content: bytes):
        import tokenizers  # noqa: PLC0415 - only runs that name a tokenizer.json need the package loaded

        self.spec = str(path)
        self.content = content  # what workers rebuild it from (data/workers.py)
        try:
            self.tokenizer = tokenizers.Tokenizer.from_str(content.decode("utf-8"))
        except Exception as exc:  # the library raises bare Exceptions for any malformed file
            raise ValueError(f"data.tokenizer={str(path)!r}: not a valid tokenizer.json ({exc}); give a file that "
                             "tokenizers.Tokenizer.from_file reads, or 'bytes'") from exc
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise ValueError(f"data.tokenizer={str(path)!r}: the tokenizer has an empty vocabulary")
        self.vocab_size = max(ids) + 1
        self.dtype = np.dtype(np.uint16 if self.vocab_size <= UINT16_VOCAB else np.uint32)
        self.identity = f"hf-v1:{hashlib.sha256(content).hexdigest()}:tokenizers-{tokenizers.__version__}"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def added_tokens(self) -> dict[str, tuple[int, bool]]:
        """Each added token's content -> (id, whether it is special)."""
        return {token.content: (token_id, token.special)
                for token_id, token in self.tokenizer.get_added_tokens_decoder().items()}

    def stream(self, end: DocumentEnd = DocumentEnd(DOCUMENT_SEPARATOR)) -> HFStream:
        return HFStream(self, end)


class HFStream:
    """Tokenises a corpus chunk by chunk with a ``tokenizer.json``.

    ``feed`` takes a document's next bytes and ``end_document`` closes it (adding its end: a text end is encoded
    with the document's last piece, as it always was; a token's id follows the piece); each returns
    the tokens that are ready, possibly none; ``finish`` returns the rest. Bytes are decoded as UTF-8 (an
    undecodable byte becomes U+FFFD, as for the trainer) and cut as ``MAX_PIECE_CHARS`` says.
    """

    def __init__(self, tokenizer: HFTokenizer, end: DocumentEnd):
        self.tokenizer = tokenizer
        self.end = end
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""  # the open document's text after its last cut
        self.pieces: list[str | int] = []  # cut pieces waiting for a batch, and document-end token ids among them
        self.batched = 0  # characters in pieces

    def feed(self, chunk: bytes) -> np.ndarray:
        self.pending += self.decoder.decode(chunk)
        while len(self.pending) > MAX_PIECE_CHARS:
            cut = self.pending.rfind("\n", 0, MAX_PIECE_CHARS) + 1 or MAX_PIECE_CHARS
            self._add(self.pending[:cut])
            self.pending = self.pending[cut:]
        return self._encode() if self.batched >= BATCH_CHARS else self._empty()

    def end_document(self) -> np.ndarray:
        tail = self.pending + self.decoder.decode(b"", final=True)
        if self.end.token_id is None:
            self._add(tail + self.end.spec)
        else:
            if tail:
                self._add(tail)
            self.pieces.append(self.end.token_id)
        self.pending = ""
        self.decoder.reset()
        return self._encode() if self.batched >= BATCH_CHARS else self._empty()

    def finish(self) -> np.ndarray:
        return self._encode()

    def _add(self, piece: str) -> None:
        self.pieces.append(piece)
        self.batched += len(piece)

    def _encode(self) -> np.ndarray:
        texts = [piece for piece in self.pieces if isinstance(piece, str)]
        encoded = iter(self.tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else ())
        ids = (i for piece in self.pieces for i in ((piece,) if isinstance(piece, int) else next(encoded).ids))
        tokens = np.fromiter(ids, dtype=self.tokenizer.dtype)
        self.pieces, self.batched = [], 0
        return tokens

    def _empty(self) -> np.ndarray:
        return np.empty(0, dtype=self.tokenizer.dtype)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str, vocab_size: int | None = None, source: str = "stdlib") -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names; given ``vocab_size`` (``model.vocab_size``), it must cover the
    tokenizer's. A missing file's error gives the command that trains one (on ``source``, ``data.source``)."""
    if spec == BYTES:
        tokenizer = ByteTokenizer()
    else:
        path = Path(spec)
        if path.is_dir():  # training a tokenizer "to" it would fail, or write over the folder's files
            inside = path / "tokenizer.json"
            raise ValueError(f"data.tokenizer={spec!r} is a folder, not a tokenizer.json; give " + (
                f"the one in it: data.tokenizer={str(inside)!r}" if inside.is_file() else
                f"a tokenizer.json file (train one into it with `python -m data.tokenizer train --source {source} "
                f"--vocab-size {vocab_size or 8192} --out {inside}`)") + ", or use 'bytes'")
        if not path.is_file():
            wanted = vocab_size or 8192
            raise ValueError(
                f"data.tokenizer={spec!r}: no such file; train a BPE on this corpus with `python -m data."
                f"tokenizer train --source {source} --vocab-size {wanted} --out {spec}`, give another tokenizer.json, "
                "or use 'bytes'")
        try:
            content = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"data.tokenizer={spec!r}: cannot read it ({exc.strerror or exc})") from exc
        tokenizer = HFTokenizer(path, content)
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"data.tokenizer={spec!r} has a vocabulary of {tokenizer.vocab_size:,} ids, more than model.vocab_size="
            f"{vocab_size:,}; set model.vocab_size to at least {tokenizer.vocab_size:,} or use a smaller tokenizer")
    return tokenizer


def document_end_token(tokenizer_spec: str, document_end_spec: str, vocab_size: int | None = None) -> int:
    """The one token id that ends every document, where ``data.document_mask`` cuts a window into documents.

    An added token of a ``tokenizer.json``, or one byte for the byte tokenizer. A text end of a ``tokenizer.json``
    does not qualify: it is encoded together with the document's last text, so its tokens can merge with it.
    """
    tokenizer = load_tokenizer(tokenizer_spec, vocab_size)
    end = document_end(tokenizer, document_end_spec)
    if end.token_id is not None:
        return end.token_id
    encoded = end.spec.encode("utf-8")
    if isinstance(tokenizer, ByteTokenizer):
        if len(encoded) == 1:
            return encoded[0]
        what = f"{len(encoded)} bytes"
        fix = "one character that no document holds, such as \"\\x1e\" (ASCII's record separator)"
    else:
        what, fix = "a text, not one of its added tokens", "an added token (auto: its end-of-text token, if it has one)"
    raise ConfigError(f"data.document_mask=true cuts windows into documents at one end-of-document token, but "
                      f"data.document_end={end.spec!r} is {what} with data.tokenizer={tokenizer_spec!r}; set "
                      f"data.document_end to {fix}, or data.document_mask=false")


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` ids fitted on ``texts`` (the same texts in the
    same order give the same tokenizer). All 256 byte symbols are in the vocabulary whatever the texts hold."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    if vocab_size < 256:
        raise ValueError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least the 256 byte symbols")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def write_tokenizer(tokenizer, out: Path) -> None:
    """Save atomically: a run reading ``out`` never sees half a file (the same text ``Tokenizer.save`` writes)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, tokenizer.to_str(pretty=True))


def main(argv: list[str] | None = None) -> int:
    from data.corpus import document_texts, list_corpus  # noqa: PLC0415 - the CLI alone reads a corpus

    parser = command_parser("moe-tokenizer", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("train", help="fit a byte-level BPE on a corpus and write its tokenizer.json")
    fit.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary (at least 256)")
    fit.add_argument("--out", type=Path, required=True, help="the tokenizer.json to write")
    add_overwrite(fit)
    fit.add_argument("--source", default="stdlib",
                     help="the corpus, as data.source: 'stdlib', a file or folder of text, jsonl, json, parquet or "
                          "arrow files (.gz, .zst too)")
    fit.add_argument("--text-key", default="text", help="the field or column of records that holds the text, as "
                                                        "data.text_key")
    fit.add_argument("--skip", nargs="+", default=[], metavar="GLOB", help="files to leave out, as data.skip")
    args = parser.parse_args(argv)

    def fit_bpe() -> None:
        if args.vocab_size < 256:
            raise ConfigError(f"--vocab-size {args.vocab_size}: a byte-level BPE needs at least the 256 byte symbols")
        if not args.source.strip():  # an empty path would list the current directory
            raise ConfigError("--source is empty; give 'stdlib', a text file or a folder")
        if args.source.endswith(".bin"):
            raise ConfigError(f"--source {args.source}: a .bin is already tokenised; give the text it came from")
        if args.out.is_dir():
            raise ConfigError(f"--out {args.out} is a folder; give the path of the tokenizer.json to write (e.g. "
                              f"{args.out / 'tokenizer.json'})")
        check_outputs([args.out], [] if args.source == "stdlib" else [Path(args.source)], args.overwrite)
        tokenizer = train_bpe(document_texts(list_corpus(args.source, args.text_key, args.skip)), args.vocab_size)
        write_tokenizer(tokenizer, args.out)
        print(f"wrote {args.out} ({tokenizer.get_vocab_size()} ids, trained on {args.source})", file=sys.stderr)

    return run_command(fit_bpe)


if __name__ == "__main__":
    sys.exit(main())
