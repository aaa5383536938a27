"""The exceptions a user can cause: each message is a single sentence naming the fix."""


class UserError(Exception):
    """Bad input or environment the user can fix; shown without a traceback."""


class ContextExceeded(UserError):
    """A prompt too long for the model's context even with the oldest turns left out."""
