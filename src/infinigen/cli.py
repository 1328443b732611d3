"""The `infinigen` command. Each subcommand lives in `infinigen.commands.<module>` and registers
itself on `app`; bad input (`UserError`) becomes one line on stderr and exit code 2."""
from __future__ import annotations

import importlib
import sys

import typer

from .errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Long-context LLM inference with InfiniGen KV-cache speculation.")

COMMAND_MODULES = ["basic", "skew", "ppl", "bench", "fewshot", "needle", "analyze"]

for _name in COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"infinigen.commands.{_name}")
    except ModuleNotFoundError as e:  # a command still being written; any other import error surfaces
        if e.name != f"infinigen.commands.{_name}":
            raise
        continue
    _mod.register(app)


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, standalone_mode=False)
    except UserError as e:
        print(f"infinigen: error: {e}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("infinigen: aborted", file=sys.stderr)
        return 130
    except Exception as e:  # click usage errors (bad option values) are bad input too
        if type(e).__name__ == "NoArgsIsHelpError":  # the help is already printed
            return 2
        if isinstance(e, _click_types("ClickException")):
            print(f"infinigen: error: {' '.join(e.format_message().split())}", file=sys.stderr)
            return 2
        if isinstance(e, _click_types("Exit")):
            return e.exit_code
        raise
    return 0


def _click_types(name: str) -> tuple[type, ...]:
    """`name` from click and from the copy of click that typer >= 0.24 vendors (typer._click), whose
    exceptions are not click's."""
    found = []
    for module in ("click.exceptions", "typer._click.exceptions", "typer.exceptions"):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


if __name__ == "__main__":
    sys.exit(main())
