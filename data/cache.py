"""The token cache: a corpus tokenised once, then memory-mapped by every run and rank that reads it.

Every machine can train with no download: the default corpus is the running Python's own standard
library sources (``data/corpus.py``), tokenised one byte per token (vocab 256) or with a
``tokenizer.json`` (``data.tokenizer``, ``data/tokenizer.py``). A corpus is tokenised once into a raw
uint16 (or, for a vocabulary over 65,536, uint32) file in ``data.cache_dir`` and memory-mapped from then on,
so start-up is instant and every rank of a job shares one page cache instead of holding its own copy.
The cache is keyed on the content it was built from; ``data/sampler.py`` cuts the stream into batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from data.build import Progress, build_lock
from data.corpus import VALID_SOURCES, Document, list_corpus, signature, skipped_message, unreadable
from data.formats import CHUNK_BYTES, read_documents
from data.tokenizer import AUTO, BYTES, DocumentEnd, Tokenizer, document_end, load_tokenizer
from data.workers import in_workers as _in_workers
from storage.files import atomic_output, sha256_file

TOKEN_DTYPES = ("uint16", "uint32")

# Files changed this recently before a cache build are re-hashed on later starts (see _write_tokens).
RACY_SECONDS = 2.0
# An interrupted build resumes from its last checkpoint, taken at a file boundary at most this often.
CHECKPOINT_SECONDS = 30.0


def load_tokens(source: str, cache_dir: str | Path, vocab_size: int | None = None, tokenizer: str = BYTES,
                text_key: str = "text", skip: tuple[str, ...] | list[str] = (),
                token_dtype: str | None = None, document_end_spec: str = AUTO, workers: int = 1) -> np.memmap:
    """The whole token stream of ``data.source`` as a read-only memmap, shape ``[tokens]``.

    ``"stdlib"`` and text files/folders are tokenised once with ``tokenizer`` (``data.tokenizer``: ``bytes``
    or a ``tokenizer.json``, whose vocabulary must fit ``vocab_size``, checked first) into ``cache_dir``; the
    cache file is named by a hash of what went into it: the tokenizer's identity, the root, and every file's
    relative path, size, modification and status-change times. Writing a file always moves its status-change
    time (``st_ctime``, which no tool can set back, unlike the modification time), so an edited, replaced,
    added or removed file gives a new key and the corpus is re-tokenised rather than served stale. A file that
    cannot be read is an error naming it, never a silent gap. Files are read in the format their names say
    (``data/formats.py``), records giving their ``text_key`` field; ``skip`` are ``data.skip``'s glob patterns.
    ``workers``: processes that tokenise files in parallel (``data.workers``; the same stream).
    Each document ends with ``document_end_spec`` (``data.document_end``, resolved by ``data.tokenizer.document_end``),
    which is part of the cache's key unless it is the ``"\\n\\n"`` text every older cache ends documents with.
    A ``.bin`` is taken as already tokenised, in ``token_dtype`` (``data.token_dtype``: uint16 or uint32, stated
    because a file's bytes cannot say which), and mapped as is; given ``vocab_size``, its largest token id is
    checked against it when it is opened (an id ``>= vocab_size`` would otherwise be an ``IndexError`` at
    whichever step first samples it), scanning the file once: the largest id is cached in ``cache_dir`` under
    the file's identity (path, size, modification and status-change times).
    """
    if source.endswith(".bin"):
        if token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"data.source={source!r} is pre-tokenised, but data.token_dtype={token_dtype!r}; state "
                             f"the dtype its ids were written in: {' or '.join(TOKEN_DTYPES)}")
        tokens = _map_tokens(Path(source), source, np.dtype(token_dtype))
        if vocab_size is not None:
            largest = _largest_token_id(Path(source), tokens, Path(cache_dir))
            if largest >= vocab_size:
                raise ValueError(
                    f"data.source={source!r}: {source} holds token id {largest}, outside model.vocab_size="
                    f"{vocab_size} (ids must be below it); set model.vocab_size to at least {largest + 1}, or "
                    "re-tokenise the file"
                )
        return tokens
    encoder = load_tokenizer(tokenizer, vocab_size, source)
    end = document_end(encoder, document_end_spec)
    corpus = list_corpus(source, text_key, skip)
    label = f"{corpus.label}-{encoder.label}" if encoder.label else corpus.label
    key = [encoder.identity, *corpus.key] + ([] if end.legacy else [["document-end", end.spec, end.token_id]])
    return _cached_tokens(corpus.documents, label, key, cache_dir, source, text_key, encoder, end, workers)


def check_source(source: str, tokenizer: str, vocab_size: int, text_key: str = "text",
                 skip: tuple[str, ...] | list[str] = (), document_end_spec: str = AUTO) -> tuple[str | None, str]:
    """``load_tokens``' first checks, for ``train.py`` to make before any process starts: the tokenizer of a text
    source exists, reads, and its vocabulary fits ``model.vocab_size``; every file of the source is in a format
    taken here (or skipped by ``data.skip``). Returns the line listing what ``data.skip`` left out (or None), and
    ``data.document_end`` resolved (``auto`` made the token or text it means, for the run's config). A ``.bin`` is
    checked when it is opened; records are checked as they are tokenised, before training starts."""
    if source.endswith(".bin"):
        return None, document_end_spec
    encoder = load_tokenizer(tokenizer, vocab_size, source)
    note = skipped_message(source, list_corpus(source, text_key, skip))
    return note, document_end(encoder, document_end_spec).spec


def _cached_tokens(docs: list[Document], label: str, key: list, cache_dir: str | Path, source: str,
                   text_key: str, tokenizer: Tokenizer, end: DocumentEnd, workers: int = 1) -> np.memmap:
    """Map the cached tokens for ``key``, tokenising ``docs`` first if no cache exists yet (or if a file that was
    racy when it was built has changed since: see ``_write_tokens``)."""
    cache_dir = Path(cache_dir)
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    cache_file = cache_dir / f"{label}-{digest}.bin"
    if not cache_file.exists() or not _racy_files_unchanged(cache_file):
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(
                f"data.cache_dir={str(cache_dir)!r}: cannot create it ({error}); use a writable folder"
            ) from error
        with build_lock(cache_dir, f"the tokens of {source}") as exclusive:
            # another process may have built it while this one waited
            if not (cache_file.exists() and _racy_files_unchanged(cache_file)) and \
                    _write_tokens(cache_file, docs, text_key, tokenizer, end, source, exclusive, workers) == 0:
                raise ValueError(
                    f"data.source={source!r}: no text in its {len(docs)} file(s) (empty files, no records, or "
                    "records whose text is empty); "
                    f"{VALID_SOURCES}"
                )
    return _map_tokens(cache_file, source, tokenizer.dtype)


def _write_tokens(dest: Path, docs: list[Document], text_key: str, tokenizer: Tokenizer, end: DocumentEnd,
                  source: str = "", resumable: bool = True, workers: int = 1) -> int:
    """Tokenise the documents of ``docs`` (each file with its stat when listed) with ``tokenizer`` into ``dest``
    atomically; return the token count (0: nothing written).

    Tokens go to a partial file beside ``dest``, fsynced and renamed over it at the end, so a crash never leaves
    a half-written cache and nothing half-written is ever served. Files are streamed (``data/formats.py``), so
    memory stays bounded whatever the corpus's size. A file that cannot be read, holds a malformed record, or
    changed since it was listed (the cache's name describes the listed state), is an error, and the partial work is
    discarded (the fix changes the files, and so the cache's name). Any other interruption (Ctrl-C, a killed job, a
    full disk) keeps it: every ``CHECKPOINT_SECONDS`` at a file boundary the partial file is fsynced and
    ``<partial>.progress.json`` records how many files and bytes it holds, and the next build (``resumable``: this
    process holds the build lock, ``data/build.py``) truncates the partial file to that and carries on from the
    next file. The partial file's name holds the cache's key, so only the same corpus resumes it. ``workers`` > 1
    tokenise files in that many processes (``data/workers.py``), each file into its own temporary file appended
    in corpus order, so the stream is the same as one process's.

    File times have a coarse grain (a clock tick, up to a second on some network filesystems), so a file
    changed within ``RACY_SECONDS`` before the build could change again without its times moving (git's
    "racy clean" case). The SHA-256 of each such file, read again once it is tokenised (its signature checked
    unchanged after), goes to ``<cache>.racy.json``, written before the cache; a later start re-hashes just those
    files and rebuilds if one differs.
    """
    racy_after = time.time_ns() - int(RACY_SECONDS * 1e9)
    progress_file = dest.parent / f".{dest.name}.progress.json"
    fd, partial, done = _open_partial(dest, progress_file, source, len(docs), resumable)
    digests: dict[str, str] = dict(done["digests"])
    stream = tokenizer.stream(end)
    report = Progress(source, len(docs), sum(doc.stat.st_size for doc in docs),
                      sum(doc.stat.st_size for doc in docs[:done["files"]]))
    read_bytes, checkpointed, discard = report.start_bytes, time.monotonic(), False
    text_bytes = int(done.get("text", done["bytes"]))  # a record from before text was counted: its bytes
    try:
        with os.fdopen(fd, "wb") as out:
            files = _tokenised_files(docs, done["files"], text_key, tokenizer, end, stream, out, digests, racy_after,
                                     workers, dest)
            for number, text in _discarding_bad_input(files, lambda: done.update(discard=True)):
                text_bytes += text
                read_bytes += docs[number].stat.st_size
                report.update(number + 1, read_bytes, out.tell() // tokenizer.dtype.itemsize)
                if resumable and time.monotonic() - checkpointed >= CHECKPOINT_SECONDS:
                    _save_progress(out, stream, progress_file, number + 1, digests, text_bytes)
                    checkpointed = time.monotonic()
            out.write(stream.finish())
            # documents without text are their ends alone: nothing to train on, refused as no text at all
            tokens = out.tell() // tokenizer.dtype.itemsize if text_bytes else 0
            out.flush()
            os.fsync(out.fileno())
        if tokens:
            _publish(partial, dest, digests)
        discard = True
    except OSError as error:  # writing (reading errors are ValueErrors by now): a full disk, say
        raise ValueError(f"data.cache_dir={str(dest.parent)!r}: cannot write the token cache there "
                         f"({error.strerror}); free space or use another folder (the work so far is kept)") from error
    finally:
        if discard or done.get("discard") or not resumable:
            partial.unlink(missing_ok=True)
            progress_file.unlink(missing_ok=True)
    return tokens


def _open_partial(dest: Path, progress_file: Path, source: str, files: int,
                  resumable: bool) -> tuple[int, Path, dict]:
    """The partial file of ``dest``'s build, opened for writing at its end: (descriptor, path, what it holds).

    ``resumable``: an interrupted build's partial file (``.<cache>.partial``) is cut back to what its progress
    record vouches for (files, bytes, racy digests) and carried on, or made afresh; otherwise a temporary file
    of its own is made. Either way it is made readable by every user (a shared cache).
    """
    partial = dest.parent / f".{dest.name}.partial"
    done = _resume_point(partial, progress_file) if resumable else None
    try:
        if done is None:
            progress_file.unlink(missing_ok=True)
            if resumable:
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            else:
                fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
                partial = Path(name)
            done = {"files": 0, "bytes": 0, "digests": {}, "text": 0}
        else:
            fd = os.open(partial, os.O_WRONLY)
            os.ftruncate(fd, done["bytes"])
            os.lseek(fd, done["bytes"], os.SEEK_SET)
            print(f"resuming the token cache of {source} after {done['files']} of {files} files", file=sys.stderr)
        os.fchmod(fd, 0o644)  # a shared cache must be readable by every user's ranks
    except OSError as error:
        raise ValueError(f"data.cache_dir={str(dest.parent)!r}: cannot write there ({error.strerror}); use a "
                         "writable folder") from error
    return fd, partial, done


def _tokenised_files(docs: list[Document], start: int, text_key: str, tokenizer: Tokenizer, end: DocumentEnd,
                     stream, out, digests: dict[str, str], racy_after: int, workers: int,
                     dest: Path) -> Iterator[tuple[int, int]]:
    """Files ``start..`` tokenised into ``out`` in corpus order, yielding each one's number and bytes of text once it
    is written: in
    ``workers`` processes (``data/workers.py``) when more than one file is left, else here."""
    if workers > 1 and len(docs) - start > 1:
        return _in_workers(_tokenise_file, docs, start, text_key, tokenizer, end, out, digests, racy_after, workers,
                           dest.parent / f".{dest.name}.file-")
    return _in_process(docs, start, text_key, stream, out, digests, racy_after)


def _save_progress(out, stream, progress_file: Path, files: int, digests: dict[str, str], text_bytes: int) -> None:
    """Make the partial file ``out`` resumable after its first ``files`` files (``text_bytes`` of text): sync it,
    then record them."""
    out.write(stream.finish())  # pieces are encoded one by one: draining here changes no token
    out.flush()
    os.fsync(out.fileno())
    _write_record(progress_file, {"files": files, "bytes": out.tell(), "digests": digests, "text": text_bytes})


def _publish(partial: Path, dest: Path, digests: dict[str, str]) -> None:
    """Rename the finished ``partial`` over ``dest``, its racy files' digests recorded first (none: no record)."""
    racy = _racy_record(dest)
    if digests:
        _write_record(racy, digests)
    else:
        racy.unlink(missing_ok=True)
    os.replace(partial, dest)


def _in_process(docs: list[Document], start: int, text_key: str, stream, out, digests: dict[str, str],
                racy_after: int) -> Iterator[tuple[int, int]]:
    """Tokenise files ``start..`` into ``out`` here, yielding each one's number, and its bytes of text, once it is
    written."""
    for number in range(start, len(docs)):
        yield number, _tokenise_file(docs[number], text_key, stream, out, digests, racy_after)


def _discarding_bad_input(files: Iterator[int], on_bad_input) -> Iterator[int]:
    """``files``, calling ``on_bad_input`` before a ValueError (bad input: fixing it renames the cache, so the partial
    work is of no use) passes on; closed when the caller stops, so workers are shut down."""
    try:
        yield from files
    except ValueError:
        on_bad_input()
        raise
    finally:
        files.close()


def _tokenise_file(doc: Document, text_key: str, stream, out, digests: dict[str, str], racy_after: int) -> int:
    """Append one file's documents, each with its end, to ``out``; hash it after if it was racy. Returns the bytes
    of text it held (0: empty, or records whose text is empty)."""
    text_bytes = 0
    changed = ValueError(f"data.source: {doc.path} changed while the corpus was being read; run again once it is "
                         "written")
    try:
        with open(doc.path, "rb") as raw:
            if signature(os.fstat(raw.fileno())) != signature(doc.stat):
                raise changed
            for chunks in read_documents(doc.path, doc.kind, doc.compression, text_key, raw):
                for chunk in chunks:
                    out.write(stream.feed(chunk))
                    text_bytes += len(chunk)
                out.write(stream.end_document())
        if max(doc.stat.st_mtime_ns, doc.stat.st_ctime_ns) >= racy_after:
            digests[str(doc.path)] = sha256_file(doc.path)
            if signature(doc.path.stat()) != signature(doc.stat):
                raise changed
    except OSError as error:
        raise unreadable(doc.path, error) from error
    return text_bytes


def _resume_point(partial: Path, progress_file: Path) -> dict | None:
    """What an interrupted build of this cache finished (files, bytes, racy digests), or None to start afresh."""
    try:
        done = json.loads(progress_file.read_text(encoding="utf-8"))
        if partial.stat().st_size >= int(done["bytes"]) and int(done["files"]) >= 0 and \
                isinstance(done["digests"], dict):
            return done
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _racy_record(cache_file: Path) -> Path:
    return cache_file.with_suffix(".racy.json")


def _write_record(path: Path, value: dict) -> None:
    """Replace the JSON record ``path`` whole (the cache's records, as they have always been written: readable by
    every user, a ``.tmp`` temporary beside it, not synced)."""
    with atomic_output(path, "w", encoding="utf-8", permissions=0o644, durable=False, suffix="tmp") as out:
        json.dump(value, out)


def _racy_files_unchanged(cache_file: Path) -> bool:
    """Whether every file that was racy when ``cache_file`` was built still holds what was read from it."""
    record = _racy_record(cache_file)
    if not record.is_file():
        return True
    try:
        digests = dict(json.loads(record.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return False  # a damaged record: rebuild, which rewrites it
    for name, digest in digests.items():
        try:
            if sha256_file(name) != digest:
                return False
        except OSError:
            return False  # rebuilding names the error
    return True


def _map_tokens(path: Path, source: str, dtype: np.dtype) -> np.memmap:
    """Memory-map a raw token file (uint16 or uint32) read-only, after checking it can be one."""
    if not path.is_file():
        raise ValueError(f"data.source={source!r}: no such file or folder; {VALID_SOURCES}")
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ValueError(
            f"data.source={source!r}: {path} has {size} bytes; a token file must be non-empty {dtype.name} "
            f"(a multiple of {dtype.itemsize} bytes); {VALID_SOURCES}"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _largest_token_id(path: Path, tokens: np.memmap, cache_dir: Path) -> int:
    """The largest id in the token file ``path`` (mapped as ``tokens``), scanned once per version of the file.

    The result is kept in ``cache_dir`` under a hash of the file's path and signature, so a large file is read
    whole only the first time it is used (and again whenever it changes). A cache that cannot be written costs
    only the next start's scan.
    """
    key = json.dumps(["max-id-v1", str(path.resolve()), *signature(path.stat())])
    record = cache_dir / f"maxid-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return int(json.loads(record.read_text(encoding="utf-8"))["max_id"])
    step = CHUNK_BYTES // 2
    largest = max(int(tokens[start:start + step].max()) for start in range(0, len(tokens), step))
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
        _write_record(record, {"max_id": largest})
    return largest
