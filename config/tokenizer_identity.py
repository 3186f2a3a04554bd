"""What a model's token ids mean, and the one rule that a model is read with the tokenizer it learned.

A model's embedding rows mean the ids of the tokenizer it was trained with; the same weights fed another
tokenizer's ids read every token as a different word, without a word of warning. A tokenizer's path does not say
which one it is (``moe-tokenizer train --overwrite`` retrains it in place), so what is recorded and compared is
its fingerprint: ``bytes``, or the SHA-256 of the ``tokenizer.json``'s content. Each checkpoint records it
(``trainer_state.json``'s ``tokenizer``), and so does each safetensors file of ours (its ``tokenizer`` metadata);
a Hugging Face folder's is that of its ``tokenizer.json``. A resume, ``--init-from`` (a file or ``hf:DIR``),
``moe-evaluate`` and ``moe-generate`` all apply ``check_same_tokenizer``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from config.errors import ConfigError

BYTES = "bytes"  # data.tokenizer's one-token-per-byte tokenizer (data/tokenizer.py takes it from here)
FINGERPRINT_METADATA_KEY = "tokenizer"  # a safetensors file's metadata entry holding it


def tokenizer_fingerprint(spec: str) -> str:
    """``bytes``, or ``sha256:`` and the hex SHA-256 of the tokenizer.json at ``spec``."""
    return spec if spec == BYTES else "sha256:" + hashlib.sha256(Path(spec).read_bytes()).hexdigest()


def readable(spec: str) -> bool:
    """Whether ``spec`` names a tokenizer here (its fingerprint can be taken): ``bytes`` or an existing file."""
    return spec == BYTES or Path(spec).is_file()


def check_same_tokenizer(trained_with: str | None, spec: str, model: str, advice: str) -> None:
    """Refuse to read ``model`` (what is loaded, for the message) with the tokenizer ``spec`` when it was trained
    with another (``trained_with``, a fingerprint; None for weights saved before fingerprints were recorded: there
    is nothing to compare). The message names both fingerprints and ends with ``advice``, the way out."""
    if trained_with is None or not readable(spec):
        return
    now = tokenizer_fingerprint(spec)
    if now != trained_with:
        given = spec if spec == BYTES else f"{spec} ({now})"
        raise ConfigError(f"{model} was trained with the tokenizer {trained_with}, and would be read here with "
                          f"{given}: its token ids would mean other tokens than the model learned; {advice}")
