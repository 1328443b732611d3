"""CLI subcommands, one module each, every module exposing `register(app)`."""
