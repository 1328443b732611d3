"""infinigen: long-context LLM inference with the KV cache in a slow tier (InfiniGen, OSDI 2024)."""
from .errors import UserError
from .generate import Sampling, generate
from .loading import from_transformers, load
from .policies import Policy, make_policy

__all__ = ["load", "from_transformers", "generate", "Sampling", "make_policy", "Policy", "UserError"]
__version__ = "0.1.0"
