"""Errors that are the user's to fix: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input (spec, checkpoint, flags). The message names the field or file and what is valid."""


class SpecError(UserError):
    """A spec field is invalid; ``path`` is its dotted YAML path."""

    def __init__(self, path: str, message: str):
        self.path, self.message = path, message
        super().__init__(f"{path}: {message}" if path else message)

    def __reduce__(self):  # so the error crosses from a build subprocess intact
        return (type(self), (self.path, self.message))
