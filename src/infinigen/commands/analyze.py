"""`infinigen analyze`: the paper's analyses (Table 1, Figures 3, 5, 13, 17, the alpha count) as PNGs
plus a markdown report, and the selection's recall against the true top entries (recall.json)."""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError
from .basic import load_model
from .options import (FLOAT, atomic_folder, check_context, check_model_options, check_out_dir, check_policies_fit,
                      check_range, device_option, dtype_option, knob_dict, knob_option, model_option)


def _numbers(text: str, name: str, cast=float) -> tuple:
    try:
        out = tuple(cast(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise UserError(f"--{name}: expected comma-separated numbers, got {text!r}")
    if not out:
        raise UserError(f"--{name}: give at least one value")
    if not all(math.isfinite(v) for v in out):
        raise UserError(f"--{name}: expected finite numbers, got {text!r}")
    return out


def analyze_cmd(
    which: str = typer.Option("all", "--only", help="Comma-separated: table1, fig3, fig5, alpha, fig17, fig13, recall (default all)."),
    text: str = typer.Option("prideprejudice", "--text", help="A text file or a bundled novel's name."),
    out: Path = typer.Option(Path("results/analyze"), "--out", help="Folder for the PNGs and analyze.md."),
    tokens: int = typer.Option(1024, "--tokens", help="Tokens of the text to analyse (one window)."),
    offset: int = typer.Option(0, "--offset", help="Skip this many tokens of the text first."),
    prefill: int = typer.Option(128, "--prefill", help="Dense prompt of the decoding analyses (fig3, fig13, fig17, "
                                 "recall)."),
    budget: float = typer.Option(0.1, "--budget", **FLOAT, help="fig3: H2O/oracle token budget as a fraction of --tokens."),
    alphas: str = typer.Option("1,2,3,4,5,6,7,8,9", "--alphas", help="fig17: alpha values."),
    ratios: str = typer.Option("0.1,0.2,0.3,0.5,0.7,1.0", "--ratios", help="fig17: partial weight ratios."),
    count_alphas: str = typer.Option("3,5,7", "--count-alphas", help="alpha values of the tokens-above-threshold count."),
    knob: list[str] = knob_option("InfiniGen knob NAME=VALUE (default: the paper's preset)."),
    model: str = model_option(),
    device: str = device_option(),
    dtype: str = dtype_option(),
):
    """Reproduce the paper's analyses on a model; writes PNGs and analyze.md into --out."""
    import torch
    from tqdm.auto import tqdm

    from ..eval import analyze as an
    from ..paths import load_text, resolve_text

    sel = an.parse_which(which)
    check_range("tokens", tokens, lo=16)
    check_range("offset", offset, lo=0)
    check_range("prefill", prefill, lo=1)
    if prefill >= tokens:
        raise UserError(f"--prefill ({prefill}) must be below --tokens ({tokens})")
    check_range("budget", budget, lo=0, hi=1, lo_open=True)
    check_model_options(device, dtype)
    knobs = knob_dict("infinigen", knob, {"preset": "paper"})
    st = an.Settings(tokens=tokens, prefill=prefill, budget=budget, alphas=_numbers(alphas, "alphas"),
                     ratios=_numbers(ratios, "ratios"), count_alphas=_numbers(count_alphas, "count-alphas"), knobs=knobs)
    if any(not 0 < r <= 1 for r in st.ratios):
        raise UserError("--ratios must be in (0, 1]")
    if any(a <= 0 for a in st.alphas + st.count_alphas):
        raise UserError("alpha values must be positive")
    check_out_dir(out, "--out")
    body = load_text(text)
    net, tok, name = load_model(model, dtype, device)
    check_context(net, tokens, "--tokens")
    from ..policies import make_policy
    check_policies_fit(make_policy("infinigen", **knobs), net)
    # as `infinigen ppl` reads a window: BOS first where the tokenizer starts every input with it (Gemma)
    from ..eval.ppl import _leading_bos
    bos = _leading_bos(tok)
    per = tokens - (bos is not None)
    ids = tok(body[: 12 * (tokens + offset) + 1000], add_special_tokens=False)["input_ids"][offset:offset + per]
    ids = ([] if bos is None else [bos]) + ids
    if len(ids) < tokens:
        raise UserError(f"the text has fewer than {tokens + offset} tokens")
    ids = torch.tensor([ids], device=net.device)
    # the PNGs and analyze.md appear together at the end: an interrupted run leaves no figure without its report
    with atomic_folder(out, last=("analyze.md",)) as partial, \
            tqdm(total=an.steps(sel, st), desc="analyze", unit="run", file=sys.stderr) as bar:
        report = an.run(net, tok, ids, partial, sel, st, model_name=name, text_name=resolve_text(text).name,
                        progress=bar.update)
    print(report)
    print(f"\nwrote {out / 'analyze.md'} and its PNGs", file=sys.stderr)


def register(app: typer.Typer) -> None:
    app.command("analyze")(analyze_cmd)
