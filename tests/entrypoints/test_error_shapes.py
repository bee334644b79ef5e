"""ErrorShapeMiddleware: JSON errors on a registered API's paths take that API's body."""
import json

from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.responses import JSONResponse, PlainTextResponse

from llmserve.entrypoints.openai.error_shapes import ErrorShape, ErrorShapeMiddleware


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/x/fail")
    def fail():
        body = {"error": {"message": "bad field", "type": "BadRequestError", "param": "f", "code": 400}}
        return JSONResponse(body, status_code=400)

    @app.get("/x/ok")
    def ok():
        return {"fine": True}

    @app.get("/x/text-error")
    def text_error():
        return PlainTextResponse("plain", status_code=500)

    @app.get("/v1/fail")
    def openai_fail():
        return JSONResponse({"error": {"message": "m", "type": "t", "param": None, "code": 400}}, status_code=400)

    shape = ErrorShape(("/x/",), lambda status, info: {"err": info["message"], "status": status})
    app.add_middleware(ErrorShapeMiddleware, shapes=[shape])
    return app


def test_registered_paths_get_their_shape_others_untouched():
    client = TestClient(_app())
    r = client.get("/x/fail")
    assert r.status_code == 400
    assert r.json() == {"err": "bad field", "status": 400}
    assert int(r.headers["content-length"]) == len(r.content)
    assert client.get("/x/ok").json() == {"fine": True}
    assert client.get("/x/text-error").text == "plain"  # not JSON: passed as it is
    assert client.get("/v1/fail").json()["error"]["message"] == "m"  # not registered


def test_non_openai_json_error_passes_unchanged():
    # FastAPI's bare 404 is not an OpenAI error body: nothing to reshape
    r = TestClient(_app()).get("/x/nothing-here")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


def test_covers_exact_prefix_and_subpaths():
    shape = ErrorShape(("/v1/messages", "/api/"), lambda s, i: i)
    assert shape.covers("/v1/messages") and shape.covers("/v1/messages/count_tokens")
    assert not shape.covers("/v1/messagesx") and shape.covers("/api/chat") and not shape.covers("/apix")
