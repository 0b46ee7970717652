"""The exceptions that reach users as a sentence instead of a traceback (`UserError`, and `UsageError`
for a wrong command line), and the exit codes.

Exit codes, one rule for every command: 0 done (every check passed); 1 bad input: a file, folder,
device or data that cannot be used as asked (a UserError); 2 bad usage: an unknown option, a missing
argument, an option value that is not one of its choices or not of its form (a UsageError); 3 a check
or threshold failed (verify, validate, evaluate)."""

EXIT_OK, EXIT_BAD_INPUT, EXIT_USAGE, EXIT_CHECK_FAILED = 0, 1, 2, 3


class UserError(Exception):
    """A problem with the user's input or options, stated as one sentence that names
    the file, tensor or option at fault and what to do about it."""


class UsageError(UserError):
    """A command line that is wrong whatever the input: an option value that is not one of its
    choices or not of its form, or options that contradict each other. Exit code 2, like a mistyped
    option, where a problem with the input is exit code 1."""
