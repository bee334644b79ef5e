"""Issue 26 points 4, 5 and 7 against the shared real server (``server`` fixture): a
prompt of whitespace is refused without tokenizing, two requests with one X-Request-Id
store two distinct responses, deep JSON and 100k prompts are 400s naming the field, and
the server answers normally afterwards."""
import json

from e2e_utils import MODEL


def assert_error(r, status, param):
    assert r.status_code == status and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    return err


def test_whitespace_prompts_are_refused_before_tokenizing(server):
    spaces = " " * (6 * 1024 * 1024)  # 6 MiB of spaces: ~100k tokens, far past the context
    for path, body, param in (("/v1/completions", {"model": MODEL, "prompt": "a" + spaces, "max_tokens": 1},
                               "prompt"),
                              ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
                                  {"role": "user", "content": "a" + spaces + "b"}]}, "messages"),
                              ("/tokenize", {"model": MODEL, "prompt": "\n\t" * (1024 * 1024)}, "prompt")):  # escaped: 4 MiB
        err = assert_error(server.post(path, body), 400, param)
        assert "cannot fit" in err["message"]
    server.assert_healthy()


def test_one_x_request_id_two_distinct_stored_responses(server):
    headers = {"X-Request-Id": "same-id-26"}
    ids = []
    for text in ("Say one.", "Say two."):
        r = server.post("/v1/responses", {"model": MODEL, "input": text, "max_output_tokens": 3}, headers=headers)
        assert r.status_code == 200 and r.headers["x-request-id"] == "same-id-26", r.text
        ids.append(r.json()["id"])
    assert ids[0] != ids[1] and not any("same-id-26" in i for i in ids)
    for i, text in zip(ids, ("Say one.", "Say two.")):
        got = server.http.get(f"/v1/responses/{i}")
        assert got.status_code == 200 and got.json()["id"] == i


def test_deep_json_and_many_prompts_are_400s(server):
    deep = json.loads("[" * 500 + "]" * 500)
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert_error(server.post("/invocations", {**chat, "extra": deep}), 400, "extra")
    schema = {"type": "string"}
    for _ in range(450):
        schema = {"type": "object", "properties": {"a": schema}}
    assert_error(server.post("/v1/chat/completions", {**chat, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}), 400, "response_format")
    err = assert_error(server.post("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 100_000, "max_tokens": 1}),
                       400, "prompt")
    assert "1024" in err["message"]
    assert_error(server.post("/detokenize", {"model": MODEL, "tokens": ["1", True]}), 400, "tokens.0")
    assert_error(server.post("/v1/chat/completions", {**chat, "messages": [{"role": ""}]}), 400, "messages.0.role")
    server.assert_healthy()
