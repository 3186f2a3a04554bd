"""A Hugging Face model folder opened for reading: its config.json and its tensors by name, over one
``model.safetensors`` or the shards ``model.safetensors.index.json`` names (``interop/hf_shards.py`` writes
them). Every defect a download cut short leaves (a file missing, not JSON, not safetensors) is an error naming the
file, and a config.json value of the wrong type one naming its key, before any tensor is read.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError, safe_open

from config.errors import ConfigError
from interop.hf_family import check_value_types
from interop.hf_shards import INDEX_FILE, SINGLE_FILE


class HFFolder(contextlib.AbstractContextManager):
    """A Hugging Face model folder: its config.json and its tensors by name, over one or many shard files.

    Shards are opened when first read (safetensors maps them; slicing reads in place). Missing files are
    named up front, before any tensor is read.
    """

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{self.folder}: no config.json (not a Hugging Face model folder)")
        self.config = _json_file(config_path, dict, "a mapping of the model's settings")
        try:  # by config.json's own key names, before any family code reads them
            check_value_types(self.config)
        except ConfigError as exc:
            raise ConfigError(f"{self.folder}: {exc}") from None
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = _json_file(index, dict, 'a mapping with a "weight_map"').get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConfigError(f"{index}: has no \"weight_map\" of tensor names to shard files (a download cut "
                                  "short? fetch the folder again)")
            self.files = dict(weight_map)
        elif (self.folder / SINGLE_FILE).is_file():
            try:
                with safe_open(str(self.folder / SINGLE_FILE), framework="pt") as handle:
                    self.files = dict.fromkeys(handle.keys(), SINGLE_FILE)
            except (OSError, SafetensorError) as exc:
                raise ConfigError(f"{self.folder / SINGLE_FILE}: not a readable safetensors file ({exc}; a download "
                                  "cut short? fetch it again)") from exc
        else:
            raise ConfigError(f"{self.folder}: neither {SINGLE_FILE} nor {INDEX_FILE} (safetensors weights only)")
        for file in sorted(set(self.files.values())):
            if not (self.folder / file).is_file():
                raise ConfigError(f"{self.folder}: shard {file} named in {INDEX_FILE} is missing")
        self._stored: dict[str, str] = {}  # a name ``rename`` gave -> the name in the files
        self._handles: dict[str, object] = {}
        self._stack = contextlib.ExitStack()

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def rename(self, canonical: Callable[[str], str]) -> None:
        """See the tensors under the names ``canonical`` gives them (a family's published folders that name them
        otherwise than ``transformers`` saves them); ``files`` and ``slice`` take the new names from then on."""
        renamed: dict[str, str] = {}
        files: dict[str, str] = {}
        for name, file in self.files.items():
            stored = self._stored.get(name, name)
            new = canonical(stored)
            if new in renamed:
                raise ConfigError(f"{self.folder}: tensors '{renamed[new]}' and '{stored}' are both '{new}'")
            renamed[new], files[new] = stored, file
        self.files, self._stored = files, renamed

    def slice(self, name: str):
        """The safetensors slice of HF tensor ``name`` (read nothing yet); an error naming it if absent."""
        if name not in self.files:
            raise ConfigError(f"{self.folder}: has no tensor '{name}'")
        file = self.files[name]
        name = self._stored.get(name, name)
        if file not in self._handles:
            try:
                self._handles[file] = self._stack.enter_context(safe_open(str(self.folder / file), framework="pt"))
            except (OSError, SafetensorError) as exc:
                raise ConfigError(f"{self.folder / file}: not a readable safetensors file ({exc})") from exc
        return self._handles[file].get_slice(name)


def _json_file(path: Path, kind: type, what: str):
    """The JSON value of ``path``, which must be a ``kind`` (``what`` says what it should hold); a ConfigError
    naming the file otherwise (not UTF-8, not JSON, cut short, or the wrong shape)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); it should hold JSON") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, kind):
        raise ConfigError(f"{path}: holds a JSON {type(value).__name__}, not {what}")
    return value
