"""Tool calls whose arguments the model wrote as a JSON string holding the object
(vLLM PR 54964: Granite 4 writes ``"arguments": "{\\"param\\": ...}"``; the hermes parser
encoded that string once more, so clients decoded a string, not an object, and the
arguments were lost). The arguments are the object, whole and streamed alike; an empty
string is ``{}``; a string holding no object leaves the output as content."""
from __future__ import annotations

import json

import pytest

from llmserve.tool_parsers import ToolParserManager
from test_tool_parsers import check_streaming_equals_whole, stream

STRINGIFIED = ('<tool_call>\n{"name": "get_db_config", "arguments": "{\\n  \\"param\\": \\"max_connections\\",'
               ' \\"city\\": \\"Zürich\\"\\n}"}\n</tool_call>')


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_arguments_written_as_a_json_string_are_the_object(parser):
    make = lambda: ToolParserManager.get_tool_parser(parser)(None)
    text = {"hermes": STRINGIFIED,
            "llama3_json": '{"name": "get_db_config", "parameters": "{\\"param\\": \\"max_connections\\"}"}',
            "mistral": '[TOOL_CALLS][{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}]',
            }[parser]
    info = check_streaming_equals_whole(make, text)
    assert info.tools_called and len(info.tool_calls) == 1, info
    args = json.loads(info.tool_calls[0].function.arguments)
    assert isinstance(args, dict) and args["param"] == "max_connections", args


def test_empty_string_arguments_are_an_empty_object_and_a_plain_string_is_content():
    make = lambda: ToolParserManager.get_tool_parser("hermes")(None)
    info = check_streaming_equals_whole(make, '<tool_call>\n{"name": "ping", "arguments": ""}\n</tool_call>')
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == [("ping", "{}")]
    text = '<tool_call>\n{"name": "ping", "arguments": "not json"}\n</tool_call>'
    info = make().extract_tool_calls(text, None)
    assert not info.tools_called and info.content == text
    # streamed, no argument fragment of the string is ever sent as if it were the object
    _, calls, _ = stream(make(), STRINGIFIED, list(range(1, len(STRINGIFIED))))
    assert json.loads(calls[0][2]) == {"param": "max_connections", "city": "Zürich"}
