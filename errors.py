"""The engine's one-line errors, each raised before any heavy work and printed without a traceback: a bad model
path or file (LoadError), a bad request or option (UsageError, `require`), and a device that runs nothing more."""


class LoadError(Exception):
    """A problem with a model path, its config or its weights."""

    def __init__(self, message):
        super().__init__(" ".join(str(message).split()))  # one line even when a hostile file's names hold newlines


class UsageError(Exception):
    """A problem with a request, before any work; param: the option at fault."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


class DeviceFailed(Exception):
    """The device runs nothing more (a CUDA error poisons the context for every later call)."""


def require(ok, message, param=None):
    """A UsageError naming param, the option at fault, unless ok."""
    if not ok:
        raise UsageError(message, param)
