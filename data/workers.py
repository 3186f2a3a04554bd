"""Tokenising a corpus in several processes (``data.workers``): files in parallel, the stream in corpus order.

Each worker tokenises whole files, each into its own temporary file beside the cache; the builder appends them in
corpus order and deletes them, so the cache is the same stream one process writes (a tokenizer stream is drained
at every file's end, and its pieces are encoded one by one, so where files are cut changes no token). At most two
files per worker are in flight, which bounds the temporary disk and each worker's memory as one process's. Workers
are started with ``spawn`` (never forked from a process that may hold torch's or the tokenizer's threads) and
rebuild the tokenizer from its file's bytes, so they use exactly the builder's. One large file is one worker's:
parallelism comes from sharded corpora. A builder that is killed (even by SIGKILL, which runs none of its cleanup)
takes its workers with it: each watches its builder, and once it is gone removes the temporary files it wrote and
exits, rather than running on (blocked on the pool's queue for ever) with files nobody will take.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

IN_FLIGHT_PER_WORKER = 2
COPY_BYTES = 1 << 24
WATCH_SECONDS = 0.2  # how often a worker checks that its builder is still there
_TOKENIZERS: dict = {}  # in a worker: the tokenizer of each (spec, content), built once
_WRITTEN: set[str] = set()  # in a worker: the temporary files it wrote (the builder deletes those it took)


def in_workers(tokenise: Callable, docs: list, start: int, text_key: str, tokenizer, end, out, digests: dict[str, str],
               racy_after: int, workers: int, prefix: Path) -> Iterator[tuple[int, int]]:
    """Tokenise files ``start..`` of ``docs`` in ``workers`` processes with ``tokenise`` (``data.cache``'s one-file
    function, passed in, so that module and this one do not import each other), appending each to ``out`` in order
    and yielding its number, and its bytes of text, once it is written. A worker's error (a malformed record, an
    unreadable file) is raised here as it was raised there, for the first file it concerns."""
    spec = (tokenizer.spec, getattr(tokenizer, "content", None))
    pending: deque = deque()
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_watch_builder,
                               initargs=(os.getpid(),))
    submitted = start
    try:
        while True:
            while submitted < len(docs) and len(pending) < IN_FLIGHT_PER_WORKER * workers:
                part = Path(f"{prefix}{submitted}.tmp")
                pending.append((submitted, part, pool.submit(_tokenise_to_file, tokenise, docs[submitted], text_key,
                                                             spec, end, str(part), racy_after)))
                submitted += 1
            if not pending:
                return
            number, part, future = pending.popleft()
            try:
                digest, text_bytes = future.result()
                with open(part, "rb") as tokens:
                    shutil.copyfileobj(tokens, out, COPY_BYTES)
            finally:
                part.unlink(missing_ok=True)
            if digest is not None:
                digests[str(docs[number].path)] = digest
            yield number, text_bytes
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for _, part, _ in pending:
            part.unlink(missing_ok=True)


def _watch_builder(builder: int) -> None:
    """In a worker, at its start: a daemon thread that, once the builder process ``builder`` is gone (the worker is
    reparented), removes the temporary files this worker wrote and ends it at once."""
    def watch() -> None:
        while os.getppid() == builder:
            time.sleep(WATCH_SECONDS)
        for path in list(_WRITTEN):
            Path(path).unlink(missing_ok=True)
        os._exit(1)

    threading.Thread(target=watch, name="watch-builder", daemon=True).start()


def _tokenise_to_file(tokenise: Callable, doc, text_key: str, spec: tuple, end, out_path: str,
                      racy_after: int) -> tuple[str | None, int]:
    """In a worker: one file's tokens into ``out_path``; its digest when it was racy (see ``data/cache.py``), and its
    bytes of text."""
    from data.tokenizer import BYTES, ByteTokenizer, HFTokenizer  # noqa: PLC0415

    if spec not in _TOKENIZERS:
        _TOKENIZERS[spec] = ByteTokenizer() if spec[0] == BYTES else HFTokenizer(Path(spec[0]), spec[1])
    stream = _TOKENIZERS[spec].stream(end)
    digests: dict[str, str] = {}
    _WRITTEN.add(out_path)  # before it exists: a builder killed while it is written leaves nothing
    with open(out_path, "wb") as out:
        text_bytes = tokenise(doc, text_key, stream, out, digests, racy_after)
        out.write(stream.finish())
    return digests.get(str(doc.path)), text_bytes
