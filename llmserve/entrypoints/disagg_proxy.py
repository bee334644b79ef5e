"""``llmserve disagg-proxy``: disaggregated prefill in front of two servers (vLLM's
disaggregated-prefill proxy pattern, ``examples/.../disagg_proxy``).

Each ``/v1/completions`` or ``/v1/chat/completions`` request (also ``/chat/completions``,
and llama-server's ``/completion``, ``/completions`` and ``/infill``) goes first to the prefill
instance (a ``llmserve serve`` with ``kv_role: kv_producer``) with ``max_tokens=1`` and no
streaming, which computes the prompt's KV and saves its full blocks through its KV
connector; then the original request goes to the decode instance (``kv_role:
kv_consumer`` over the same store), which loads those blocks instead of prefilling them and
answers. With ``SharedStorageConnector`` on one host the store is a folder (``/dev/shm/...``
keeps it in shared memory).

Failures never lose a request: a prefill instance that is down, slow (past
``--prefill-timeout`` seconds) or answers an error is logged and skipped, and the decode
instance prefills by itself (it loads whatever blocks are there, computes the rest).
Other routes (``/v1/models``, ``/health``, ...) are forwarded to the decode instance.
"""

import argparse
import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

# The generation routes whose prompt the prefill instance computes first: vLLM's proxy's two,
# the main server's alias of chat (``/chat/completions``, llama-server's), and llama-server's
# native ``/completion`` (also ``/completions``) and ``/infill``, whose budget is ``n_predict``.
_OPENAI_PREFILL_ROUTES = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
_LLAMA_PREFILL_ROUTES = ("/completion", "/completions", "/infill")
_PREFILL_ROUTES = _OPENAI_PREFILL_ROUTES + _LLAMA_PREFILL_ROUTES
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def prefill_body(body: dict, path: str) -> dict:
    """The request the prefill instance gets: the same prompt, one token, no stream. Every
    budget field the route reads is 1: ``max_tokens``, chat's ``max_completion_tokens``,
    and on llama-server's routes ``n_predict`` (which wins over its aliases)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of")}
    out["max_tokens"] = 1
    if path.endswith("chat/completions"):
        out["max_completion_tokens"] = 1
    if path in _LLAMA_PREFILL_ROUTES:
        out["n_predict"] = 1
    return out


def build_app(prefill_url: str, decode_url: str, prefill_timeout: float = 60.0) -> Any:
    """The proxy's FastAPI app; ``prefill_url`` / ``decode_url``: the two servers' roots
    (``http://host:port``)."""
    import aiohttp
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    app = FastAPI(title="llmserve disaggregated-prefill proxy")
    state: dict[str, Any] = {}

    @app.on_event("startup")
    async def _start() -> None:
        state["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    @app.on_event("shutdown")
    async def _stop() -> None:
        await state["session"].close()

    async def _prefill(path: str, body: dict, headers: dict) -> None:
        try:
            async with state["session"].post(prefill_url + path, json=prefill_body(body, path), headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=prefill_timeout)) as r:
                await r.read()
                if r.status != 200:
                    logger.warning("prefill instance answered %d for %s; the decode instance prefills", r.status, path)
        except Exception as e:  # down, torn, slow: the decode instance computes the prompt itself
            logger.warning("prefill instance failed (%s: %s); the decode instance prefills", type(e).__name__, e)

    async def _forward(request: Request, path: str, body: Optional[bytes]) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS | {"host"}}
        resp = await state["session"].request(request.method, decode_url + path, data=body, headers=headers,
                                               params=request.query_params)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            async def chunks():
                try:
                    async for chunk in resp.content.iter_any():
                        yield chunk
                finally:
                    resp.release()
            return StreamingResponse(chunks(), status_code=resp.status, headers=out_headers)
        data = await resp.read()
        resp.release()
        return Response(data, status_code=resp.status, headers=out_headers)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def _route(path: str, request: Request) -> Response:
        path = "/" + path
        raw = await request.body() if request.method != "GET" else None
        if request.method == "POST" and path in _PREFILL_ROUTES:
            import json

            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = None
            if isinstance(body, dict):
                auth = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-api-key")}
                await _prefill(path, body, auth)
        try:
            return await _forward(request, path, raw)
        except aiohttp.ClientError as e:  # the decode instance is down: say so, never a 500
            from fastapi.responses import JSONResponse

            return JSONResponse({"error": {"message": f"decode instance unreachable: {e}", "type": "BadGateway",
                                           "param": None, "code": 502}}, status_code=502)

    return app


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``llmserve disagg-proxy`` (flag names of vLLM's toy proxy server)."""
    p = subparsers.add_parser("disagg-proxy", help="Disaggregated-prefill proxy in front of a prefill and a "
                              "decode server (KV moved by their connector).", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefiller-host", default="127.0.0.1")
    p.add_argument("--prefiller-port", type=int, required=True)
    p.add_argument("--decoder-host", default="127.0.0.1")
    p.add_argument("--decoder-port", type=int, required=True)
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="Seconds the prefill instance gets before the decode instance prefills instead.")
    p.set_defaults(dispatch=run)


def run(args: argparse.Namespace) -> None:
    import uvicorn

    app = build_app(f"http://{args.prefiller_host}:{args.prefiller_port}",
                    f"http://{args.decoder_host}:{args.decoder_port}", args.prefill_timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
