from engine.models.decoder import CausalLM

__all__ = ["CausalLM"]
