"""The `infinigen` command. Each subcommand lives in `infinigen.commands.<module>` and registers
itself on the app. Exit codes: 0 done, 2 bad input (one line `infinigen: error: ...` on stderr, no
traceback), 130 interrupted (Ctrl-C, at any moment: also while torch is still importing). Standard output
that cannot be written (`> /dev/full`) is exit 2 with one line; a reader that went away (`| head`) ends the
command quietly with exit 1, as click does when that happens in the middle of a command.

Nothing heavy is imported at module level: `main` imports the commands inside its own error handling,
so an interrupt during the imports (torch takes seconds) is handled like any other.
"""
from __future__ import annotations

import errno
import importlib
import os
import sys

from .errors import ArgumentError, UserError

COMMAND_MODULES = ["basic", "skew", "calibrate", "ppl", "bench", "fewshot", "needle", "analyze", "serve"]
INTERRUPTED = 130

_app = None
# the signal that stops the command (SIGINT; SIGTERM where a command exits on it, `exit_on_sigterm`): whatever error
# follows is that stop, since libraries turn the exception a handler raises into errors of their own (a lazy
# import's ModuleNotFoundError, the interpreter's "Error calling __set_name__", a loader's "no valid model")
_stopped_by: int | None = None


def _on_sigint(signum, frame):
    global _stopped_by
    _stopped_by = signum
    raise KeyboardInterrupt


def stopping() -> bool:
    """Whether a signal is stopping the command (an error raised now is that stop, not a failure to report)."""
    return _stopped_by is not None


def raise_a_swallowed_stop() -> None:
    """A signal whose exception a library caught and ignored (a KeyboardInterrupt raised inside a `__del__` or a
    callback is printed and dropped): the command stops now as the signal asked, not later or never."""
    import signal
    if _stopped_by == signal.SIGINT:
        raise KeyboardInterrupt
    if _stopped_by == signal.SIGTERM:
        exit_on_sigterm(signal.SIGTERM, None)


def _quiet_stop_in_finalizers(unraisable) -> None:
    """sys.unraisablehook while a command runs: a signal's exception raised inside a finalizer (`__del__`) or a
    callback, which Python prints with a traceback and drops, is not printed (the command stops all the same:
    `raise_a_swallowed_stop`); anything else goes to the hook that was there."""
    if _stopped_by is not None and isinstance(unraisable.exc_value, (KeyboardInterrupt, SystemExit)):
        return
    sys.__unraisablehook__(unraisable)


def exit_on_sigterm(signum, frame):
    """A SIGTERM handler for a command with nothing to finish (`serve` while it warms up): exit 0 now, quietly."""
    global _stopped_by
    _stopped_by = signum
    stop_native_builds()
    raise SystemExit(0)


def build_app():
    """The typer app with every command registered (built once)."""
    global _app
    if _app is None:
        import typer
        app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                          help="Long-context LLM inference with InfiniGen KV-cache speculation.")
        for name in COMMAND_MODULES:
            importlib.import_module(f"infinigen.commands.{name}").register(app)
        _app = app
    return _app


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading
    global _stopped_by
    _stopped_by = None
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, _on_sigint)
    stdout = sys.stdout
    guard = sys.stdout = _GuardedStdout(stdout) if stdout is not None else None
    hook, sys.unraisablehook = sys.unraisablehook, _quiet_stop_in_finalizers
    try:
        return _run(argv)
    except KeyboardInterrupt:  # anywhere, including in our own handlers below
        return _interrupted()
    finally:
        sys.unraisablehook = hook
        if sys.stdout is guard or type(sys.stdout).__name__ == "PacifyFlushWrapper":  # click's, after a broken pipe
            sys.stdout = stdout
        if guard is not None and guard.failed is not None:
            _drain_to_devnull(stdout)  # the interpreter's last flush would fail again, with a message
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


class _StdoutError(OSError):
    """Writing standard output failed (a full disk, a closed pipe): not a bug, the user's environment."""


class _GuardedStdout:
    """sys.stdout while a command runs: its write errors are `_StdoutError`s, so they are told apart from
    the other OSErrors without a file name, and remembered."""

    def __init__(self, inner):
        self._inner, self.failed = inner, None

    def _call(self, name, *args):
        try:
            return getattr(self._inner, name)(*args)
        except OSError as e:
            self.failed = e
            raise _StdoutError(e.errno, e.strerror or str(e)) from e

    def write(self, text):
        return self._call("write", text)

    def writelines(self, lines):
        return self._call("writelines", lines)

    def flush(self):
        return self._call("flush")

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _run(argv: list[str] | None) -> int:
    try:
        rv = build_app()(args=argv, standalone_mode=False)
        _flush_stdout()  # what is still buffered: a full disk or a closed pipe shows here, not at exit
    except BaseException as e:
        code = _exit_code_for(e)
        if code is None:
            raise
        return code
    # In non-standalone mode typer *returns* the code of an Exit (130 for a KeyboardInterrupt it caught);
    # our commands return None.
    return _exit_code(rv) if isinstance(rv, int) and not isinstance(rv, bool) else 0


def _exit_code_for(e: BaseException) -> int | None:
    """The exit code of a command that raised `e`, its line written; None: let it propagate (a bug's traceback,
    a SystemExit)."""
    import signal
    if _stopped_by == signal.SIGTERM:
        return 0  # `exit_on_sigterm`: whatever a library made of its SystemExit
    if isinstance(e, KeyboardInterrupt) or isinstance(e, _click_types("Abort")) or _caused_by_interrupt(e):
        return _interrupted()  # Ctrl-C; click's; or one that a library turned into another error
    if isinstance(e, ArgumentError):  # the library names its argument; the user set it by a flag
        return _error(f"--{e.argument.replace('_', '-')} {e.problem}")
    if isinstance(e, UserError):
        return _error(str(e))
    if not isinstance(e, Exception):
        return None
    if type(e).__name__ == "NoArgsIsHelpError":  # the help is already printed
        return 2
    if isinstance(e, _click_types("ClickException")):  # usage errors: bad option values
        return _error(e.format_message())
    if isinstance(e, _click_types("Exit")):
        return _exit_code(e.exit_code)
    if isinstance(e, OSError) and _from_stdout(e):
        return _stdout_failed(e)
    if isinstance(e, OSError) and e.filename:  # disk full, permissions: the user's environment, not a bug
        return _error(f"{e.filename}: {e.strerror or e}")
    return None


def _flush_stdout() -> None:
    flush = getattr(sys.stdout, "flush", None)
    if flush is not None:
        flush()


def _from_stdout(e: OSError) -> bool:
    return isinstance(e, _StdoutError) or isinstance(e.__cause__, _StdoutError)


def _drain_to_devnull(stream) -> None:
    """Point `stream`'s file descriptor at /dev/null, so that the text still buffered drains there."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _stdout_failed(e: OSError) -> int:
    """Standard output cannot take our text: say so, unless the reader simply left (`| head`)."""
    if e.errno == errno.EPIPE:
        return 1
    return _error(f"cannot write to standard output: {e.strerror or e}")


def _caused_by_interrupt(e: BaseException) -> bool:
    """A SIGINT arrived, or a KeyboardInterrupt is anywhere in the error's causes and contexts (transformers'
    lazy imports re-raise one as ModuleNotFoundError, with the interrupt two links down)."""
    if _stopped_by is not None:
        return True
    todo, seen = [e], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
    return False


def _exit_code(code: int | None) -> int:
    if code == INTERRUPTED:
        return _interrupted()
    return code or 0


def _error(message: str) -> int:
    print(f"infinigen: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def _interrupted() -> int:
    try:
        print("\ninfinigen: interrupted", file=sys.stderr)
    except Exception:
        pass
    stop_native_builds()
    return INTERRUPTED


def stop_native_builds() -> None:
    """An interrupted command exits now, not when a native kernel's build in flight finishes."""
    native_build = sys.modules.get("infinigen.kernels.native_build")  # not imported: nothing is building
    if native_build is not None:
        native_build.stop_builds()


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


def entry() -> None:
    """The console script: exit with `main`'s code."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
