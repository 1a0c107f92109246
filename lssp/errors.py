"""Errors a user can cause; the CLI shows them as one line and exits non-zero."""


class UserError(Exception):
    """A mistake in input, configuration or environment that the user can fix."""


class IncompatibleModelsError(UserError):
    """Target and draft do not share a tokenizer."""


class ServerFailure(UserError):
    """A server or engine process that failed mid-run: a timed run keeps the prompts it completed in every mode."""
