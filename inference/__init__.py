"""Using a trained model: load it in one call, sample from it, evaluate it (``docs/journeys.md``).

    from inference import load_model
    loaded = load_model("runs/moe-8x")            # a run directory, a checkpoint folder, a .safetensors or hf:DIR
    logits = loaded.model(tokens)                  # [B, S] -> [B, S, V]
"""

from inference.load import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
