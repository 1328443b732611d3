"""lm-evaluation-harness model type "infinigen": our runtime with any KV-cache policy.

    python -m infinigen.eval.lm_eval_adapter run --model infinigen \
        --model_args pretrained=default,policy=infinigen,alpha=5 --tasks copa --num_fewshot 5

(lm_eval's own `lm_eval` command cannot find the type: lm_eval 0.4 loads no model plug-ins from entry
points, so the module that registers it must run first; this module's `__main__` does that), or, in Python,
`InfiniGenLM(policy="h2o", heavy_ratio=0.1)` passed as `lm_eval.simple_evaluate(model=...)`.
Importing this module registers the type; it needs `lm_eval` installed (not a dependency of infinigen).

Scoring follows `infinigen.eval.fewshot`: a request's context is the dense prefill and the
continuation is decoded under the policy (`prefill_frac` < 1 decodes the context's tail as well);
requests sharing a context (the choices of one question) share one prefill. Model arguments other
than the ones below are the policy's knobs (alpha, heavy_ratio, ...); an unknown name is an error.
"""
from __future__ import annotations

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - exercised only without lm_eval
    raise ImportError("infinigen.eval.lm_eval_adapter needs lm-evaluation-harness: pip install lm_eval") from e

from ..errors import UserError


def _bool(v) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


@register_model("infinigen")
class InfiniGenLM(LM):
    def __init__(self, pretrained: str = "default", policy: str = "infinigen", dtype: str = "float32",
                 device: str = "cpu", batch_size=1, max_length: int | None = None, prefill_frac: float = 1.0,
                 model=None, tokenizer=None, placement=None, max_batch_size=None, **knobs):
        """Model arguments that are not the ones above are the policy's knobs; an unknown one is an error
        (before the model loads). `placement`: an `infinigen.placement.Placement` for the KV pool."""
        super().__init__()
        from ..loading import load
        from ..placement import Placement
        from ..policies import make_policy
        self.policy = make_policy(policy, **knobs)  # checks the knob names
        self.placement = placement or Placement()
        if model is None:
            model, tokenizer, _ = load(pretrained, dtype=dtype, device=str(device or "cpu"), progress=False)
        elif tokenizer is None:
            raise UserError("InfiniGenLM(model=...) needs its tokenizer too")
        self.model, self.tok = model, tokenizer
        self.policy = self.policy.prepare(model, tokenizer)
        self.prefill_frac = float(prefill_frac)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1
        self.max_length = int(max_length) if max_length else model.cfg.max_position

    # ---- lm_eval's interface ----------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tok.eos_token_id
        return eos if eos is not None else (self.model.cfg.eos_token_ids or [0])[0]

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tok, "name_or_path", "infinigen").replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        from .fewshot import encode_pair, score_item
        from tqdm.auto import tqdm
        args = [r.args for r in requests]
        out: list = [None] * len(args)
        groups: dict[str, list[int]] = {}
        for i, (ctx, _) in enumerate(args):
            groups.setdefault(ctx, []).append(i)
        bar = tqdm(total=len(args), desc="loglikelihood", disable=len(args) < 2)
        for ctx, idx in groups.items():
            pairs = []
            for i in idx:
                if ctx == "":  # unconditional: condition on the end-of-text token, as lm-eval does
                    cx, ct = [self.eot_token_id], self.tok_encode(args[i][1])
                else:
                    cx, ct = encode_pair(self.tok, ctx, args[i][1])
                pairs.append((cx[-(self.max_length - 1):], ct[-(self.max_length - 1):]))
            scored = score_item(self.model, pairs, {"p": self.policy}, self.prefill_frac, self.placement)["p"]
            for i, s in zip(idx, scored):
                out[i] = (s.loglik, s.greedy)
            bar.update(len(idx))
        bar.close()
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        from .fewshot import score_continuations
        out = []
        for r in requests:
            tokens = self.tok_encode(r.args[0])
            total = 0.0
            for window in get_rolling_token_windows(tokens, self.eot_token_id, self.max_length, 1):
                ctx, cont = make_disjoint_window(window)
                total += score_continuations(self.model, list(ctx), [list(cont)], self.policy, 1.0,
                                             self.max_length, self.placement)[0].loglik
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        from ..generate import Sampling, generate_ids, stop_ids
        out = []
        for r in requests:
            ctx, kw = r.args
            kw = dict(kw or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", 256))
            sample = _bool(kw.pop("do_sample", False)) and float(kw.get("temperature", 0) or 0) > 0
            sampling = Sampling(temperature=float(kw.get("temperature", 0)) if sample else 0.0,
                                top_p=float(kw.get("top_p", 1.0) or 1.0), seed=kw.get("seed"))
            ids = self.tok_encode(ctx)[-(self.max_length - max_new):]
            pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eot_token_id
            g = generate_ids(self.model, [ids], max_new, sampling, self.policy, stop_ids(self.model, self.tok), pad,
                             placement=self.placement)
            text = self.tok.decode(g.tokens[0], skip_special_tokens=True)
            for s in until:
                if s and s in text:
                    text = text[:text.index(s)]
            out.append(text)
        return out


__all__ = ["InfiniGenLM"]


if __name__ == "__main__":  # `python -m infinigen.eval.lm_eval_adapter --model infinigen --model_args ... --tasks ...`
    from lm_eval.__main__ import cli_evaluate
    cli_evaluate()
