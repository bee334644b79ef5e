"""Command-line flags of the OpenAI server (vLLM's ``make_arg_parser``): server flags plus
every engine flag generated from :class:`~llmserve.engine_args.AsyncEngineArgs`."""
from __future__ import annotations

import argparse
import json
import re
from typing import Optional

from llmserve.engine_args import AsyncEngineArgs
from llmserve.entrypoints.openai.chat_completion.tool_args import add_tool_calling_args, validate_tool_calling_args
from llmserve.entrypoints.openai.vllm_compat_args import (add_vllm_aliases, add_vllm_compat_args,
                                                         add_vllm_frontend_args, check_vllm_compat_args)
from llmserve import envs
from llmserve.entrypoints.openai.frontend import add_http_edge_args, check_http_edge_args
from llmserve.entrypoints.openai.responses.store import add_responses_args, check_responses_args
from llmserve.entrypoints.openai.models.lora_router import add_lora_serving_args
from llmserve.entrypoints.openai.multi_model import parse_extra_model
from llmserve.entrypoints.openai.tenants import load_keys_file
from llmserve.entrypoints.template_sandbox import add_request_template_args, check_request_template_args
from llmserve.entrypoints.web.webui import add_webui_args

API_KEY_ENV = "LLMSERVE_API_KEY"
_UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _json_list(value: str) -> list[str]:
    """Parse ``'["a", "b"]'`` (vLLM's format) or a comma-separated list."""
    value = value.strip()
    if value.startswith("["):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {value!r} ({e})") from e
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return parsed
    return [v.strip() for v in value.split(",") if v.strip()]


class _ApiKeysAction(argparse.Action):
    """``--api-key A B --api-key C``: all three keys (a flag given replaces the
    environment's default key, each later one adds to it)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, (current if isinstance(current, list) else []) + list(values))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help text already says it (``(default ...``)
    or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def make_arg_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    """Add the server flags and the engine flags to ``parser`` (a new one if None).

    The optional positional ``model_tag`` (``llmserve serve MODEL``) overrides ``--model``.
    """
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="llmserve serve",
            description="Start the OpenAI-compatible HTTP server.",
            formatter_class=HelpFormatter)
    parser.add_argument("model_tag", nargs="?", default=None,
                        help="The model to serve (same as --model; wins over it when both are given).")
    server = parser.add_argument_group("server")
    server.add_argument("--host", type=str, default=None, help="Host to bind (default: all interfaces).")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument("--api-key", type=str, nargs="+", action=_ApiKeysAction, default=envs.get(API_KEY_ENV),
                        help=f"Require one of these keys, as 'Authorization: Bearer <key>' (vLLM) or 'x-api-key: "
                             f"<key>' (Anthropic), on every route but the probes, /version, /metrics, /load and the "
                             f"API docs (default: ${API_KEY_ENV} or $VLLM_API_KEY when set). Repeatable; these keys "
                             f"are the 'default' tenant (named tenants: --api-keys-file).")
    server.add_argument("--api-keys-file", type=str, default=None, metavar="PATH",
                        help="API keys of named tenants (beyond vLLM): a JSON list of {\"key\", \"tenant\", "
                             "\"weight\", \"max_concurrent_requests\", \"max_tokens_per_second\", \"burst_tokens\", "
                             "\"allowed_models\"} (only key is required). Each tenant gets its weighted fair share "
                             "of the engine (--no-tenant-fair-share: off), its own quotas (429 + Retry-After) and "
                             "sees only its own stored responses. Re-read on SIGHUP; the tenant name, never the "
                             "key, is logged and labels /metrics.")
    server.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS allowed origins.")
    server.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS allowed methods.")
    server.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS allowed headers.")
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    server.add_argument("--uvicorn-log-level", type=str, default="info", choices=_UVICORN_LOG_LEVELS,
                        help="Log level of uvicorn.")
    server.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="Do not log one line per HTTP request.")
    server.add_argument("--timeout-graceful-shutdown", type=float, default=10.0,
                        help="On SIGINT/SIGTERM, seconds to let in-flight requests finish before "
                             "they are aborted.")
    server.add_argument("--root-path", type=str, default=None, help="ASGI root_path behind a path-based proxy.")
    server.add_argument("--api-server-count", type=int, default=1,
                        help="API-server processes sharing the engine and one listening socket (vLLM's): "
                             "for front-end-bound loads (many clients, short outputs). /metrics is one view "
                             "over all of them; each response names its process in X-API-Server-Index.")
    server.add_argument("--extra-model", type=parse_extra_model, action="append", default=None,
                        metavar="MODEL[:RUNNER]|JSON",
                        help="Serve another model from this server, in its own engine, chosen per request by "
                             "`model` (beyond vLLM), e.g. `--extra-model all-MiniLM-L6-v2` next to a chat model. "
                             "RUNNER: auto, generate or pooling; or a JSON object of engine fields "
                             "('{\"model\": \"SmolLM2-135M-Instruct\", \"runner\": \"pooling\", "
                             "\"served_model_name\": \"smol-embed\"}'). The extra engine shares this "
                             "server's resource flags (--kv-cache-memory, batching, --dtype), not its model flags. "
                             "Repeatable.")
    add_vllm_frontend_args(server)
    add_lora_serving_args(server)
    add_request_template_args(server)
    add_http_edge_args(server)
    add_responses_args(server)
    add_webui_args(server)
    AsyncEngineArgs.add_cli_args(parser)
    add_tool_calling_args(parser)  # after the engine's: --reasoning-parser may be an engine field
    # every other `vllm serve` flag: a no-op or refused with its reason, never "unrecognized"
    add_vllm_compat_args(parser)
    add_vllm_aliases(parser)
    return parser


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    """Apply ``model_tag`` to ``model`` and check the server flags. Raises ValueError
    (naming the flag) for a bad value or a refused vLLM flag."""
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {args.port}")
    if args.api_server_count < 1:
        raise ValueError(f"api_server_count must be >= 1, got {args.api_server_count}")
    if isinstance(args.api_key, list):  # several keys (vLLM); one stays a string
        keys = [k for k in args.api_key if k]
        args.api_key = keys if len(keys) > 1 else (keys[0] if keys else None)
    if args.api_key is not None and args.api_key == "":
        args.api_key = None
    if getattr(args, "api_keys_file", None):
        load_keys_file(args.api_keys_file)  # a bad file stops the start (ValueError / OSError)
    check_vllm_compat_args(args)
    check_request_template_args(args)
    validate_tool_calling_args(args)
    check_http_edge_args(args)
    check_responses_args(args)


def cli_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[str, bool]]:
    """Each option's dest -> (the flag a user types, whether it is a switch: ``--x`` /
    ``--no-x`` or ``store_true``). The flag is ``--`` + dest with ``-`` for ``_`` (how
    :meth:`AsyncEngineArgs.add_cli_args` spells every engine field) when the parser has it,
    else the option's first long spelling (``--api-key`` for ``api_key``)."""
    flags: dict[str, tuple[str, bool]] = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if not longs or action.dest in ("help", argparse.SUPPRESS):
            continue
        own = "--" + action.dest.replace("_", "-")
        if action.dest in flags and flags[action.dest][0] == own:
            continue  # an alias (add_vllm_aliases) of a flag already named
        switch = isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0
        flags[action.dest] = (own if own in longs else longs[0], switch)
    return flags


def flag_message(message: str, parser: Optional[argparse.ArgumentParser] = None) -> str:
    """A start-up error ``message`` as the command line's user reads it: the engine's and
    the configs' errors name the dataclass field (``kv_cache_dtype='int4'``, right for
    ``LLM(...)``), which the CLI user never typed; here each becomes the flag
    (``--kv-cache-dtype int4``; a switch's ``=True`` / ``=False`` ``--x`` / ``--no-x``; a
    field of a JSON flag ``kv_events_config.topic`` ``topic in --kv-events-config``).

    Fields with an underscore are renamed wherever they appear as a word; one-word fields
    (``model``, ``dtype``, ``port``) only as ``name=value`` or opening the message
    (``dtype: ...``, ``port must ...``), where they cannot be the plain English word.
    ``parser``: the serve parser (built when None: only on the error path)."""
    flags = cli_flags(parser if parser is not None else make_arg_parser(argparse.ArgumentParser()))
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.-])(?P<name>{names})(?:\.(?!json\b)(?P<sub>\w+))?"
                         rf"(?:=(?P<value>'[^']*'|\"[^\"]*\"|[^\s,;)]*[^\s,;).]))?(?![\w-]|\.json\b)")

    def rename(m: re.Match) -> str:
        name, sub, value = m.group("name", "sub", "value")
        at_start = m.start() == 0 and re.match(r"(:| must\b)", message[m.end():])
        if "_" not in name and value is None and not at_start:
            return m.group(0)  # the English word ("the model ..."), not the flag
        flag, switch = flags[name]
        if sub:
            return f"{sub} in {flag}"
        if value is None:
            return flag
        if switch and value in ("True", "False"):
            return flag if value == "True" else "--no-" + flag[2:]
        if value[:1] in "'\"" and value[1:-1] and not re.search(r"\s", value):
            value = value[1:-1]  # as typed: --kv-cache-dtype int4
        return f"{flag} {value}"
    return pattern.sub(rename, message)
