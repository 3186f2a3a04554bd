"""Training data: the token stream of a corpus, its train/validation split, and the batch samplers.

Every machine can train with no download: the default corpus is the running Python's own standard
library sources (``training/corpus.py``), tokenised one byte per token (vocab 256) or with a
``tokenizer.json`` (``data.tokenizer``, ``training/tokenizer.py``). A corpus is tokenised once into a raw
uint16 (or, for a vocabulary over 65,536, uint32) file in ``data.cache_dir`` and memory-mapped from then on,
so start-up is instant and every rank of a job shares one page cache instead of holding its own copy.

The sampler's order is a pure function of (seed, sample number): it depends neither on the
data-parallel layout nor on how many steps ran in this process, which is what makes a resumed run,
even one resumed on a different number of ranks, see exactly the samples an uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from training.corpus import CHUNK_BYTES, VALID_SOURCES, Document, list_corpus, looks_binary, signature, unreadable
from training.tokenizer import BYTES, Tokenizer, load_tokenizer

# Files changed this recently before a cache build are re-hashed on later starts (see _write_tokens).
RACY_SECONDS = 2.0


def load_tokens(source: str, cache_dir: str | Path, vocab_size: int | None = None,
                tokenizer: str = BYTES) -> np.memmap:
    """The whole token stream of ``data.source`` as a read-only memmap, shape ``[tokens]``.

    ``"stdlib"`` and text files/folders are tokenised once with ``tokenizer`` (``data.tokenizer``: ``bytes``
    or a ``tokenizer.json``, whose vocabulary must fit ``vocab_size``, checked first) into ``cache_dir``; the
    cache file is named by a hash of what went into it: the tokenizer's identity, the root, and every file's
    relative path, size, modification and status-change times. Writing a file always moves its status-change
    time (``st_ctime``, which no tool can set back, unlike the modification time), so an edited, replaced,
    added or removed file gives a new key and the corpus is re-tokenised rather than served stale. A file that
    cannot be read is an error naming it, never a silent gap. A ``.bin`` is taken as already tokenised (uint16)
    and mapped as is; given ``vocab_size``, its largest token id is checked against it when it is opened (an id
    ``>= vocab_size`` would otherwise be an ``IndexError`` at whichever step first samples it), scanning the
    file once: the largest id is cached in ``cache_dir`` under the file's identity (path, size, modification
    and status-change times).
    """
    if source.endswith(".bin"):
        tokens = _map_tokens(Path(source), source, np.dtype(np.uint16))
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
    corpus = list_corpus(source)
    label = f"{corpus.label}-{encoder.label}" if encoder.label else corpus.label
    return _cached_tokens(corpus.documents, label, [encoder.identity, *corpus.key], cache_dir, source,
                          corpus.skip_binary, encoder)


def check_tokenizer(source: str, tokenizer: str, vocab_size: int) -> None:
    """``load_tokens``' first check, for ``train.py`` to make before any process starts: the tokenizer of a text
    source exists, reads, and its vocabulary fits ``model.vocab_size`` (a ``.bin`` is checked when it is opened)."""
    if not source.endswith(".bin"):
        load_tokenizer(tokenizer, vocab_size, source)


def split_tokens(tokens: np.ndarray, val_fraction: float,
                 seq_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split the stream into (train head, validation tail); both are views of ``tokens``, not copies.

    A contiguous tail (rather than random windows) keeps validation text unseen by training even
    across window boundaries. Given ``seq_len``, each part must hold one window of ``seq_len + 1`` tokens:
    checked here, before any work, not at the first evaluation (the samplers check again).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction}: must be in (0, 1)")
    num_val = int(len(tokens) * val_fraction)  # < len(tokens) as val_fraction < 1: train is never empty
    if num_val == 0:
        raise ValueError(
            f"data.val_fraction={val_fraction} of {len(tokens)} tokens leaves no validation tokens; "
            "use a larger corpus or a larger val_fraction"
        )
    train, val = tokens[:-num_val], tokens[-num_val:]
    if seq_len is not None:
        _check_layout(seq_len, 0, 1)
        _num_windows(train, seq_len, "training")
        _num_windows(val, seq_len, "validation")
    return train, val


class TokenSampler:
    """Random training windows, the same for any data-parallel layout, resumable from a tiny state.

    Sample ``g`` (numbered globally across epochs) is window ``perm_e[g % W]`` of epoch
    ``e = g // W``, where ``W`` is the number of windows and ``perm_e`` a permutation drawn from
    ``default_rng((seed, e))``. A window is ``seq_len + 1`` tokens starting at a multiple of
    ``seq_len``, so inputs never overlap and each window yields inputs and next-token targets.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        _check_layout(seq_len, dp_rank, dp_size)
        if seed < 0:
            raise ValueError(f"train.seed={seed}: must be non-negative (it seeds numpy's SeedSequence)")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_windows = _num_windows(tokens, seq_len, "training")
        self.samples_seen = 0
        self._permutations: dict[int, np.ndarray] = {}

    def next_batch(self, global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the next global batch: (inputs, targets), both int64 ``[n, seq_len]``.

        ``n = global_batch_size // dp_size``; rank r takes global samples ``[r*n, (r+1)*n)`` of the
        batch. Every rank advances by the whole global batch, so ranks stay in step without talking.
        """
        local = _local_batch_size(global_batch_size, self.dp_size)
        first = self.samples_seen + self.dp_rank * local
        windows = self._window_indices(np.arange(first, first + local, dtype=np.int64))
        self.samples_seen += global_batch_size
        return _gather(self.tokens, windows, self.seq_len)

    def state_dict(self) -> dict:
        """Everything needed to resume: the order itself is recomputed from the seed."""
        return {"samples_seen": self.samples_seen, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; a different seed or seq_len would silently change the data order."""
        for name in ("seed", "seq_len"):
            saved, current = state.get(name), getattr(self, name)
            if saved != current:
                raise ValueError(
                    f"sampler state {name}={saved} does not match this run's {name}={current}; "
                    f"resume with the same {name} or start a fresh run"
                )
        if state["samples_seen"] < 0:
            raise ValueError(f"sampler state samples_seen={state['samples_seen']}: must be non-negative")
        self.samples_seen = int(state["samples_seen"])

    def _window_indices(self, samples: np.ndarray) -> np.ndarray:
        """Window index of each global sample number; a batch may straddle two epochs."""
        epochs, positions = np.divmod(samples, self.num_windows)
        windows = np.empty_like(samples)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            windows[mask] = self._permutation(int(epoch))[positions[mask]]
        return windows

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            # Only the current and next epoch are ever needed again; older ones would just hold memory.
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            rng = np.random.default_rng((self.seed, epoch))
            self._permutations[epoch] = rng.permutation(self.num_windows)
        return self._permutations[epoch]


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int, dp_rank: int = 0, dp_size: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same validation batches on every call: windows spread evenly over the whole split.

    A fixed set makes validation losses comparable across steps and runs; spreading it
    (window ``i * W // n`` of ``W`` for the ``n`` needed) samples every part of the
    held-out text rather than whichever file happens to open it. When the split holds
    fewer windows than needed, they repeat in order. ``batch_size`` is global and split
    across ranks like :meth:`TokenSampler.next_batch`. Arguments are checked here,
    before the first batch is asked for.
    """
    _check_layout(seq_len, dp_rank, dp_size)
    local = _local_batch_size(batch_size, dp_size)
    num_windows = _num_windows(tokens, seq_len, "validation")
    needed = batch_size * num_batches
    sample = np.arange(needed, dtype=np.int64)
    windows = sample * num_windows // needed if needed <= num_windows else sample % num_windows

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in range(num_batches):
            first = batch * batch_size + dp_rank * local
            yield _gather(tokens, windows[first:first + local], seq_len)

    return batches()


def _gather(tokens: np.ndarray, windows: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read windows ``[n]`` into (inputs, targets) ``[n, seq_len]`` with one fancy-indexed memmap read."""
    offsets = windows[:, None] * seq_len + np.arange(seq_len + 1)
    batch = torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def _num_windows(tokens: np.ndarray, seq_len: int, split: str) -> int:
    # Window i spans tokens [i*seq_len, i*seq_len + seq_len], so it needs i*seq_len + seq_len < len.
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"the {split} split has {len(tokens):,} tokens, fewer than model.seq_len + 1 = {seq_len + 1:,}; "
            f"use a larger data.source, model.seq_len of at most {max(len(tokens) - 1, 0):,}, or "
            + ("a larger data.val_fraction" if split == "validation" else "a smaller data.val_fraction")
        )
    return (len(tokens) - 1) // seq_len


def _check_layout(seq_len: int, dp_rank: int, dp_size: int) -> None:
    if seq_len < 1:
        raise ValueError(f"model.seq_len={seq_len}: must be at least 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} with dp_size={dp_size}: rank must be in [0, dp_size)")


def _local_batch_size(global_batch_size: int, dp_size: int) -> int:
    if global_batch_size < 1 or global_batch_size % dp_size:
        raise ValueError(
            f"train.global_batch_size={global_batch_size}: must be a positive multiple of the "
            f"data-parallel size {dp_size}"
        )
    return global_batch_size // dp_size


def _cached_tokens(docs: list[Document], label: str, key: list, cache_dir: str | Path, source: str,
                   skip_binary: bool, tokenizer: Tokenizer) -> np.memmap:
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
        if _write_tokens(cache_file, [(path, st) for _, path, st in docs], skip_binary, tokenizer) == 0:
            raise ValueError(
                f"data.source={source!r}: no readable text in {len(docs)} candidate files; {VALID_SOURCES}"
            )
    return _map_tokens(cache_file, source, tokenizer.dtype)


def _write_tokens(dest: Path, files: list[tuple[Path, os.stat_result]], skip_binary: bool,
                  tokenizer: Tokenizer) -> int:
    """Tokenise ``files`` (each with its stat when listed) with ``tokenizer`` into ``dest`` atomically; return the
    token count (0: nothing written).

    Writing a temp file in the same folder, fsyncing it and renaming it over ``dest`` means a crash
    never leaves a half-written cache, and ranks building the same cache at once cannot corrupt it.
    Files are streamed in chunks so a corpus larger than memory still tokenises. A file that cannot be
    read, or changed since it was listed (the cache's name describes the listed state), is an error.

    File times have a coarse grain (a clock tick, up to a second on some network filesystems), so a file
    changed within ``RACY_SECONDS`` before the build could change again without its times moving (git's
    "racy clean" case). The SHA-256 of what was read from each such file goes to ``<cache>.racy.json``,
    written before the cache; a later start re-hashes just those files and rebuilds if one differs.
    """
    racy_after = time.time_ns() - int(RACY_SECONDS * 1e9)
    digests: dict[str, str] = {}
    try:
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    except OSError as error:
        raise ValueError(f"data.cache_dir={str(dest.parent)!r}: cannot write there ({error.strerror}); use a "
                         "writable folder") from error
    os.fchmod(fd, 0o644)  # mkstemp makes it private; a shared cache must be readable by every user's ranks
    tokens = 0
    stream = tokenizer.stream()
    try:
        with os.fdopen(fd, "wb") as out:
            for path, listed in files:
                hasher = hashlib.sha256() if max(listed.st_mtime_ns, listed.st_ctime_ns) >= racy_after else None
                try:
                    with open(path, "rb") as doc:
                        if signature(os.fstat(doc.fileno())) != signature(listed):
                            raise ValueError(f"data.source: {path} changed while the corpus was being read; "
                                             "run again once it is written")
                        chunk = doc.read(CHUNK_BYTES)
                        binary = skip_binary and looks_binary(chunk)
                        while chunk and not (binary and hasher is None):
                            if hasher is not None:
                                hasher.update(chunk)
                            if not binary:
                                out.write(stream.feed(chunk))
                            chunk = doc.read(CHUNK_BYTES)
                except OSError as error:
                    raise unreadable(path, error) from error
                if hasher is not None:
                    digests[str(path)] = hasher.hexdigest()
                if not binary:
                    out.write(stream.end_document())
            out.write(stream.finish())
            tokens = out.tell() // tokenizer.dtype.itemsize
            out.flush()
            os.fsync(out.fileno())
        if tokens:
            racy = _racy_record(dest)
            if digests:
                _write_json_atomic(racy, digests)
            else:
                racy.unlink(missing_ok=True)
            os.replace(tmp_name, dest)
    except OSError as error:  # writing (reading errors are ValueErrors by now): a full disk, say
        raise ValueError(f"data.cache_dir={str(dest.parent)!r}: cannot write the token cache there "
                         f"({error.strerror}); free space or use another folder") from error
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return tokens


def _racy_record(cache_file: Path) -> Path:
    return cache_file.with_suffix(".racy.json")


def _write_json_atomic(path: Path, value: dict) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(value, out)
        os.replace(tmp_name, path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


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
        hasher = hashlib.sha256()
        try:
            with open(name, "rb") as doc:
                while chunk := doc.read(CHUNK_BYTES):
                    hasher.update(chunk)
        except OSError:
            return False  # rebuilding names the error
        if hasher.hexdigest() != digest:
            return False
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
        _write_json_atomic(record, {"max_id": largest})
    return largest
