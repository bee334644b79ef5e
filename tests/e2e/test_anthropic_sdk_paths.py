"""The ``anthropic`` SDK's less common paths on the shared ``server``.

Message threads (beta ``message-threads-2026-08-12``, ``thread`` on ``/v1/messages``): the
SDK's tool runner (threaded by default) and ``client.beta.messages.thread()`` send only
each turn's new messages, so the server must keep the conversation (``anthropic/threads.py``).
``models.list()`` / ``retrieve()``: ``max_input_tokens`` and ``max_tokens`` (the SDK's
``ModelInfo`` fields; Claude Code 2.1.197 has a reader for them behind a switch), and
Anthropic's paging (``after_id``, ``before_id``, ``limit``). Compaction (beta
``compact-2026-01-12``, ``compaction`` on ``/v1/messages``): the summary block, streamed
or not, and read back as text (``anthropic/compaction.py``). ``mcp_servers`` (the MCP
connector): a 400 naming it, as Anthropic's other server-run tools.

Greedy decoding on the float32 server is batch-invariant: a thread's turn must equal the
same conversation sent whole.
"""
import anthropic
import pytest

from e2e_utils import API_KEY, MODEL
from test_anthropic_messages import prompt_of

GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url_root, api_key=API_KEY, max_retries=0, timeout=300)


def test_tool_runner_round_trip_keeps_the_conversation(client):
    # The runner's second request holds only the tool_result (and `thread: continue`):
    # without a kept conversation it was a 400 ("unexpected `tool_use_id` found in
    # `tool_result` blocks"), so the SDK's tool loop stopped at its first tool call.
    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """The weather of a city.

        Args:
            city: the city
        """
        return f"Sunny in {city}."

    sent = []
    runner = client.beta.messages.tool_runner(
        model=MODEL, max_tokens=40, tools=[get_weather], tool_choice={"type": "any"}, max_iterations=2,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}], extra_body=GREEDY)
    for message in runner:
        sent.append(message)
    assert [m.stop_reason for m in sent] == ["tool_use", "tool_use"]
    assert all(b.type == "tool_use" and b.name == "get_weather" for m in sent for b in m.content)
    # the second turn's prompt held the first turn (user, tool_use, tool_result), not only the result
    first, second = (prompt_of(m.usage) for m in sent)
    assert second > first + 10


@pytest.mark.parametrize("stream", [False, True])
def test_thread_turn_equals_the_whole_conversation(client, stream):
    thread = client.beta.messages.thread(model=MODEL, max_tokens=12, system="Answer briefly.", extra_body=GREEDY)
    user1 = {"role": "user", "content": "My name is Ada. Say hello."}
    user2 = {"role": "user", "content": "What is my name?"}
    if stream:
        with thread.stream(user1) as s:
            reply1 = s.get_final_message()
        with thread.stream(user2) as s:
            reply2 = s.get_final_message()
    else:
        reply1 = thread.send(user1)
        reply2 = thread.send(user2)
    assert thread.previous_message_id == reply2.id
    whole = client.messages.create(model=MODEL, max_tokens=12, system="Answer briefly.", extra_body=GREEDY,
                                   messages=[user1, {"role": "assistant", "content": reply1.content[0].text},
                                             user2])
    assert reply2.content[0].text == whole.content[0].text
    total = lambda m: prompt_of(m.usage)  # noqa: E731
    assert total(reply2) == total(whole)


def test_unknown_thread_is_thread_not_found_and_the_sdk_replays(server, client):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            "thread": {"type": "continue", "previous_message_id": "msg_0123456789abcdef"}}
    r = server.post("/v1/messages", body)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["type"] == "not_found_error" and error["details"] == {"error_code": "thread_not_found"}
    assert "thread.previous_message_id" in error["message"] and "0123456789abcdef" not in error["message"]


def test_a_message_is_continued_once_and_the_sdk_replays(server, client):
    # Continuing the same previous_message_id twice silently branched the thread; Anthropic
    # answers 400 thread_already_continued (the SDK's ThreadAlreadyContinuedError), on
    # which the SDK's thread sends the whole history again under a new thread.
    hi = [{"role": "user", "content": "Hi"}]
    first = server.post("/v1/messages", {"model": MODEL, "max_tokens": 1, "thread": {"type": "create"},
                                         "messages": hi})
    assert first.status_code == 200, first.text
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Again"}],
            "thread": {"type": "continue", "previous_message_id": first.json()["id"]}}
    assert server.post("/v1/messages", body).status_code == 200
    with pytest.raises(anthropic.types.ThreadAlreadyContinuedError) as again:  # the check runs before a stream
        client.beta.messages.create(model=MODEL, max_tokens=1, **{k: body[k] for k in ("messages", "thread")},
                                    betas=["message-threads-2026-08-12"], stream=True)
    error = again.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["details"] == {"error_code": "thread_already_continued"}
    assert error["message"].startswith("thread.previous_message_id: ")
    # a continue that failed (here a 400 before generating) gives its id back
    fresh = server.post("/v1/messages", {"model": MODEL, "max_tokens": 1, "thread": {"type": "create"},
                                         "messages": hi}).json()["id"]
    bad = {**body, "thread": {"type": "continue", "previous_message_id": fresh}, "temperature": 2}
    assert server.post("/v1/messages", bad).status_code == 400
    again = {**body, "thread": {"type": "continue", "previous_message_id": fresh}}
    assert server.post("/v1/messages", again).status_code == 200


def test_continue_in_flight_and_released_claims():
    from llmserve.entrypoints.anthropic.threads import (MessageThreadStore, StoredThread,
                                                        ThreadContinueInFlightError)
    store = MessageThreadStore()
    store.put("msg_a", StoredThread(system=None, tools=None, messages=[]))
    store.claim("msg_a")
    with pytest.raises(ThreadContinueInFlightError):
        store.get("msg_a")
    store.settle("msg_a", continued=False)
    assert store.claim("msg_a") is not None


@pytest.mark.parametrize("field, value", [("system", "Be brief."), ("tools", [WEATHER])])
def test_continue_refuses_the_create_only_fields(server, field, value):
    first = server.post("/v1/messages", {"model": MODEL, "max_tokens": 2, "thread": {"type": "create"},
                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert first.status_code == 200, first.text
    body = {"model": MODEL, "max_tokens": 2, field: value, "messages": [{"role": "user", "content": "Again"}],
            "thread": {"type": "continue", "previous_message_id": first.json()["id"]}}
    r = server.post("/v1/messages", body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field}: "), r.text


@pytest.mark.parametrize("thread, param", [("create", "thread"), ({"type": "fork"}, "thread.type"),
                                           ({"type": "continue"}, "thread.previous_message_id")])
def test_malformed_thread_is_a_400_naming_it(server, thread, param):
    r = server.post("/v1/messages", {"model": MODEL, "max_tokens": 2, "thread": thread,
                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{param}: "), r.text


def test_models_carry_the_context_window(client, server):
    limit = server.http.get("/v1/models").json()["data"][0]["max_model_len"]
    for info in (client.models.list().data[0], client.models.retrieve(MODEL)):
        assert info.max_input_tokens == info.max_tokens == limit - 1


def test_models_list_pages_as_anthropic_does(client):
    # after_id / before_id / limit were ignored: the page after the only model held it again
    assert client.models.list(after_id=MODEL).data == []
    assert client.models.list(before_id=MODEL).data == []
    page = client.models.list(limit=1)
    assert [m.id for m in page.data] == [MODEL] and page.has_more is False
    with pytest.raises(anthropic.BadRequestError, match="limit"):
        client.models.list(limit=0)


CONVERSATION = [{"role": "user", "content": "My name is Ada and I like green."},
                {"role": "assistant", "content": "Nice to meet you, Ada!"},
                {"role": "user", "content": "What do I like?"}]


def test_compaction_answers_with_the_summary_block(client):
    # `compaction` was an ignored unknown field: the model answered the last turn as a text
    # block (stop_reason end_turn / max_tokens), and the SDK's runner kept the whole history
    kwargs = dict(model=MODEL, max_tokens=24, messages=CONVERSATION, compaction={"type": "summarize"},
                  betas=["compact-2026-01-12"], extra_body=GREEDY)
    made = client.beta.messages.create(**kwargs)
    assert made.stop_reason == "compaction" and [b.type for b in made.content] == ["compaction"]
    assert made.content[0].content and made.usage.output_tokens >= 1
    with client.beta.messages.stream(**kwargs) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "compaction" and streamed.content[0].content == made.content[0].content
    # sent back first in messages, the block stands for the conversation it summarises
    after = [made.to_param(), {"role": "user", "content": "Go on."}]
    went_on = client.beta.messages.create(model=MODEL, max_tokens=4, messages=after, extra_body=GREEDY)
    failed = [{"role": "assistant", "content": [{"type": "compaction", "content": None}]}, after[1]]
    no_op = client.beta.messages.create(model=MODEL, max_tokens=4, messages=failed, extra_body=GREEDY)
    total = lambda m: prompt_of(m.usage)  # noqa: E731
    assert went_on.stop_reason in ("end_turn", "max_tokens") and total(went_on) > total(no_op) + 5


def test_malformed_compaction_is_a_400_naming_it(server):
    for compaction, param in (("summarize", "compaction"), ({"type": "shorten"}, "compaction.type"),
                              ({"type": "summarize", "instructions": 5}, "compaction.instructions")):
        r = server.post("/v1/messages", {"model": MODEL, "max_tokens": 2, "compaction": compaction,
                                         "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{param}: "), r.text


def test_mcp_servers_are_refused_naming_the_field(client):
    # the MCP connector's servers were an ignored unknown field: the model answered
    # without the tools the client meant it to have
    with pytest.raises(anthropic.BadRequestError, match="mcp_servers"):
        client.beta.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                                    mcp_servers=[{"type": "url", "url": "https://example.com/sse", "name": "ex"}],
                                    betas=["mcp-client-2025-11-20"])
    # an empty list asks for nothing
    made = client.beta.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                                       mcp_servers=[])
    assert made.usage.output_tokens >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_cut_by_max_tokens_is_stop_reason_max_tokens(client, server, stream):
    # Anthropic answers a tool_use cut by max_tokens with a 200 and stop_reason
    # "max_tokens" (the client retries with more); it was a 400 after generating. The
    # OpenAI route keeps vLLM's 400 naming max_tokens.
    ask = dict(model=MODEL, max_tokens=8, tools=[WEATHER], tool_choice={"type": "any"}, extra_body=GREEDY,
               messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    if stream:
        with client.messages.stream(**ask) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**ask)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    openai_tool = {"type": "function", "function": {"name": WEATHER["name"], "parameters": WEATHER["input_schema"]}}
    r = server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 8, "tools": [openai_tool],
                                             "tool_choice": "required", "messages": ask["messages"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
