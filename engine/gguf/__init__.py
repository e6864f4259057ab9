"""GGUF checkpoints (llama.cpp's format): read, dequantize and convert to HF layout."""
from engine.gguf.convert import convert_atomically, write_checkpoint
from engine.gguf.weights import GGUFError

__all__ = ["GGUFError", "convert_atomically", "write_checkpoint"]
