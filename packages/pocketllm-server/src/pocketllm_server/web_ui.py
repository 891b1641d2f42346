"""The built-in chat page at ``/`` (off with ``--no-web-ui``): static files served from this package, which talk
to the server's own OpenAI API. The page holds no secret: with ``--api-key`` it asks the user for the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from pocketllm_server.app_state import state_of
from pocketllm_server.protocol import json_response

WEB_DIR = Path(__file__).parent / "web"
# Scripts and styles only from this server and no inline code: markup smuggled into the page could not run.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
DEFAULTS_PATH = "/ui/defaults"  # behind --api-key, like /v1
# What a chat request that leaves a field out gets without the model's recommendation (OpenAI's defaults;
# max_tokens None: the rest of the context).
_API_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "max_tokens": None, "seed": None}


class _Assets(StaticFiles):
    async def get_response(self, path: str, scope: Any) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response


async def page(request: Request) -> Response:
    return FileResponse(WEB_DIR / "index.html", headers=HEADERS)


async def defaults(request: Request) -> Response:
    """The sampling settings a chat request gets for the fields it leaves out, for the page's settings panel."""
    state = state_of(request)
    llm = state.require_llm()
    sampling = {name: state.sampling_defaults.get(name, value) for name, value in _API_DEFAULTS.items()}
    return json_response({"model": state.served_model_name, "max_model_len": llm.max_model_len, "sampling": sampling})


def routes() -> list[BaseRoute]:
    return [Route("/", page, methods=["GET"]), Route(DEFAULTS_PATH, defaults, methods=["GET"]),
            Mount("/ui", app=_Assets(directory=WEB_DIR), name="ui")]
