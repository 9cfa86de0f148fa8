"""The playground: a page at ``/`` of the HTTP port to try the server in a browser (static files
in ``playground/``, no build step; the page loads nothing from anywhere but this server, and its
Content-Security-Policy says so). The page itself is open; what it calls is behind the server's
bearer token, which the page asks for."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

FOLDER = Path(__file__).with_name("playground")
#: The files the page is made of, and their types (nothing else is served from the folder).
FILES = {"index.html": "text/html; charset=utf-8", "playground.js": "text/javascript; charset=utf-8",
         "playground.css": "text/css; charset=utf-8"}
#: Everything from this server: scripts, styles, fetches and the WebSocket; audio from blobs it made.
POLICY = ("default-src 'self'; connect-src 'self'; media-src 'self' blob:; img-src 'self' data:; "
          "style-src 'self'; script-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


async def page(request: Request) -> Response:
    return FileResponse(FOLDER / "index.html", media_type=FILES["index.html"], headers=HEADERS)


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in FILES or name == "index.html":
        from audio_pipeline.http.openai_speech import error_response

        return error_response(404, f"no route GET {request.url.path}", None, "not_found")
    return FileResponse(FOLDER / name, media_type=FILES[name], headers=HEADERS)


routes = [Route("/", page, methods=["GET"]), Route("/playground/{name}", asset, methods=["GET"])]
