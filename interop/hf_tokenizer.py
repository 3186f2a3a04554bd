"""Tokenizers travel with models: the tokenizer and generation files of an exported Hugging Face folder, and the
rule that a run started from an HF folder reads its data with the folder's ``tokenizer.json``.

A model's embedding rows mean the ids of the tokenizer it was trained with: the same weights fed another
tokenizer's ids read every token as a different word (a 2,048-token Mixtral fine-tuned on byte ids starts at the
loss of a random model). So ``--init-from hf:DIR`` takes ``DIR/tokenizer.json`` for the data (refusing a config
that names another), and export writes the run's tokenizer beside the weights, with ``tokenizer_config.json``
(``transformers``' ``AutoTokenizer`` then loads it as a fast tokenizer) and ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from config.errors import ConfigError
from config.run import RunConfig
from config.tokenizer_identity import BYTES, check_same_tokenizer, readable, tokenizer_fingerprint

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def gpt2_byte_symbols() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters (Radford et al. 2019, the
    ``bytes_to_unicode`` of openai/gpt-2's encoder.py): printable Latin-1 bytes stand for themselves, the others
    take the characters from U+0100 on, in byte order. The ``tokenizers`` ByteLevel pre-tokenizer uses this map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def byte_tokenizer_json() -> str:
    """``data.tokenizer: bytes`` (token id = byte value) as a ``tokenizer.json``: a byte-level BPE without merges
    whose vocabulary gives each byte's symbol the byte's value, so any Hugging Face tool encodes text to our ids."""
    import tokenizers  # noqa: PLC0415 - only an export of a byte-level model needs it
    from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

    vocab = {symbol: byte for byte, symbol in gpt2_byte_symbols().items()}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def special_token_ids(config: RunConfig) -> dict[str, int | list[int]]:
    """config.json's and generation_config.json's ``bos_token_id`` and ``eos_token_id``, without which
    ``transformers``' ``generate`` never stops: the imported model's (``model.bos_token_id``, ``eos_token_ids``),
    else the end-of-text token the run's documents ended with (``data.document_end``, resolved at the start, when
    it is an added token of the tokenizer.json: the model learned to write it). A byte-level run ends documents
    with text, so it has none."""
    ids: dict[str, int | list[int]] = {}
    if config.model.bos_token_id is not None:
        ids["bos_token_id"] = config.model.bos_token_id
    eos = config.model.eos_token_ids
    if eos is None and config.data.tokenizer != BYTES and Path(config.data.tokenizer).is_file():
        added = json.loads(Path(config.data.tokenizer).read_text(encoding="utf-8")).get("added_tokens") or []
        eos = [token["id"] for token in added if token.get("content") == config.data.document_end][:1] or None
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids


def write_tokenizer_files(config: RunConfig, out: Path) -> str:
    """Write the tokenizer of ``config`` (``data.tokenizer``), ``tokenizer_config.json`` and
    ``generation_config.json`` (with the special tokens) into the export folder ``out``; returns a line saying
    what was written."""
    spec = config.data.tokenizer
    written = [GENERATION_CONFIG_FILE]
    generation = {"_from_model_config": False, "do_sample": False, "max_length": config.model.seq_len,
                  **special_token_ids(config)}
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    if spec == BYTES:
        content = byte_tokenizer_json()
    elif Path(spec).is_file():
        content = Path(spec).read_text(encoding="utf-8")
    else:
        return (f"wrote {GENERATION_CONFIG_FILE}; no tokenizer: data.tokenizer={spec!r} is not here (copy it into "
                f"{out} as {TOKENIZER_FILE} for transformers to find it)")
    (out / TOKENIZER_FILE).write_text(content, encoding="utf-8")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.model.seq_len,
                        "clean_up_tokenization_spaces": False}
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    written += [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]
    return f"wrote {', '.join(written)} (tokenizer: {'bytes' if spec == BYTES else spec})"


def folder_fingerprint(folder: Path) -> str | None:
    """The fingerprint of the tokenizer ``folder``'s model was trained with: its ``tokenizer.json``'s (None when it
    has none)."""
    found = Path(folder) / TOKENIZER_FILE
    return tokenizer_fingerprint(str(found)) if found.is_file() else None


def folder_tokenizer(data: dict, folder: Path) -> None:
    """Point the run config tree's ``data`` section at ``folder``'s ``tokenizer.json`` when it has one: in place of
    the default ``bytes``, or refused when ``data.tokenizer`` names a file of another fingerprint
    (``config.tokenizer_identity``). A pre-tokenised ``.bin`` source takes no tokenizer, and is left alone."""
    found = folder / TOKENIZER_FILE
    if not found.is_file() or str(data.get("source", "")).endswith(".bin"):
        return
    current = data.get("tokenizer", BYTES)
    if current == BYTES:
        data["tokenizer"] = str(found)
        return
    advice = (f"leave data.tokenizer unset (the run then uses the folder's), or set it to {found}")
    if not readable(current):
        raise ConfigError(f"data.tokenizer={current!r}, but the model in {folder} comes with {found}, and "
                          f"{current} is not a file here: {advice}")
    check_same_tokenizer(folder_fingerprint(folder), current, f"the model in {folder} (it comes with {found})",
                         advice)


def check_vocabularies(config: RunConfig, folder: Path) -> None:
    """Refuse to train a model from ``folder`` on byte ids when its vocabulary is not the 256 bytes and the folder
    brought no tokenizer: the ids would mean other tokens to it."""
    if (config.data.tokenizer == BYTES and config.model.vocab_size != 256
            and not config.data.source.endswith(".bin")):
        raise ConfigError(f"the model in {folder} has a vocabulary of {config.model.vocab_size:,} ids and no "
                          f"{TOKENIZER_FILE}; data.tokenizer=bytes would feed it byte ids, which mean other tokens to "
                          f"it. Copy the model's {TOKENIZER_FILE} into {folder}, or set data.tokenizer to its path")
