"""infinigen: long-context LLM inference with the KV cache in a slow tier (InfiniGen, OSDI 2024)."""
import sys
import types

from .errors import UserError

# The public names are imported on first use (PEP 562): `import infinigen.cli` must not import torch, so
# that the command answers Ctrl-C cleanly from its first instant.
_LAZY = {"load": "loading", "from_transformers": "loading", "Sampling": "generate",
         "make_policy": "policies", "Policy": "policies"}

__all__ = ["load", "from_transformers", "generate", "Sampling", "make_policy", "Policy", "UserError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """`infinigen.generate` is the function, as with an eager import, even after the submodule of the
    same name was imported (the import system would otherwise set the attribute to the module)."""

    @property
    def generate(self):
        from .generate import generate
        return generate

    @generate.setter
    def generate(self, value):  # the import system storing the submodule: keep the function
        pass


sys.modules[__name__].__class__ = _Package
