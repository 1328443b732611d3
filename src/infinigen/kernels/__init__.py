"""Compute kernels (CPU torch paths; accelerator paths where they exist)."""
import threading

from .int4 import PackedKeys, dequantize, fake_quantize, pack, quantize, unpack

__all__ = ["PackedKeys", "build_native", "build_native_in_background", "dequantize", "fake_quantize", "native_key",
           "pack", "quantize", "unpack"]


def native_key() -> str:
    """What the native kernels' builds depend on (their sources, torch, the CPU), in one short string: a speed
    measured with them (policies/crossing.py) is keyed by it."""
    from . import fused_select, int4_gemv
    from .native_build import build_key
    return f"{fused_select.build_key()}+{build_key(int4_gemv._SOURCE)}"


def build_native() -> None:
    """Every native CPU kernel built (or found in the cache) and loaded; one that cannot be is one warning line and
    its torch path."""
    import torch

    from . import block_select, fused_select, int4_gemv
    fused_select.available()
    block_select.available()
    int4_gemv.available(torch.float32)


def build_native_in_background() -> None:
    """The weight kernels every CPU decoding step calls, built on a thread while the command converts and loads its
    model (the compiler is a process of its own); a caller that needs them before the build finishes waits for it,
    and so does the process's exit (a compiler is not left running unattended) unless the command is interrupted
    (`native_build.stop_builds`). The selection's kernel, a longer
    build used once contexts are long, stays on first use (a token's append takes its torch path until then: the
    same bytes). Not where the cache cannot be written: the command says so itself, and a failed build is not
    retried."""
    import torch

    from ..errors import UserError
    from ..paths import writable_cache
    from . import int4_gemv
    try:
        writable_cache("kernels")
    except (UserError, OSError):
        return
    threading.Thread(target=int4_gemv.available, args=(torch.float32,), name="infinigen-native-build").start()
