"""Errors the engine raises for problems a caller can name and fix."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model directory is missing, unreadable or of an unsupported architecture."""


class InvalidRequestError(EngineError, ValueError):
    """A request's prompt or sampling parameters are invalid; `param` names the culprit."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineOverloadedError(EngineError):
    """The engine cannot take more work now; the caller should retry later."""


class ModelFetchError(ModelLoadError):
    """A known model could not be downloaded, verified or converted."""
