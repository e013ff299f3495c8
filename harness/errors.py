"""The one error type the command line turns into a one-line message and exit code 2."""


class UsageError(ValueError):
    """Bad input: the message names the bad value and what is allowed."""
