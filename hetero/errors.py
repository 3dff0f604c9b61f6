"""Errors a user can fix: the CLI prints their message and exits with code 2."""


class UserError(Exception):
    """Bad input or a limit the user can change; the message says what and how."""
