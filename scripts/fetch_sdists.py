"""Download the source distributions the megablocks backend builds from, checked against PyPI's SHA-256.

    python scripts/fetch_sdists.py DIR

Why not ``pip download``: pip prepares an sdist's metadata by running its ``setup.py``, and grouped_gemm's
and megablocks' ask torch for a CUDA toolkit while doing so, which a CPU machine (where one prepares a
folder for a GPU machine without network) does not have. So each pinned sdist is fetched by the URL and
SHA-256 that the package index's simple API (PEP 691, what pip reads) lists for it; nothing is built or run.
"""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.request
from pathlib import Path

# megablocks 0.10.0 names these exact versions (setup.py: install_requires and its "gg" extra)
SDISTS = {"megablocks": "0.10.0", "grouped_gemm": "0.3.0", "stanford-stk": "0.7.1"}
INDEX = "https://pypi.org/simple/{name}/"
SIMPLE_JSON = {"Accept": "application/vnd.pypi.simple.v1+json"}


def fetch(name: str, version: str, folder: Path) -> Path:
    """The sdist of ``name==version`` in ``folder`` (downloaded unless a verified copy is already there)."""
    request = urllib.request.Request(INDEX.format(name=name), headers=SIMPLE_JSON)
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    prefix = f"{name.replace('-', '_')}-{version}.tar.gz", f"{name}-{version}.tar.gz"
    sdist = next((f for f in files if f["filename"] in prefix), None)
    if sdist is None:
        raise SystemExit(f"fetch_sdists: the index lists no source distribution of {name}=={version}")
    digest = sdist["hashes"]["sha256"]
    target = folder / sdist["filename"]
    if not (target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == digest):
        with urllib.request.urlopen(sdist["url"], timeout=300) as response:
            data = response.read()
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"fetch_sdists: {sdist['filename']} does not match PyPI's SHA-256; not kept")
        target.write_bytes(data)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    folder = Path(argv[0])
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in SDISTS.items():
        print(f"fetch_sdists: {fetch(name, version, folder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
