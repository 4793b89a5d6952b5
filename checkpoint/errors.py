"""The one error every checkpoint reader raises: the message names the file and what is wrong."""


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded safely; the message names the file and what to do."""
