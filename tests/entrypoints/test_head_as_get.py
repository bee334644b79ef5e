"""HEAD on GET routes (``HeadAsGetMiddleware``): the GET's status and headers without its
body; paths without a GET route keep their 405 / 404; a route's own HEAD is left to it."""
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.responses import PlainTextResponse

from llmserve.entrypoints.openai.method_not_allowed import HeadAsGetMiddleware, install_method_not_allowed_handler


def _client() -> TestClient:
    app = FastAPI()

    @app.get("/")
    async def page():
        return PlainTextResponse("the page", headers={"X-Page": "1"})

    @app.post("/v1/chat/completions")
    async def chat():
        return {"ok": True}

    @app.api_route("/own", methods=["GET", "HEAD"])
    async def own():
        return PlainTextResponse("own", headers={"X-Own": "1"})

    app.add_middleware(HeadAsGetMiddleware, router=app.router)
    install_method_not_allowed_handler(app)

    @app.get("/later")  # added after the middleware: still served
    async def later():
        return {"later": True}

    return TestClient(app)


def test_head_answers_a_get_route_without_its_body():
    client = _client()
    get, head = client.get("/"), client.head("/")
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and get.content == b"the page"
    assert head.headers["content-length"] == get.headers["content-length"] == "8"
    assert head.headers["x-page"] == "1"
    assert client.head("/later").status_code == 200 and client.head("/later").content == b""
    assert client.head("/own").headers["x-own"] == "1"


def test_head_elsewhere_keeps_its_answer():
    client = _client()
    r = client.head("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    assert client.head("/nowhere").status_code == 404
    assert client.post("/v1/chat/completions").json() == {"ok": True}
