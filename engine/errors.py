"""Errors the engine reports to people: one line each, no traceback."""


class StrataError(Exception):
    """A problem with the user's input (a file, a flag, a request) that the engine refuses cleanly."""

    def __init__(self, *args):
        # One line, always: messages often quote a library's own (multi-line) error text.
        if len(args) == 1 and isinstance(args[0], str) and ("\n" in args[0] or "\r" in args[0]):
            args = (" ".join(args[0].split()),)
        super().__init__(*args)


class ModelFileError(StrataError):
    """A model file that cannot be used: missing, not a GGUF, truncated, unsupported."""


class SessionFileError(StrataError):
    """A session file that is refused; the live conversation stays untouched."""


class SessionOverwriteRefused(SessionFileError):
    """A save that would replace a session file holding a longer conversation (or a file that is not a
    session): the caller asks the person, then sends the save again with force=True."""
    code = "session_overwrite"

    def __init__(self, message: str, *, path: str, existing_tokens: int | None, new_tokens: int):
        super().__init__(message)
        self.path, self.existing_tokens, self.new_tokens = path, existing_tokens, new_tokens


class RequestError(StrataError):
    """A malformed request (prompt too long, bad parameter)."""


class Cancelled(StrataError):
    """The caller cancelled the request."""
