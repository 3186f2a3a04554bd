"""Corpus file formats: which format a file is in, and its documents read one at a time.

A file's format comes from its name, never from a guess at its content: ``.jsonl``/``.ndjson`` (one JSON record
per line), ``.json`` (one JSON array of records), ``.parquet`` (read with ``pyarrow``, one column), ``.arrow`` (the
Arrow IPC stream files a Hugging Face ``datasets`` folder written by ``save_to_disk`` holds), each optionally
compressed as ``.gz`` or ``.zst``, and plain text for any other name (which must then look like text: a NUL byte
in its first 8 KiB means it is not). Records give their text from one field or column, ``data.text_key``.

Every document is streamed: a jsonl file line by line, parquet and arrow a batch of rows at a time, text in
chunks, so memory stays bounded whatever the file's size (a ``.json`` array alone is parsed whole: use jsonl for
large files). A malformed record is a ``ValueError`` naming the file and the line (jsonl), record (json) or row
(parquet, arrow), and what would be valid; nothing is skipped without a word.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

CHUNK_BYTES = 1 << 24
# A file with a NUL byte this early is almost surely not text (the heuristic git and grep use).
BINARY_SNIFF_BYTES = 8192
ROWS_PER_BATCH = 1024  # parquet/arrow rows read at once: bounded memory for any file

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
STRUCTURED = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
# Names that say "not text" and are not a format taken here: refused by name rather than read as text.
UNSUPPORTED = (".bz2", ".xz", ".lz4", ".lzma", ".zip", ".tar", ".tgz", ".7z", ".rar", ".npy", ".npz", ".pt", ".pkl",
               ".safetensors", ".feather", ".orc", ".avro")
FORMATS_TAKEN = ("plain text, .jsonl/.ndjson (data.text_key of each record), .json (an array of records), .parquet "
                 "(the data.text_key column), a datasets save_to_disk folder (.arrow), each optionally .gz or .zst; "
                 "a pre-tokenised .bin with data.token_dtype, as a source of its own")


def format_of(name: str) -> tuple[str, str | None]:
    """``(kind, compression)`` of a file name: kind is ``text``, ``jsonl``, ``json``, ``parquet``, ``arrow``,
    ``bin`` or ``unsupported``; compression is ``gzip``, ``zstd`` or None."""
    lower = name.lower()
    if lower.endswith(UNSUPPORTED):
        return "unsupported", None
    compression = None
    for suffix, method in COMPRESSIONS.items():
        if lower.endswith(suffix):
            compression, lower = method, lower[: -len(suffix)]
            break
    if lower.endswith(".bin"):
        return ("bin" if compression is None else "unsupported"), compression
    for suffix, kind in STRUCTURED.items():
        if lower.endswith(suffix):
            return kind, compression
    return "text", compression


@contextmanager
def open_decompressed(path: Path, compression: str | None, raw: BinaryIO | None = None) -> Iterator[BinaryIO]:
    """``path`` (or its already open ``raw`` handle) as a stream of its decompressed bytes."""
    own = raw is None
    raw = open(path, "rb") if own else raw  # noqa: SIM115 - closed below
    try:
        if compression == "gzip":
            yield gzip.GzipFile(fileobj=raw, mode="rb")
        elif compression == "zstd":
            import zstandard  # noqa: PLC0415 - only zstd corpora need it

            yield io.BufferedReader(_ZstdFrames(raw, zstandard), 1 << 20)  # buffered: jsonl needs readline
        else:
            yield raw
    finally:
        if own:
            raw.close()


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a zstd stream, its frames one after another. A stream that ends inside a frame (a
    file cut short by a copy or a download) raises ``zstandard.ZstdError``: ``zstandard``'s own ``stream_reader``
    ends there without a word, so a truncated corpus trained on the part that decompressed."""

    READ_BYTES = 1 << 16  # compressed bytes fed at a time: a frame's output per call stays bounded

    def __init__(self, raw: BinaryIO, zstandard):
        self.raw, self.zstandard = raw, zstandard
        self.frame = zstandard.ZstdDecompressor().decompressobj()
        self.in_frame = False  # bytes of an unfinished frame were fed
        self.pending, self.leftover = memoryview(b""), b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            data, self.leftover = self.leftover or self.raw.read(self.READ_BYTES), b""
            if not data:
                if self.in_frame:
                    raise self.zstandard.ZstdError("the data ends inside a frame (the file was cut short)")
                return 0
            self.in_frame = True
            self.pending = memoryview(self.frame.decompress(data))
            if self.frame.eof:  # the frame is whole; what follows it starts the next
                self.leftover, self.in_frame = self.frame.unused_data, False
                self.frame = self.zstandard.ZstdDecompressor().decompressobj()
        count = min(len(buffer), len(self.pending))
        buffer[:count], self.pending = self.pending[:count], self.pending[count:]
        return count


def looks_binary(first_chunk: bytes) -> bool:
    """A NUL byte in the first ``BINARY_SNIFF_BYTES``: almost surely not text."""
    return b"\0" in first_chunk[:BINARY_SNIFF_BYTES]


def sniff_text(path: Path, compression: str | None) -> bool:
    """Whether a file taken as plain text looks like text (its decompressed first 8 KiB hold no NUL byte)."""
    with _decompression_errors(path, compression), open_decompressed(path, compression) as stream:
        return not looks_binary(stream.read(BINARY_SNIFF_BYTES))


def read_documents(path: Path, kind: str, compression: str | None, text_key: str,
                   raw: BinaryIO | None = None) -> Iterator[Iterator[bytes]]:
    """The documents of one file, in order, each as an iterator of UTF-8 byte chunks (a text file is one document;
    each record of the others is one). ``raw``: the file already opened (the cache checks its signature first)."""
    with _decompression_errors(path, compression), open_decompressed(path, compression, raw) as stream:
        if kind == "text":
            yield _chunks(stream, path, compression)
        elif kind == "jsonl":
            yield from _jsonl(path, stream, text_key)
        elif kind == "json":
            yield from _json_array(path, stream, text_key)
        elif kind == "parquet":
            yield from _parquet(path, stream, compression, text_key)
        elif kind == "arrow":
            yield from _arrow(path, stream, text_key)
        else:
            raise ValueError(f"data.source: {path} is not a format taken here; formats taken: {FORMATS_TAKEN}")


def _chunks(stream: BinaryIO, path: Path, compression: str | None) -> Iterator[bytes]:
    with _decompression_errors(path, compression):  # read in the caller's frame, so wrapped here too
        while chunk := stream.read(CHUNK_BYTES):
            yield chunk


def _text_of(record: object, path: Path, where: str, text_key: str) -> bytes:
    if not isinstance(record, dict):
        raise ValueError(f"data.source: {path}, {where}: a {type(record).__name__}, not a record (an object with a "
                         f"{text_key!r} field)")
    if text_key not in record:
        keys = ", ".join(map(repr, list(record)[:10])) or "none"
        raise ValueError(f"data.source: {path}, {where}: no {text_key!r} field (its fields: {keys}); set "
                         "data.text_key to the field that holds the text")
    text = record[text_key]
    if not isinstance(text, str):
        raise ValueError(f"data.source: {path}, {where}: field {text_key!r} is a {type(text).__name__}, not text")
    return text.encode("utf-8", errors="surrogatepass")


def _jsonl(path: Path, stream: BinaryIO, text_key: str) -> Iterator[Iterator[bytes]]:
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue  # a blank line holds no record (many writers end with one)
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"data.source: {path}, line {number}: not UTF-8 (byte {exc.start} of the line); "
                             "re-encode the file as UTF-8") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"data.source: {path}, line {number}: not a JSON record ({exc.msg} at column "
                             f"{exc.colno}); each line of a .jsonl file must be one JSON object") from exc
        yield iter((_text_of(record, path, f"line {number}", text_key),))


def _json_array(path: Path, stream: BinaryIO, text_key: str) -> Iterator[Iterator[bytes]]:
    try:
        records = json.loads(stream.read().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"data.source: {path}: not UTF-8 (byte {exc.start}); re-encode the file as UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"data.source: {path}: not valid JSON ({exc.msg} at line {exc.lineno}, column "
                         f"{exc.colno}); a .json file must be one array of records (or use .jsonl)") from exc
    if not isinstance(records, list):
        raise ValueError(f"data.source: {path}: a JSON {type(records).__name__}, not an array of records; a .json "
                         "file must be one array of records (or use .jsonl, one record per line)")
    for number, record in enumerate(records):
        yield iter((_text_of(record, path, f"record {number}", text_key),))


def _column_texts(path: Path, batches, text_key: str, columns: list[str]) -> Iterator[Iterator[bytes]]:
    """Each row's ``text_key`` value from record batches (pyarrow), numbered from 0 across the file."""
    import pyarrow as pa  # noqa: PLC0415 - only parquet/arrow corpora need it

    if text_key not in columns:
        raise ValueError(f"data.source: {path}: no column {text_key!r} (its columns: {', '.join(columns)}); set "
                         "data.text_key to the column that holds the text")
    row = 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(text_key))
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise ValueError(f"data.source: {path}: column {text_key!r} holds {column.type}, not text (string)")
        for value in column.to_pylist():
            if value is None:
                raise ValueError(f"data.source: {path}, row {row}: column {text_key!r} is null; fill or drop "
                                 "the row")
            yield iter((value.encode("utf-8", errors="surrogatepass"),))
            row += 1


def _parquet(path: Path, stream: BinaryIO, compression: str | None, text_key: str) -> Iterator[Iterator[bytes]]:
    import pyarrow.parquet as pq  # noqa: PLC0415

    with tempfile.TemporaryFile() as spooled:
        if compression is not None:  # parquet is read by seeking: a compressed one is spooled to disk first
            shutil.copyfileobj(stream, spooled, CHUNK_BYTES)
            spooled.seek(0)
            stream = spooled
        try:
            table = pq.ParquetFile(stream)
        except Exception as exc:  # pyarrow raises ArrowInvalid (and others) for a file that is not parquet
            raise ValueError(f"data.source: {path}: not a readable parquet file ({exc})") from exc
        columns = table.schema_arrow.names
        batches = table.iter_batches(batch_size=ROWS_PER_BATCH, columns=[text_key] if text_key in columns else [])
        yield from _column_texts(path, batches, text_key, columns)


def _arrow(path: Path, stream: BinaryIO, text_key: str) -> Iterator[Iterator[bytes]]:
    import pyarrow as pa  # noqa: PLC0415

    try:
        reader = pa.ipc.open_stream(pa.PythonFile(stream, mode="r"))
    except Exception as stream_error:  # ArrowInvalid: not an Arrow IPC stream; maybe the random-access file format
        try:
            stream.seek(0)
            file_reader = pa.ipc.open_file(pa.PythonFile(stream, mode="r"))
        except Exception as exc:
            raise ValueError(f"data.source: {path}: not an Arrow IPC stream (what datasets' save_to_disk writes) "
                             f"or file ({stream_error})") from exc
        batches = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
        yield from _column_texts(path, batches, text_key, file_reader.schema.names)
        return
    yield from _column_texts(path, reader, text_key, reader.schema.names)


@contextmanager
def _decompression_errors(path: Path, compression: str | None) -> Iterator[None]:
    """A damaged compressed file is a ValueError naming it, not a library's bare exception."""
    errors: tuple[type[BaseException], ...] = (EOFError, zlib.error, gzip.BadGzipFile)
    if compression == "zstd":
        import zstandard  # noqa: PLC0415

        errors = (*errors, zstandard.ZstdError)
    try:
        yield
    except errors as exc:
        raise ValueError(f"data.source: {path}: not valid {compression} data ({exc}); re-compress it or leave it "
                         "out") from exc
