"""The one exception a user can cause: its message is a single sentence naming the fix."""


class UserError(Exception):
    """Bad input or environment the user can fix; shown without a traceback."""
