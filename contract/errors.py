"""An exception told in one line, for error messages that quote what a library refused."""
from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name where the message is empty."""
    message = str(exc).strip()
    return message.splitlines()[0] if message else type(exc).__name__
