"""Refusals in the OpenAI error envelope: {"error": {"message", "type", "param", "code"}}, with the status that goes
with each (400 bad request, 401 key, 404 route, 413 body, 503 queue full or draining, 500 engine failure)."""

from fastapi.responses import JSONResponse

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, retry_after=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    @property
    def body(self) -> dict:
        kind = TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body, status_code=self.status, headers=headers)


def internal_error(exc: Exception) -> APIError:
    """k3dist's own fault while answering a request (never the client's): a 500 saying what failed."""
    return APIError(500, f"internal error: {type(exc).__name__}: {str(exc)[:300]}", code="internal_error")


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
