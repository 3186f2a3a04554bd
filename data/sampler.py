"""The batch samplers: a token stream's train/validation split, random training windows and fixed validation ones.

The sampler's order is a pure function of (seed, sample number): it depends neither on the
data-parallel layout nor on how many steps ran in this process, which is what makes a resumed run,
even one resumed on a different number of ranks, see exactly the samples an uninterrupted run would.
A mixture of several sources (``data.sources``) keeps that: which source sample ``g`` comes from is a pure
function of ``g`` and the weights (``data/mixture.py``), and which window of it, of the seed and the source's
own sample number.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from data.mixture import MixtureSchedule


def split_tokens(tokens: np.ndarray, val_fraction: float, seq_len: int | None = None,
                 source: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split the stream into (train head, validation tail); both are views of ``tokens``, not copies.

    A contiguous tail (rather than random windows) keeps validation text unseen by training even
    across window boundaries. Given ``seq_len``, each part must hold one window of ``seq_len + 1`` tokens:
    checked here, before any work, not at the first evaluation (the samplers check again). ``source`` names the
    stream in the errors (a mixture's source: which one is too small).
    """
    try:
        return _split(tokens, val_fraction, seq_len, "data.source" if source is None else "source")
    except ValueError as exc:
        if source is None:
            raise
        raise ValueError(f"{source}: {exc}") from exc


def _split(tokens: np.ndarray, val_fraction: float, seq_len: int | None,
           corpus: str) -> tuple[np.ndarray, np.ndarray]:
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
        _num_windows(train, seq_len, "training", corpus)
        _num_windows(val, seq_len, "validation", corpus)
    return train, val


class TokenSampler:
    """Random training windows, the same for any data-parallel layout, resumable from a tiny state.

    Sample ``g`` (numbered globally across epochs) is window ``perm_e[g % W]`` of epoch
    ``e = g // W``, where ``W`` is the number of windows and ``perm_e`` a permutation drawn from
    ``default_rng((seed, e))``. A window is ``seq_len + 1`` tokens starting at a multiple of
    ``seq_len``, so inputs never overlap and each window yields inputs and next-token targets.

    Given a list of streams and their ``weights`` (a mixture), sample ``g`` is sample ``j`` of source ``i``
    (``MixtureSchedule.locate``), and source ``i`` orders its own windows as above with ``default_rng((seed, i, e))``.
    """

    def __init__(self, tokens: np.ndarray | list[np.ndarray], seq_len: int, seed: int, dp_rank: int = 0,
                 dp_size: int = 1, weights: list[float] | None = None, names: list[str] | None = None):
        _check_layout(seq_len, dp_rank, dp_size)
        if seed < 0:
            raise ValueError(f"train.seed={seed}: must be non-negative (it seeds numpy's SeedSequence)")
        self.mixture = isinstance(tokens, list)
        self.sources = tokens if self.mixture else [tokens]
        self.names = names or [str(i) for i in range(len(self.sources))]
        self.weights = list(weights) if self.mixture and weights is not None else None
        if self.mixture and (self.weights is None or len(self.weights) != len(self.sources)):
            raise ValueError("a mixture of token streams needs one weight per stream")
        self.schedule = MixtureSchedule(self.weights, self.names) if self.mixture else None
        self.tokens = self.sources[0]
        self.seq_len = seq_len
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.windows = [_num_windows(t, seq_len, "training" if not self.mixture else f"{name!r} training")
                        for t, name in zip(self.sources, self.names, strict=True)]
        self.num_windows = self.windows[0]
        self.samples_seen = 0
        self.last_sources: np.ndarray | None = None  # a mixture's source of each row of the last batch
        self._permutations: dict[tuple[int, int], np.ndarray] = {}

    def next_batch(self, global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the next global batch: (inputs, targets), both int64 ``[n, seq_len]``.

        ``n = global_batch_size // dp_size``; rank r takes global samples ``[r*n, (r+1)*n)`` of the
        batch. Every rank advances by the whole global batch, so ranks stay in step without talking.
        """
        local = _local_batch_size(global_batch_size, self.dp_size)
        first = self.samples_seen + self.dp_rank * local
        samples = np.arange(first, first + local, dtype=np.int64)
        self.samples_seen += global_batch_size
        if not self.mixture:
            return _gather(self.tokens, self._window_indices(0, samples), self.seq_len)
        source, index = self.schedule.locate(samples)
        self.last_sources = source
        inputs = torch.empty(local, self.seq_len, dtype=torch.int64)
        targets = torch.empty_like(inputs)
        for i in np.unique(source):
            rows = source == i
            inputs[rows], targets[rows] = _gather(self.sources[i], self._window_indices(int(i), index[rows]),
                                                  self.seq_len)
        return inputs, targets

    def source_counts(self) -> dict[str, int]:
        """How many of the samples drawn so far came from each source (the realised mixture)."""
        if not self.mixture:
            return {self.names[0]: self.samples_seen}
        return dict(zip(self.names, self.schedule.counts(self.samples_seen).tolist(), strict=True))

    def state_dict(self) -> dict:
        """Everything needed to resume: the order itself is recomputed from the seed (and the mixture)."""
        state = {"samples_seen": self.samples_seen, "seed": self.seed, "seq_len": self.seq_len}
        if self.mixture:
            state["mixture"] = [[name, weight] for name, weight in zip(self.names, self.weights, strict=True)]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; a different seed, seq_len or mixture would silently change the data order."""
        current_mixture = self.state_dict().get("mixture")
        for name, current in (("seed", self.seed), ("seq_len", self.seq_len), ("mixture", current_mixture)):
            saved = state.get(name)
            if saved != current:
                key = "data.sources (names and weights)" if name == "mixture" else name
                raise ValueError(
                    f"sampler state {name}={saved} does not match this run's {name}={current}; "
                    f"resume with the same {key} or start a fresh run"
                )
        if state["samples_seen"] < 0:
            raise ValueError(f"sampler state samples_seen={state['samples_seen']}: must be non-negative")
        self.samples_seen = int(state["samples_seen"])

    def _window_indices(self, source: int, samples: np.ndarray) -> np.ndarray:
        """Window index of each of ``source``'s sample numbers; a batch may straddle two epochs."""
        epochs, positions = np.divmod(samples, self.windows[source])
        windows = np.empty_like(samples)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            windows[mask] = self._permutation(source, int(epoch))[positions[mask]]
        return windows

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        if (source, epoch) not in self._permutations:
            # Only the current and next epoch are ever needed again; older ones would just hold memory.
            self._permutations = {(s, e): p for (s, e), p in self._permutations.items()
                                  if s != source or e >= epoch - 1}
            # a single stream keeps the seeds it always had, so its runs and checkpoints are unchanged
            rng = np.random.default_rng((self.seed, source, epoch) if self.mixture else (self.seed, epoch))
            self._permutations[source, epoch] = rng.permutation(self.windows[source])
        return self._permutations[source, epoch]


def eval_batches(
    tokens: np.ndarray | list[np.ndarray], seq_len: int, batch_size: int, num_batches: int, dp_rank: int = 0,
    dp_size: int = 1, weights: list[float] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same validation batches on every call: windows spread evenly over the whole split.

    A fixed set makes validation losses comparable across steps and runs; spreading it
    (window ``i * W // n`` of ``W`` for the ``n`` needed) samples every part of the
    held-out text rather than whichever file happens to open it. When the split holds
    fewer windows than needed, they repeat in order. ``batch_size`` is global and split
    across ranks like :meth:`TokenSampler.next_batch`. Arguments are checked here,
    before the first batch is asked for. A list of streams with ``weights`` is a mixture: the fixed samples are
    shared out by the training schedule (``data/mixture.py``), and each source's spread over its own split.
    """
    _check_layout(seq_len, dp_rank, dp_size)
    local = _local_batch_size(batch_size, dp_size)
    sources = tokens if isinstance(tokens, list) else [tokens]
    needed = batch_size * num_batches
    if isinstance(tokens, list):
        source, index = MixtureSchedule(weights).locate(np.arange(needed, dtype=np.int64))
    else:
        source, index = np.zeros(needed, dtype=np.int64), np.arange(needed, dtype=np.int64)
    windows = np.empty(needed, dtype=np.int64)
    for i, stream in enumerate(sources):
        num_windows = _num_windows(stream, seq_len, "validation")
        mine = source == i
        count = int(mine.sum())
        windows[mine] = index[mine] * num_windows // count if count <= num_windows else index[mine] % num_windows

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in range(num_batches):
            first = batch * batch_size + dp_rank * local
            rows = slice(first, first + local)
            if len(sources) == 1:
                yield _gather(sources[0], windows[rows], seq_len)
                continue
            inputs = torch.empty(local, seq_len, dtype=torch.int64)
            targets = torch.empty_like(inputs)
            for i in np.unique(source[rows]):
                mine = source[rows] == i
                inputs[mine], targets[mine] = _gather(sources[i], windows[rows][mine], seq_len)
            yield inputs, targets

    return batches()


def _gather(tokens: np.ndarray, windows: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read windows ``[n]`` into (inputs, targets) ``[n, seq_len]`` with one fancy-indexed memmap read."""
    offsets = windows[:, None] * seq_len + np.arange(seq_len + 1)
    batch = torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def _num_windows(tokens: np.ndarray, seq_len: int, split: str, corpus: str = "data.source") -> int:
    # Window i spans tokens [i*seq_len, i*seq_len + seq_len], so it needs i*seq_len + seq_len < len.
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"the {split} split has {len(tokens):,} tokens, fewer than model.seq_len + 1 = {seq_len + 1:,}; "
            f"use a larger {corpus}, model.seq_len of at most {max(len(tokens) - 1, 0):,}, or "
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
