"""Issue 33 item 3, the server side of the built-in page (the browser drives it in
tests/e2e/test_webui_browser.py): ``/`` and ``/live`` answer the pages, their files come
from the package (every file the HTML names exists, none is fetched from elsewhere, the
wheel's package-data covers them all), they are public to GET while the data routes keep
needing the key, and ``--no-webui`` turns both pages off."""
from __future__ import annotations

import argparse
import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from llmserve.entrypoints.openai.api_server import build_app
from llmserve.entrypoints.openai.cli_args import make_arg_parser
from llmserve.entrypoints.web.webui import ASSETS_DIR, CONTENT_SECURITY_POLICY, STATIC_DIR, WebUIConfig

ROOT = Path(__file__).resolve().parents[2]
KEY = "page-key"


def _client(*flags: str) -> TestClient:
    return TestClient(build_app(make_arg_parser(argparse.ArgumentParser()).parse_args(list(flags))))


@pytest.fixture(scope="module")
def client():
    return _client("--api-key", KEY)


def _referenced(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="(webui/[^"]+)"', html)


@pytest.mark.parametrize("path, title", [("/", "playground"), ("/live", "live")])
def test_pages_and_their_files_are_public_to_get(client, path, title):
    r = client.get(path)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert f"<title>llmserve · {title}</title>" in r.text
    assert r.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY  # no other origin, no inline script
    files = _referenced(r.text)
    assert len(files) >= 4, files
    for ref in files:  # relative paths: the page works behind --root-path too
        asset = client.get("/" + ref)
        assert asset.status_code == 200 and len(asset.content) > 500, ref
        assert "etag" in asset.headers  # StaticFiles: the browser revalidates instead of refetching


@pytest.mark.parametrize("path", ["/", "/live"])
def test_pages_name_their_icon_so_the_browser_asks_for_no_favicon(client, path):
    """Without one Chromium fetched /favicon.ico on every load: a 401 with --api-key (404
    without), one console error per page load in a headless-Chromium trial. The icon is
    an empty data: URL, which the page's own CSP (img-src data:) allows."""
    assert '<link rel="icon" href="data:,">' in client.get(path).text
    assert "img-src 'self' data:" in CONTENT_SECURITY_POLICY


def test_the_data_routes_and_other_methods_still_need_the_key(client):
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/requests").status_code == 401
    assert client.get("/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404  # key: routed
    for method, path in (("POST", "/"), ("PUT", "/live"), ("DELETE", "/webui/webui.css"), ("POST", "/webui/nope.js"),
                         ("GET", "/webui/../webui.py"), ("GET", "/index.html")):
        assert client.request(method, path).status_code == 401, (method, path)
    # a missing file in the page's folder is a plain 404, even escaped out of the folder
    for path in ("/webui/nope.js", "/webui/%2e%2e/webui.py", "/webui/..%2fwebui.py"):
        r = client.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404 and "DESIGN" not in r.text, path


def test_no_webui_turns_both_pages_off():
    off = _client("--no-webui")
    for path in ("/", "/live", "/webui/webui.css"):
        r = off.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404, path
    assert "--no-webui" in make_arg_parser(argparse.ArgumentParser()).format_help()
    assert WebUIConfig.from_args(argparse.Namespace(webui=False)) == WebUIConfig(webui=False)
    with pytest.raises(ValueError, match="webui"):
        WebUIConfig(webui="no")


def test_the_page_works_offline_from_the_package():
    """No file of the page names another origin (no CDN, no font service), and the wheel's
    package-data globs cover every file under static/ (so an installed wheel serves them)."""
    files = [p for p in STATIC_DIR.rglob("*") if p.is_file()]
    own = [p for p in files if "vendor" not in p.parts and p.suffix in (".html", ".js", ".css")]
    assert len(own) == 6, own
    for p in own:
        assert not re.search(r"https?://|//cdn|@import", p.read_text()), p
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "llmserve.entrypoints.web"]
    base = STATIC_DIR.parent
    uncovered = [p for p in files if not any(fnmatch.fnmatch(p.relative_to(base).as_posix(), g) for g in globs)]
    assert not uncovered, uncovered
    vendored = (STATIC_DIR / "VENDORED.md").read_text()
    for lib in ("marked", "dompurify", "uplot"):
        assert (ASSETS_DIR / "vendor" / f"LICENSE.{lib}").is_file() and lib in vendored.lower()
