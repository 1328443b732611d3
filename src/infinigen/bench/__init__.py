"""Speed benchmark: prefill and decode of the same prompts with several KV-cache systems, side by side.

A *system* is a policy on a placement: "ideal" (full cache in fast memory), full offload (FlexGen style:
all of layer i's KV fetched during layer i-1), InfiniGen, H2O, INT4 (packed 4-bit pool), each on the
KV tier asked for (`--kv-offload none,cpu,disk`), plus `transformers` with its DynamicCache (and, on
CUDA, its offloaded DynamicCache) on the same weights. Every row reports prefill latency, decode latency
and throughput, bytes moved slow->fast per generated token, peak fast and slow memory, the relative KV
size, and, for InfiniGen, what its speculation state costs relative to the weights and the KV cache.

`--synthetic NAME` runs a paper-size shape (OPT-6.7B, Llama-3-8B, ...) with random weights; InfiniGen
then fetches a fixed share of the tokens per step (`fixed_ratio`, measure it on the real model with
`infinigen ppl` or a real-model bench), since speculation on random weights says nothing.
"""
from ..memory import MemoryProbe, weight_bytes
from .models import SYNTHETIC, hf_model_for, prompt_tokens, synthetic_models
from .report import add_ratios, cpu_name, machine, plot, strip_private, write_json
from .runners import BenchSettings, SharedPrefill, System, run_ours, run_transformers, sweep

__all__ = ["SYNTHETIC", "System", "BenchSettings", "synthetic_models", "hf_model_for", "prompt_tokens", "MemoryProbe",
           "weight_bytes", "SharedPrefill", "run_ours", "run_transformers", "sweep", "add_ratios", "machine",
           "cpu_name", "strip_private", "write_json", "plot"]
