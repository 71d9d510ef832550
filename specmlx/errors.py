"""The one exception type that carries a message meant for the user."""


class SpecmlxError(Exception):
    """A problem the user can fix: the message names it and says how.

    The CLI prints it as one line and exits non-zero; other exceptions are bugs and
    keep their traceback (shown with --debug).
    """
