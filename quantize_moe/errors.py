"""The one exception type that reaches users as a sentence instead of a traceback."""


class UserError(Exception):
    """A problem with the user's input or options, stated as one sentence that names
    the file, tensor or option at fault and what to do about it."""
