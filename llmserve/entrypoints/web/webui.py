"""The built-in page served by ``llmserve serve``: the chat playground at ``/``, the live
view at ``/live`` and their assets under ``/webui/`` (HTML, JS, CSS and the vendored
libraries listed in ``static/VENDORED.md``, all inside the package: nothing is fetched
from a CDN, so the page works on a machine without a network).

The page is a client of the public API only (``/v1/models``, ``/v1/chat/completions``,
``/v1/requests``, ``/v1/requests/{id}/timeline``): its files are public (on
``server_utils.PUBLIC_PATHS``), the data routes keep needing the API key, which the page
asks for and sends as ``Authorization: Bearer``. ``--no-webui`` (llama.cpp's name) turns
both pages off.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
from typing import Any

from fastapi import FastAPI
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

STATIC_DIR = pathlib.Path(__file__).with_name("static")
ASSETS_DIR = STATIC_DIR / "assets"
ASSETS_PREFIX = "/webui"
PAGES = {"/": "index.html", "/live": "live.html"}
# The pages load only their own files and talk only to this server; model output is
# sanitized by DOMPurify before it is inserted, and this policy blocks what might slip
# through (inline scripts, other origins). uPlot sets element styles, hence the styles.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
                           "frame-ancestors 'none'")


def _asset_paths() -> frozenset[str]:
    """The URL path of every file under ``static/assets`` (``/webui/playground.js``...)."""
    return frozenset(f"{ASSETS_PREFIX}/{p.relative_to(ASSETS_DIR).as_posix()}"
                     for p in ASSETS_DIR.rglob("*") if p.is_file())


# Exact paths that answer without an API key (server_utils.PUBLIC_PATHS adds them).
WEBUI_PUBLIC_PATHS = frozenset(PAGES) | _asset_paths()


@dataclasses.dataclass(frozen=True)
class WebUIConfig:
    """Whether ``llmserve serve`` serves the built-in page (flags from the fields:
    ``--webui`` / ``--no-webui``)."""

    webui: bool = dataclasses.field(default=True, metadata={
        "help": "Serve the built-in page: the chat playground at / and the live view of the requests at "
                "/live (--no-webui, llama.cpp's name, turns both off; the API is unchanged)."})

    def __post_init__(self) -> None:
        if not isinstance(self.webui, bool):
            raise ValueError(f"webui must be a bool, got {self.webui!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "WebUIConfig":
        """The config of parsed serve flags (the defaults for flags that are absent)."""
        defaults = cls()
        return cls(**{f.name: getattr(args, f.name, getattr(defaults, f.name)) for f in dataclasses.fields(cls)})


def add_webui_args(group: Any) -> None:
    """One ``--FIELD/--no-FIELD`` flag per :class:`WebUIConfig` field, help from its metadata."""
    for f in dataclasses.fields(WebUIConfig):
        group.add_argument(f"--{f.name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                           default=f.default, help=f.metadata["help"])


def _page(name: str) -> Any:
    path = STATIC_DIR / name

    async def page() -> Response:
        return FileResponse(path, media_type="text/html; charset=utf-8",
                            headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"})

    page.__name__ = f"webui_{path.stem}"
    page.__doc__ = f"The built-in page's {path.stem} view ({name})."
    return page


def register_webui_routes(app: FastAPI, args: argparse.Namespace) -> None:
    """Mount the pages (``GET /``, ``GET /live``) and their assets (``/webui/...``, with
    ETag/Last-Modified from starlette's StaticFiles) unless ``--no-webui``."""
    if not WebUIConfig.from_args(args).webui:
        return
    for route, name in PAGES.items():
        app.add_api_route(route, _page(name), methods=["GET"], include_in_schema=False)
    app.mount(ASSETS_PREFIX, StaticFiles(directory=ASSETS_DIR), name="webui")
