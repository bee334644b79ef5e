"""Tool-call parsers (vLLM's ``tool_parsers``): ``ToolParserManager.get_tool_parser(name)``
returns a :class:`ToolParser` class, built with the tokenizer. Registered: ``hermes``,
``llama3_json`` (alias ``llama4_json``), ``mistral``, ``pythonic``."""
from llmserve.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
from llmserve.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from llmserve.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from llmserve.tool_parsers.mistral_tool_parser import MistralToolParser
from llmserve.tool_parsers.pythonic_tool_parser import PythonicToolParser

__all__ = ["ToolParser", "ToolParserManager", "Hermes2ProToolParser", "Llama3JsonToolParser",
           "MistralToolParser", "PythonicToolParser"]
