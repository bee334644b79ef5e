"""The ``openai`` client's less common Responses paths on the shared ``server``:
``responses.input_tokens.count`` (``POST /v1/responses/input_tokens``), ``responses.compact``
(not served: a 404 that says so) and ``item_reference`` input items; OpenAI's
``allowed_tools`` tool choice on chat and Responses.

Before these, the two POST paths fell into ``/v1/responses/{response_id}`` and answered
405 "allowed: DELETE, GET", an ``item_reference`` was a 400 "not supported", and an
``allowed_tools`` choice a 400 ("tool_choice.type: must be 'function'").
"""
import openai
import pytest

from e2e_utils import MODEL


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_input_tokens_count_equals_the_responses_prompt(client):
    kwargs = dict(model=MODEL, input="What is 2+2?", instructions="Answer briefly.")
    count = client.responses.input_tokens.count(**kwargs)
    assert count.object == "response.input_tokens"
    made = client.responses.create(**kwargs, max_output_tokens=1, temperature=0)
    assert count.input_tokens == made.usage.input_tokens > 5
    # the conversation of previous_response_id counts too, input or not
    follow = client.responses.input_tokens.count(model=MODEL, input="And 3+3?", previous_response_id=made.id)
    made2 = client.responses.create(model=MODEL, input="And 3+3?", previous_response_id=made.id, max_output_tokens=1)
    assert follow.input_tokens == made2.usage.input_tokens > count.input_tokens
    assert client.responses.input_tokens.count(model=MODEL, previous_response_id=made.id).input_tokens > 0
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model=MODEL, previous_response_id="resp_unknown")
    with pytest.raises(openai.BadRequestError, match="input"):
        client.responses.input_tokens.count(model=MODEL)


def test_compact_is_a_404_that_says_so(client):
    with pytest.raises(openai.NotFoundError, match="compact"):
        client.responses.compact(model=MODEL, input="Summarise this.")


def test_item_reference_reads_the_stored_item(client):
    first = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0)
    said = first.output[0]
    by_ref = client.responses.create(
        model=MODEL, max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": "Name a colour."}, {"type": "item_reference", "id": said.id},
               {"role": "user", "content": "Another?"}])
    whole = client.responses.create(
        model=MODEL, max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": said.content[0].text}, {"role": "user", "content": "Another?"}])
    assert by_ref.usage.input_tokens == whole.usage.input_tokens
    assert by_ref.output_text == whole.output_text
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, max_output_tokens=2,
                                input=[{"type": "item_reference", "id": "msg_does_not_exist"}])
    assert e.value.body["param"] == "input.0.id" and "msg_does_not_exist" not in e.value.body["message"]


def _fn(name: str) -> dict:
    return {"name": name, "description": f"The {name.split('_')[1]} of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


CHAT_TOOLS = [{"type": "function", "function": _fn("get_weather")}, {"type": "function", "function": _fn("get_time")}]
RESPONSES_TOOLS = [{"type": "function", **_fn("get_weather")}, {"type": "function", **_fn("get_time")}]
ASK = "What is the weather in Paris?"


def test_allowed_tools_choice_limits_the_calls(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}})
    assert [c.function.name for c in chat.choices[0].message.tool_calls] == ["get_time"]
    made = client.responses.create(
        model=MODEL, input=ASK, tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=60,
        tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]})
    assert [item.name for item in made.output if item.type == "function_call"] == ["get_time"]
    assert made.tool_choice.type == "allowed_tools"  # echoed as sent


def test_allowed_tools_choice_errors_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, max_tokens=2,
            tool_choice={"type": "allowed_tools", "allowed_tools": {
                "mode": "required", "tools": [{"type": "function", "function": {"name": "get_news"}}]}})
    assert e.value.body["param"] == "tool_choice.allowed_tools.tools.0" and "get_news" not in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=2,
                                tool_choice={"type": "allowed_tools", "mode": "sometimes",
                                             "tools": [{"type": "function", "name": "get_time"}]})
    assert e.value.body["param"] == "tool_choice.mode"
