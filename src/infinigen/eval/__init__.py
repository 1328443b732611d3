"""Evaluation: perplexity (teacher-forced, any policy), few-shot scoring, long-context retrieval."""
from .ppl import PPLResult, load_text, perplexity, resolve_text, token_windows

__all__ = ["PPLResult", "load_text", "perplexity", "resolve_text", "token_windows"]
