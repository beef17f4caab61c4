"""Typed errors that reach the client in OpenAI's error shape."""
from __future__ import annotations


def is_panic(e: BaseException) -> bool:
    """A Rust panic inside a native library (pyo3's PanicException, e.g. llguidance's): a
    BaseException, which `except Exception` misses."""
    return type(e).__name__ == "PanicException"


def is_failure(e: BaseException) -> bool:
    """An error to report and survive (an Exception, or a native library's panic), not a
    KeyboardInterrupt, SystemExit or cancellation."""
    return isinstance(e, Exception) or is_panic(e)


class KeyaccError(Exception):
    """Base error: carries an HTTP status and OpenAI error type."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}


class InvalidRequest(KeyaccError):
    """Bad input from the client (400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFound(KeyaccError):
    status_code = 404
    error_type = "invalid_request_error"


class Overloaded(KeyaccError):
    """A bounded queue is full (503, with Retry-After)."""

    status_code = 503
    error_type = "overloaded_error"


class ModelLoadError(KeyaccError):
    """The model path or hub id could not be loaded."""

    status_code = 400
    error_type = "invalid_request_error"
