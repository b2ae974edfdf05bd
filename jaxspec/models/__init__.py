from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import Llama

__all__ = ["ModelConfig", "Llama"]
