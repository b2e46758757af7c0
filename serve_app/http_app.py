"""The FastAPI application object and its error handlers.

Every error leaves in the OpenAI shape ``{"error": {message, type, param,
code}}``: the ingress's own ``APIError``s, Starlette's 404 and 405, and (never
expected, always counted) an unhandled exception as a 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import metrics
from serve_app.errors import APIError

log = logging.getLogger("ray.serve")


_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _endpoint(request: Request) -> str:
    return _ENDPOINTS.get(request.url.path, "other")


def make_fastapi() -> FastAPI:
    """The FastAPI app with the error handlers; routes are the Ingress methods."""
    app = FastAPI(title="prefix-cache-cluster", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        metrics.requests.inc(tags={"endpoint": "error", "status": str(exc.status)})
        if exc.status >= 500:
            metrics.responses_5xx.inc(tags={"endpoint": _endpoint(request)})
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # Unknown paths (404) and methods (405) answer in the OpenAI error shape too.
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"no endpoint {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        error = APIError(exc.status_code, message, code=codes.get(exc.status_code))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        metrics.responses_5xx.inc(tags={"endpoint": _endpoint(request)})
        return JSONResponse(APIError(500, "internal error", type_="server_error").body(), status_code=500)

    return app
