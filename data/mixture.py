"""Weighted mixtures of sources: which source each global sample number draws from, as a pure function of it.

Source ``i`` of weight ``w_i`` places its ``j``-th sample at the ideal position ``(j + 1/2) / w_i``; the mixture
is every source's samples merged in order of those positions (ties go to the lower source index). This is the
Sainte-Laguë (Webster) divisor sequence: after any ``n`` samples source ``i`` has had ``n * w_i`` of them to
within rounding, so every window of ``N`` consecutive samples holds ``N * w_i`` of source ``i`` to within a
couple of samples (``tests/data/test_mixture.py`` measures the bound), with no drift however long the run.

Sample ``g`` is found without walking the sequence: the rank of source ``i``'s ``j``-th sample is ``j`` plus how
many samples of the other sources come before its position, a closed form in integers (weights are scaled to
integers ``W_i``, i.e. rounded to ``1 / WEIGHT_SCALE`` of their total), and sample ``g`` is the one of rank ``g``
among a few candidates per source near ``g * w_i``. So the schedule is layout-independent and resumable like the
rest of the sampler (``data/sampler.py``): it depends on the weights alone, not on the seed, the ranks or the
steps already run in this process.
"""

from __future__ import annotations

import numpy as np

WEIGHT_SCALE = 1 << 20  # weights are rounded to this many parts of their total
MAX_SAMPLES = 1 << 40  # sample numbers below this keep every product within int64 (2^40 * 2^21 < 2^63)


class MixtureSchedule:
    """The source of every global sample number, and its index among that source's samples."""

    def __init__(self, weights: list[float], names: list[str] | None = None):
        names = names or [str(i) for i in range(len(weights))]
        for name, weight in zip(names, weights, strict=True):
            if not (np.isfinite(weight) and weight > 0):
                raise ValueError(f"data.sources[{name}].weight={weight}: must be a positive finite number")
        total = float(sum(weights))
        scaled = np.array([round(w / total * WEIGHT_SCALE) for w in weights], dtype=np.int64)
        if (scaled == 0).any():
            small = names[int(np.argmin(scaled))]
            raise ValueError(f"data.sources[{small}].weight is below 1/{WEIGHT_SCALE:,} of the total weight; raise it "
                             "or leave the source out")
        self.scaled = scaled
        self.proportions = scaled / scaled.sum()  # the weights as the schedule realises them

    def rank(self, source: np.ndarray, index: np.ndarray) -> np.ndarray:
        """The global sample number of ``source``'s ``index``-th sample (arrays of one shape)."""
        w_self = self.scaled[source]
        ranks = index.astype(np.int64).copy()
        for other, w_other in enumerate(self.scaled):
            x = (2 * index + 1) * w_other  # position (2j+1)/(2 w_self) compared as (2j'+1) w_self  vs  x
            before_ties = (x // w_self + 1) // 2  # samples of `other` at or before the position
            strictly = -((-x) // w_self) // 2  # strictly before it: ceil(x / w_self) // 2
            counted = np.where(other < source, before_ties, strictly)
            ranks += np.where(other == source, 0, counted)
        return ranks

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source) of each global sample number in ``samples`` (int64 ``[n]``)."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and (samples.min() < 0 or samples.max() >= MAX_SAMPLES):
            raise ValueError(f"sample numbers must be in [0, {MAX_SAMPLES:,}) for a mixture")
        k = len(self.scaled)
        total = int(self.scaled.sum())
        source = np.full(samples.shape, -1, dtype=np.int64)
        index = np.zeros(samples.shape, dtype=np.int64)
        spread = np.arange(-k - 2, k + 3, dtype=np.int64)  # Webster's counts stay within k of the quota
        for i, w in enumerate(self.scaled):
            guess = samples * w // total
            candidates = np.maximum(guess[:, None] + spread[None, :], 0)
            hit = self.rank(np.full(candidates.shape, i), candidates) == samples[:, None]
            found = hit.any(axis=1)
            source[found] = i
            index[found] = candidates[found, hit[found].argmax(axis=1)]
        if (source < 0).any():  # a bug, not bad input: every rank is some source's sample
            raise AssertionError("mixture schedule: a sample number matched no source")
        return source, index

    def counts(self, n: int) -> np.ndarray:
        """How many of the first ``n`` samples each source gives ``[sources]``."""
        k = len(self.scaled)
        total = int(self.scaled.sum())
        result = np.zeros(k, dtype=np.int64)
        for i, w in enumerate(self.scaled):
            guess = n * int(w) // total
            candidates = np.maximum(np.arange(guess - k - 2, guess + k + 3, dtype=np.int64), 0)
            below = self.rank(np.full(candidates.shape, i), candidates) < n
            result[i] = int(candidates[below].max()) + 1 if below.any() else 0
        return result
