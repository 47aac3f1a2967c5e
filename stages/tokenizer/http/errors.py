"""OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`) and the HTTP status of each
pipeline error kind: 400 bad parameters, 401 bad key, 403 refused by the server's configuration, 404
unknown model or adapter, 413 body too large, 503 draining or not ready."""

from __future__ import annotations

import msgspec

STATUS_OF_KIND = {
    "invalid_request": 400,
    "unknown_adapter": 404,
    "adapter_load_failed": 400,
    "server_error": 500,
    "aborted": 500,
    "protocol_mismatch": 500,
    "adapter_timeout": 503,
    "stage_failed": 500,
    "forbidden": 403,
}
TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class ApiError(Exception):
    """An error the client is told about, with its status and the request field it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def of_kind(cls, kind: str, message: str, param: str | None = None) -> ApiError:
        """The ApiError for a pipeline ErrorReply/Rejected kind (a shutdown is a 503)."""
        status = STATUS_OF_KIND.get(kind, 500)
        if kind == "server_error" and "shutting down" in message:
            status = 503
        code = "model_not_found" if kind == "unknown_adapter" else None
        return cls(status, message, param, code)

    def body(self) -> bytes:
        kind = TYPE_OF_STATUS.get(self.status, "server_error")
        return msgspec.json.encode(ErrorBody(ErrorDetail(self.message, kind, self.param, self.code)))
