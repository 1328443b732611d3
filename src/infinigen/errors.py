"""One exception type for bad user input: the CLI prints it as one line and exits with 2."""


class UserError(Exception):
    """A problem with what the user asked for (model, prompt, settings), not a bug."""
