"""What ``train.py --init-from`` loads: our consolidated safetensors file (``interop/export.py`` writes one), or a
Hugging Face folder (``hf:DIR``) converted on the fly (``interop/hf.py``).

Either becomes an ``InitialWeights`` that the run's checkpoint policy is handed and calls for each of this
rank's model parts, so the run itself knows no file format. Each rank reads only its own shards of each
tensor (``parallel.materialize.load_weights``).
"""

from __future__ import annotations

from pathlib import Path

from config.run import RunConfig
from config.tokenizer_identity import check_same_tokenizer
from interop.export import weights_tokenizer
from interop.hf import load_hf_weights, split_init_from
from parallel.materialize import InitialWeights, load_weights_file


def initial_weights(init_from: str, config: RunConfig) -> InitialWeights:
    """The weights ``init_from`` names (a .safetensors path or ``hf:DIR``), for a model of ``config``."""
    folder = split_init_from(init_from)
    if folder is not None:
        return InitialWeights(init_from, lambda module: load_hf_weights(module, folder, config))
    return InitialWeights(init_from, lambda module: load_weights_file(module, init_from))


def check_file_tokenizer(path: Path, config: RunConfig) -> None:
    """Refuse ``--init-from FILE`` of a model trained with another tokenizer than the run's ``data.tokenizer``
    (``config.tokenizer_identity``; an ``hf:DIR`` is held to its ``tokenizer.json`` by ``hf_run_config``). A run
    on pre-tokenised ``.bin`` sources only is not checked: no tokenizer reads them."""
    if all(corpus.path.endswith(".bin") for corpus in config.data.corpora()):
        return
    check_same_tokenizer(weights_tokenizer(path), config.data.tokenizer, f"--init-from {path}",
                         "set data.tokenizer to the tokenizer it was trained with (a file of the same content)")
