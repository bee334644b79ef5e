"""vLLM's tool-calling and reasoning flags of ``vllm serve`` (``--enable-auto-tool-choice``,
``--tool-call-parser``, ``--tool-parser-plugin``, ``--exclude-tools-when-tool-choice-none``, ``--reasoning-parser``):
their arguments, their checks, and how they configure the chat handler."""
from __future__ import annotations

import argparse
from typing import Any


def add_tool_calling_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags (each one the parser does not have yet: ``--reasoning-parser`` may
    come from the engine's arguments)."""
    from llmserve.reasoning import ReasoningParserManager
    from llmserve.tool_parsers import ToolParserManager

    group = parser.add_argument_group("tool calling and reasoning")
    have = parser._option_string_actions
    if "--enable-auto-tool-choice" not in have:
        group.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                           help='Allow tool_choice "auto": the model decides when to call tools and '
                                "--tool-call-parser finds the calls in its output.")
    if "--tool-call-parser" not in have:
        group.add_argument("--tool-call-parser", type=str, default=None,
                           help="The format of the model's tool calls (with --enable-auto-tool-choice): one of "
                                + ", ".join(ToolParserManager.list_registered()) + ".")
    if "--tool-parser-plugin" not in have:
        group.add_argument("--tool-parser-plugin", type=str, default="",
                           help="A Python file that registers tool parsers with "
                                "@ToolParserManager.register_module(NAME) (from llmserve.tool_parsers; "
                                "vLLM's plugins import it from vllm); its names are then valid "
                                "--tool-call-parser values.")
    if "--exclude-tools-when-tool-choice-none" not in have:
        group.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction,
                           default=False,
                           help='With tool_choice "none", do not show the tools to the chat template.')
    if "--reasoning-parser" not in have:
        group.add_argument("--reasoning-parser", type=str, default="",
                           help="Split reasoning models' output into reasoning (message.reasoning and "
                                "reasoning_content) and content: one of "
                                + ", ".join(ReasoningParserManager.list_registered()) + ".")


def validate_tool_calling_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for an unknown parser, or
    ``--enable-auto-tool-choice`` without ``--tool-call-parser`` (vLLM's check)."""
    from llmserve.reasoning import ReasoningParserManager
    from llmserve.tool_parsers import ToolParserManager

    plugin = getattr(args, "tool_parser_plugin", None)
    if plugin and len(plugin) > 3:  # vLLM's test: shorter values (e.g. "") mean none
        try:
            ToolParserManager.import_tool_parser(plugin)
        except ValueError as e:
            raise ValueError(f"--tool-parser-plugin: {e}") from None
    parser = getattr(args, "tool_call_parser", None)
    if getattr(args, "enable_auto_tool_choice", False) and not parser:
        raise ValueError("When --enable-auto-tool-choice is set, --tool-call-parser must be set too.")
    if parser and parser not in ToolParserManager.list_registered():
        raise ValueError(f"--tool-call-parser {parser!r} is not registered; choose one of "
                         f"{ToolParserManager.list_registered()}.")
    reasoning = getattr(args, "reasoning_parser", None)
    if reasoning and reasoning not in ReasoningParserManager.list_registered():
        raise ValueError(f"--reasoning-parser {reasoning!r} is not registered; choose one of "
                         f"{ReasoningParserManager.list_registered()}.")


def configure_tool_calling(handler: Any, args: argparse.Namespace) -> None:
    """Give the chat handler its parsers from the flags. Raises ValueError when the
    reasoning parser does not fit the tokenizer (no think tokens), as vLLM at start."""
    from llmserve.reasoning import ReasoningParserManager
    from llmserve.tool_parsers import ToolParserManager

    validate_tool_calling_args(args)
    handler.enable_auto_tools = bool(getattr(args, "enable_auto_tool_choice", False))
    name = getattr(args, "tool_call_parser", None)
    handler.tool_parser_cls = ToolParserManager.get_tool_parser(name) if name else None
    handler.exclude_tools_when_tool_choice_none = bool(getattr(args, "exclude_tools_when_tool_choice_none", False))
    reasoning = getattr(args, "reasoning_parser", None)
    if reasoning:
        cls = ReasoningParserManager.get_reasoning_parser(reasoning)
        cls(handler.tokenizer)  # fails now, not on the first request, for a tokenizer without the markers
        handler.reasoning_parser_cls = cls
