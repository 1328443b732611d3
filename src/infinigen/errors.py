"""Exceptions for bad user input: the CLI prints them as one line and exits with 2."""


class UserError(Exception):
    """A problem with what the user asked for (model, prompt, settings), not a bug."""


class ArgumentError(UserError):
    """A bad value of one named argument of a library call. The message speaks of the argument as the
    library names it ("capacity must be ..."); the CLI, which knows which flag set it, names the flag."""

    def __init__(self, argument: str, problem: str):
        super().__init__(f"{argument} {problem}")
        self.argument, self.problem = argument, problem
