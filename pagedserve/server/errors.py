"""The server's errors in OpenAI's body ({"error": {"message", "type", "param", "code"}}):
APIError for a refusal the handlers raise, bad_request for a ValueError naming its field,
and the app's exception handlers, FastAPI's own refusals included."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.server.protocol import ErrorResponse, error_body

logger = logging.getLogger("pagedserve.server")

ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    @property
    def type(self) -> str:
        return {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 503: "ServiceUnavailableError"}.get(self.status, "InternalServerError")


def bad_request(e: Exception | str) -> APIError:
    """A ValueError 'field: message' becomes a 400 naming the field."""
    message = str(e)
    head = message.split(":", 1)[0]
    is_field = all(c.isalnum() or c in "_.[]" for c in head) and head != message
    return APIError(400, message, head if is_field else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        # FastAPI's own refusals (a body that is not UTF-8, an unknown route, a wrong method)
        # in OpenAI's error shape too.
        status = e.status_code
        param = "body" if status == 400 else None
        message = f"body: {e.detail}" if status == 400 else str(e.detail)
        return JSONResponse(error_body(status, message, APIError(status, "").type, param), status_code=status,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(error_body(e.status, e.message, e.type, e.param), status_code=e.status,
                            headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or "body"
        if first.get("type") == "json_invalid":
            message = f"body: malformed JSON ({first.get('msg', 'invalid')})"
            param = "body"
        elif first.get("type") == "value_error" and ":" in str(first.get("ctx", {}).get("error", "")):
            message = str(first["ctx"]["error"])  # our own validator's "field: reason"
            param = message.split(":", 1)[0]
        else:
            message = f"{param}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(400, message, "BadRequestError", param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logger.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}", "InternalServerError",
                                       None), status_code=500)
