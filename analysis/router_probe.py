"""Probing what experts specialise in: run a fixed text through a model and record every routing choice.

:func:`probe` hooks each MoE layer's router and keeps, for every token of the text, the k experts the
layer chose and their combine weights (the router's choice, before any capacity drop). From that:

- :func:`byte_categories` / :func:`expert_categories` / :func:`category_lift`: which kinds of byte
  (letters, digits, whitespace, punctuation, Python keywords) each expert receives, against how common
  they are in the text; :func:`top_tokens` for any vocabulary.
- :func:`layer_agreement`: how much one MoE layer's top-1 choice tells about the next one's
  (normalised mutual information of the two choices; expert numbers of different layers are unrelated,
  so "same expert" would mean nothing).
- :func:`routing_change`: how the routing of the same text moved between two weight sets of one
  model (same expert slots, so here "same expert" does mean something).
"""

from __future__ import annotations

import dataclasses
import keyword
import re
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe.transformer import MoETransformer
from storage.files import atomic_output

CATEGORIES = ("letter", "digit", "whitespace", "punctuation", "keyword", "other")
_KEYWORD_PATTERN = re.compile(r"\b(?:" + "|".join(sorted(keyword.kwlist, key=len, reverse=True)) + r")\b")


def _byte_table() -> np.ndarray:
    """Category index of each byte value 0..255 (non-ASCII bytes and control characters are "other")."""
    table = np.full(256, CATEGORIES.index("other"), dtype=np.int64)
    for value in range(128):
        char = chr(value)
        if char.isalpha():
            table[value] = CATEGORIES.index("letter")
        elif char.isdigit():
            table[value] = CATEGORIES.index("digit")
        elif char in string.whitespace:
            table[value] = CATEGORIES.index("whitespace")
        elif char in string.punctuation:
            table[value] = CATEGORIES.index("punctuation")
    return table


_BYTE_TABLE = _byte_table()


def byte_categories(tokens: np.ndarray) -> np.ndarray:
    """[N] category index (into ``CATEGORIES``) of each byte token; bytes inside a Python keyword are "keyword"."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() > 255):
        raise ValueError("byte_categories needs byte-level tokens (0..255); use top_tokens for another vocabulary")
    categories = _BYTE_TABLE[tokens]
    text = bytes(tokens.astype(np.uint8)).decode("latin-1")  # one character per byte: positions line up
    for match in _KEYWORD_PATTERN.finditer(text):
        categories[match.start():match.end()] = CATEGORIES.index("keyword")
    return categories


@dataclass
class ProbeResult:
    """Every routing choice on one text: per MoE layer, [N, k] expert ids (best first) and weights."""

    tokens: np.ndarray  # [N]
    expert_ids: dict[int, np.ndarray]  # layer -> [N, k]
    weights: dict[int, np.ndarray]  # layer -> [N, k]
    num_experts: int
    # the model's weights were its untrained initial ones (no checkpoint given): figures must say so on their face,
    # since random routers show "specialisation" too, and it means nothing
    initial_weights: bool = False

    @property
    def layers(self) -> list[int]:
        return sorted(self.expert_ids)

    def save(self, path: Path | str) -> None:
        arrays = {"tokens": self.tokens, "num_experts": np.array(self.num_experts),
                  "initial_weights": np.array(self.initial_weights)}
        for layer in self.layers:
            arrays[f"expert_ids_{layer}"] = self.expert_ids[layer]
            arrays[f"weights_{layer}"] = self.weights[layer]
        with atomic_output(Path(path)) as handle:  # whole or not at all, as every output
            np.savez_compressed(handle, **arrays)

    @classmethod
    def load(cls, path: Path | str) -> ProbeResult:
        with np.load(path) as data:
            layers = sorted(int(k.rsplit("_", 1)[1]) for k in data.files if k.startswith("expert_ids_"))
            return cls(tokens=data["tokens"], num_experts=int(data["num_experts"]),
                       expert_ids={i: data[f"expert_ids_{i}"] for i in layers},
                       weights={i: data[f"weights_{i}"] for i in layers},
                       initial_weights="initial_weights" in data.files and bool(data["initial_weights"]))


@torch.no_grad()
def probe(model: MoETransformer, tokens: np.ndarray, seq_len: int, batch_size: int = 8) -> ProbeResult:
    """Run ``tokens`` (cut into windows of ``seq_len``; a ragged tail is dropped) and record the routing.

    The model runs in eval mode (no router jitter) and dropless: with a capacity limit, whether a
    token's assignment is dropped depends on the other tokens of its batch, and a drop in one layer
    changes what every later layer sees. Dropless, a token's routing depends only on its own context,
    so the windows and batch size change no choice.
    """
    windows = len(tokens) // seq_len
    if windows == 0:
        raise ValueError(f"the probe text has {len(tokens)} tokens, fewer than one window of seq_len={seq_len}")
    tokens = np.asarray(tokens[:windows * seq_len], dtype=np.int64)
    layers = model.moe_layers()
    seen: dict[int, list] = {i: [] for i in layers}
    hooks = [layer.router.register_forward_hook(
        lambda module, args, out, i=i: seen[i].append((out.expert_ids.cpu(), out.weights.float().cpu())))
        for i, layer in layers.items()]
    was_training = model.training
    configs = {i: layer.config for i, layer in layers.items()}
    for i, layer in layers.items():
        layer.config = dataclasses.replace(configs[i], capacity_factor=None)
    model.eval()
    device = next(model.parameters()).device
    try:
        batch = torch.from_numpy(tokens).view(windows, seq_len)
        for start in range(0, windows, batch_size):
            model(batch[start:start + batch_size].to(device))
    finally:
        for hook in hooks:
            hook.remove()
        for i, layer in layers.items():
            layer.config = configs[i]
        model.train(was_training)
    return ProbeResult(
        tokens=tokens,
        expert_ids={i: torch.cat([ids for ids, _ in seen[i]]).numpy() for i in layers},
        weights={i: torch.cat([w for _, w in seen[i]]).numpy() for i in layers},
        num_experts=next(iter(layers.values())).config.num_experts,
    )


def expert_categories(result: ProbeResult, layer: int, categories: np.ndarray | None = None) -> np.ndarray:
    """[E, C] assignments (all k choices) each expert received, by category of the token."""
    categories = byte_categories(result.tokens) if categories is None else categories
    ids = result.expert_ids[layer]  # [N, k]
    counts = np.zeros((result.num_experts, len(CATEGORIES)), dtype=np.int64)
    np.add.at(counts, (ids.reshape(-1), np.repeat(categories, ids.shape[1])), 1)
    return counts


def category_lift(counts: np.ndarray) -> np.ndarray:
    """[E, C] share of a category among an expert's tokens over its share in the whole text.

    1 = the expert takes that category as often as the text has it; 3 = three times as often; nan
    where the category does not occur or the expert received nothing.
    """
    counts = counts.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_expert = counts / counts.sum(1, keepdims=True)
        overall = counts.sum(0) / counts.sum()
        return per_expert / overall


def top_tokens(result: ProbeResult, layer: int, expert: int, n: int = 10) -> list[tuple[int, int]]:
    """The ``n`` most frequent (token id, count) routed to ``expert`` at ``layer`` (any vocabulary)."""
    ids = result.expert_ids[layer]
    rows = np.nonzero((ids == expert).any(1))[0]
    values, counts = np.unique(result.tokens[rows], return_counts=True)
    order = np.argsort(-counts, kind="stable")[:n]
    return [(int(values[j]), int(counts[j])) for j in order]


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@dataclass
class LayerAgreement:
    """Top-1 choices of two consecutive MoE layers on the same tokens."""

    layers: tuple[int, int]
    joint: np.ndarray  # [E, E] tokens with top-1 expert i in the first layer and j in the second
    nmi: float  # I(A; B) / sqrt(H(A) H(B)): 0 = independent choices, 1 = one determines the other


def layer_agreement(result: ProbeResult) -> list[LayerAgreement]:
    """For each pair of consecutive MoE layers, how much the first's top-1 expert predicts the second's."""
    pairs = []
    experts = result.num_experts
    for a, b in zip(result.layers, result.layers[1:], strict=False):
        joint = np.zeros((experts, experts), dtype=np.int64)
        np.add.at(joint, (result.expert_ids[a][:, 0], result.expert_ids[b][:, 0]), 1)
        p = joint / joint.sum()
        h_a, h_b = _entropy(p.sum(1)), _entropy(p.sum(0))
        mutual = h_a + h_b - _entropy(p.reshape(-1))
        nmi = mutual / np.sqrt(h_a * h_b) if h_a > 0 and h_b > 0 else 0.0
        pairs.append(LayerAgreement((a, b), joint, float(nmi)))
    return pairs


def routing_change(before: ProbeResult, after: ProbeResult) -> dict[int, dict[str, float]]:
    """Per layer: share of tokens keeping their top-1 expert, and mean overlap |A ∩ B| / k of the top-k sets."""
    if not np.array_equal(before.tokens, after.tokens):
        raise ValueError("routing_change compares two probes of the same text; these probed different tokens")
    change = {}
    for layer in before.layers:
        a, b = before.expert_ids[layer], after.expert_ids[layer]
        overlap = (a[:, :, None] == b[:, None, :]).any(2).sum(1) / a.shape[1]
        change[layer] = {"top1_same": float((a[:, 0] == b[:, 0]).mean()), "topk_overlap": float(overlap.mean())}
    return change
