"""What ``train.py --init-from`` loads: our consolidated safetensors file (``interop/export.py`` writes one), or a
Hugging Face folder (``hf:DIR``) converted on the fly (``interop/hf.py``).

Either becomes an ``InitialWeights`` that the run's checkpoint policy is handed and calls for each of this
rank's model parts, so the run itself knows no file format. Each rank reads only its own shards of each
tensor (``parallel.materialize.load_weights``).
"""

from __future__ import annotations

from config.run import RunConfig
from interop.hf import load_hf_weights, split_init_from
from parallel.materialize import InitialWeights, load_weights_file


def initial_weights(init_from: str, config: RunConfig) -> InitialWeights:
    """The weights ``init_from`` names (a .safetensors path or ``hf:DIR``), for a model of ``config``."""
    folder = split_init_from(init_from)
    if folder is not None:
        return InitialWeights(init_from, lambda module: load_hf_weights(module, folder, config))
    return InitialWeights(init_from, lambda module: load_weights_file(module, init_from))
