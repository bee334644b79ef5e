"""``llmserve bench serve``: load-test a running OpenAI-compatible server (vLLM's
``vllm bench serve``).

Requests come from the random dataset (``datasets.sample_random_requests``, fixed seed;
token-id prompts on /v1/completions, so input lengths are exact), are sent with
``stream: true`` (and ``ignore_eos`` by default, so each produces exactly its output
length) at ``--request-rate`` requests/s (Poisson arrivals, or gamma with
``--burstiness``; ``inf`` sends all at once), with at most ``--max-concurrency`` in
flight. Per request it records TTFT (request sent -> first token), ITL (gaps between
streamed chunks), TPOT ((latency - TTFT) / (output tokens - 1)) and E2EL (latency).

Output: request throughput (req/s), output and total token throughput (tokens/s), and the
mean / median / p99 (by ``--metric-percentiles``) of TTFT, TPOT, ITL and E2EL in ms;
``--save-result`` writes them as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, AsyncIterator, Optional

import numpy as np

from llmserve.benchmarks.datasets import sample_random_requests

METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestFuncOutput:
    """One request's outcome: success, error text, latency (s), TTFT (s), ITL gaps (s),
    prompt_len and output_tokens (from the usage chunk, else the number of chunks)."""

    success: bool = False
    error: str = ""
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""


async def request_func(session: Any, api_url: str, model: str, prompt: Any, prompt_len: int, output_len: int,
                       chat: bool, extra_body: dict[str, Any], headers: dict[str, str]) -> RequestFuncOutput:
    """Send one streaming request and time its chunks. Never raises (errors are recorded)."""
    payload: dict[str, Any] = {"model": model, "max_tokens": output_len, "stream": True,
                               "stream_options": {"include_usage": True}, **extra_body}
    if chat:
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    out = RequestFuncOutput(prompt_len=prompt_len)
    chunks = 0
    texts: list[str] = []
    start = most_recent = time.perf_counter()
    try:
        async with session.post(api_url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    out.error = str(msg["error"])
                    return out
                now = time.perf_counter()
                for choice in msg.get("choices") or []:
                    text = choice.get("text") if not chat else (choice.get("delta") or {}).get("content")
                    if text:
                        if chunks == 0:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - most_recent)
                        most_recent = now
                        chunks += 1
                        texts.append(text)
                usage = msg.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    out.output_tokens = int(usage["completion_tokens"])
        out.latency = time.perf_counter() - start
        out.generated_text = "".join(texts)
        if not out.output_tokens:
            out.output_tokens = chunks
        out.success = chunks > 0 or out.output_tokens > 0
        if not out.success:
            out.error = "no tokens received"
    except Exception as e:  # connection errors, timeouts, bad JSON
        out.error = f"{type(e).__name__}: {e}"
    return out


async def responses_request_func(session: Any, api_url: str, model: str, prompt: Any, prompt_len: int,
                                 output_len: int, chat: bool, extra_body: dict[str, Any],
                                 headers: dict[str, str]) -> RequestFuncOutput:
    """:func:`request_func` for ``/v1/responses``: ``input`` and ``max_output_tokens``;
    the text comes in ``response.output_text.delta`` events and the token count in the
    terminal event's ``response.usage.output_tokens``. Never raises."""
    payload: dict[str, Any] = {"model": model, "input": prompt, "max_output_tokens": output_len, "stream": True,
                               "store": False, **extra_body}
    out = RequestFuncOutput(prompt_len=prompt_len)
    texts: list[str] = []
    start = most_recent = time.perf_counter()
    try:
        async with session.post(api_url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                msg = json.loads(line[5:].strip())
                kind = msg.get("type")
                if kind == "response.output_text.delta" and msg.get("delta"):
                    now = time.perf_counter()
                    if not texts:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - most_recent)
                    most_recent = now
                    texts.append(msg["delta"])
                elif kind in ("error", "response.failed"):
                    out.error = str(msg.get("message") or msg.get("response", {}).get("error"))
                    return out
                elif kind in ("response.completed", "response.incomplete"):
                    out.output_tokens = int(((msg["response"].get("usage") or {}).get("output_tokens")) or 0)
        out.latency = time.perf_counter() - start
        out.generated_text = "".join(texts)
        out.output_tokens = out.output_tokens or len(texts)
        out.success = out.output_tokens > 0
        if not out.success:
            out.error = "no tokens received"
    except Exception as e:  # connection errors, timeouts, bad JSON
        out.error = f"{type(e).__name__}: {e}"
    return out


async def _arrivals(requests: list[Any], request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> AsyncIterator[Any]:
    """Yield requests at Poisson (burstiness 1) or gamma-distributed intervals."""
    for i, req in enumerate(requests):
        yield req
        if request_rate == float("inf") or i == len(requests) - 1:
            continue
        theta = 1.0 / (request_rate * burstiness)
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


def _stats(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    arr = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(arr, p))
    return out


def calculate_metrics(outputs: list[RequestFuncOutput], duration_s: float,
                      percentiles: list[float]) -> dict[str, Any]:
    """Aggregate per-request outcomes into the benchmark result (times in ms)."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": total_out / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s > 0 else 0.0,
    }
    samples = {"ttft": [o.ttft for o in ok], "tpot": tpots, "itl": [x for o in ok for x in o.itl],
               "e2el": [o.latency for o in ok]}
    for name in METRICS:
        for stat, value in _stats(samples[name], percentiles).items():
            result[f"{stat}_{name}_ms"] = value
    errors = [o.error for o in outputs if not o.success]
    result["errors"] = errors[:20]
    return result


# What aiohttp raises when it sends on a pooled keep-alive connection that the server has
# already closed (llama-server's HTTP library, cpp-httplib, closes one after 5 idle seconds or
# 100 requests): the request never got an answer. Counting it as failed cost llama-server 6-22
# of 64 requests per level in benchmarks/llama_server_compare.py ("Can not write request
# body"); like urllib3 on a dropped pooled connection, send it once more on a fresh one.
_STALE_CONNECTION_ERRORS = ("ServerDisconnectedError", "ClientOSError")


def never_reached_server(out: RequestFuncOutput) -> bool:
    """True when ``out`` failed on a connection error before any response came back (no
    status, no token, no elapsed latency recorded), so sending the request again is safe."""
    return (not out.success and out.latency == 0.0 and out.ttft == 0.0
            and out.error.split(":", 1)[0] in _STALE_CONNECTION_ERRORS)


def request_models(model: str, lora_modules: Optional[list[str]], n: int, seed: int) -> list[str]:
    """The ``model`` field of each of ``n`` requests: ``model``, or with ``lora_modules`` one
    of those names drawn uniformly at random per request (vLLM's ``bench serve
    --lora-modules``), seeded so that every round and server gets the same assignment."""
    if not lora_modules:
        return [model] * n
    rnd = random.Random(seed)
    return [rnd.choice(lora_modules) for _ in range(n)]


async def benchmark(args: argparse.Namespace, api_url: str, model: str, requests: list[tuple[Any, int, int]],
                    chat: bool) -> dict[str, Any]:
    """Run all requests against ``api_url``; returns the metrics dict."""
    import aiohttp

    extra: dict[str, Any] = {}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    extra.update(getattr(args, "_structured_body", None) or {})
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, force_close=False)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed)
    outputs: list[RequestFuncOutput] = []
    send = responses_request_func if api_url.rstrip("/").endswith("/responses") else request_func
    # the resend of a request that met a closed pooled connection goes on a connection of its
    # own: through the pool it could take another one the server had closed as well (1-6 of 64
    # llama-server requests at 32 streams still failed after their resend through the pool)
    unpooled = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session, \
            aiohttp.ClientSession(timeout=timeout, connector=unpooled) as resend_session:
        for prompt, plen, olen in requests[:args.num_warmups]:
            await send(session, api_url, model, prompt, plen, olen, chat, extra, headers)

        names = request_models(model, getattr(args, "lora_modules", None), len(requests), args.seed)

        retried = 0

        async def send_once_more_if_stale(i: int) -> RequestFuncOutput:
            nonlocal retried
            out = await send(session, api_url, names[i], *requests[i], chat, extra, headers)
            if never_reached_server(out):
                retried += 1
                out = await send(resend_session, api_url, names[i], *requests[i], chat, extra, headers)
            return out

        async def one(i: int) -> RequestFuncOutput:
            if sem is None:
                return await send_once_more_if_stale(i)
            async with sem:
                return await send_once_more_if_stale(i)

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(i)) async for i in _arrivals(list(range(len(requests))), args.request_rate,
                                                                     args.burstiness, rng)]
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    return {**calculate_metrics(list(outputs), duration, percentiles), "retried_stale_connections": retried}


def print_result(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the result table in vLLM's layout."""
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", result["completed"], "d"), ("Failed requests:", result["failed"], "d"),
            ("Maximum request concurrency:", args.max_concurrency or "inf", ""),
            ("Request rate configured (RPS):", args.request_rate, ".2f"),
            ("Benchmark duration (s):", result["duration"], ".2f"),
            ("Total input tokens:", result["total_input_tokens"], "d"),
            ("Total generated tokens:", result["total_output_tokens"], "d"),
            ("Request throughput (req/s):", result["request_throughput"], ".2f"),
            ("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
            ("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")]
    if result.get("retried_stale_connections"):
        rows.insert(2, ("Resent (stale keep-alive):", result["retried_stale_connections"], "d"))
    for label, value, fmt in rows:
        print(f"{label:<40} {value:<10{fmt}}" if fmt else f"{label:<40} {value!s:<10}")
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    for name in [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]:
        print("{s:{c}^{n}}".format(s=f" {_METRIC_NAMES[name]} ", n=w, c="-"))
        print(f"{'Mean ' + name.upper() + ' (ms):':<40} {result[f'mean_{name}_ms']:<10.2f}")
        print(f"{'Median ' + name.upper() + ' (ms):':<40} {result[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            print(f"{f'P{p:g} ' + name.upper() + ' (ms):':<40} {result[f'p{p:g}_{name}_ms']:<10.2f}")
    print("=" * w)
    for err in result["errors"][:3]:
        print(f"error: {err}", file=sys.stderr)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``llmserve bench serve`` (vLLM's names)."""
    parser.add_argument("--base-url", type=str, default=None, help="Server URL (overrides --host/--port).")
    parser.add_argument("--host", type=str, default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", type=str, default="/v1/completions",
                        help="/v1/completions (token-id prompts), /v1/chat/completions or /v1/responses (decoded "
                             "text).")
    parser.add_argument("--compare-endpoint", type=str, default=None,
                        help="Also run the same requests on this endpoint, alternating with --endpoint for "
                             "--compare-rounds rounds each, and report both medians and the output-throughput "
                             "ratio (--endpoint / --compare-endpoint).")
    parser.add_argument("--compare-rounds", type=int, default=2, help="Rounds per endpoint with --compare-endpoint.")
    parser.add_argument("--compare-url-rounds", type=int, default=0,
                        help="With --compare-url: this many rounds per server, alternating, and the medians and "
                             "ratios of throughput, TPOT, TTFT (0: one run each; llmserve/benchmarks/server_compare.py). "
                             "Each round draws its own prompts (--seed + round), the same for both servers, so no "
                             "round measures the prefix cache of an earlier one.")
    parser.add_argument("--compare-url-warm-rounds", type=int, default=1,
                        help="With --compare-url-rounds: untimed rounds per server before the measured ones (the "
                             "first round after a start ran 20-25%% slower than the later ones on the 2-core "
                             "machine, and its figures went into the medians).")
    parser.add_argument("--compare-server-pids", type=str, default=None,
                        help="With --compare-url-rounds: 'PID_A,PID_B', the two servers' process ids (same "
                             "machine); each round also reports the CPU seconds the server's process tree "
                             "(API server + EngineCore) spent per 1,000 output tokens (the servers' own work; "
                             "on a contended machine spinning OpenMP threads add to it, so it moves with "
                             "throughput, a little less).")
    parser.add_argument("--model", type=str, default=None, help="Model name (default: the server's first model).")
    parser.add_argument("--tokenizer", type=str, default=None,
                        help="Tokenizer for the random dataset (default: the model, else SmolLM2-135M-Instruct).")
    parser.add_argument("--dataset-name", type=str, default="random", choices=["random"])
    parser.add_argument("--num-prompts", type=int, default=100, help="Number of requests.")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Requests per second (Poisson arrivals); inf sends all at once.")
    parser.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of arrivals (1 = Poisson).")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="Send ignore_eos so every request generates its full output length.")
    parser.add_argument("--temperature", type=float, default=None, help="Sampling temperature (default: server's).")
    parser.add_argument("--num-warmups", type=int, default=0, help="Requests sent (untimed) before the run.")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                        help="LoRA adapter names the server serves (vLLM's bench serve flag): each request's "
                             "model is one of them, drawn uniformly at random (seeded by --seed); warm-ups "
                             "use --model.")
    parser.add_argument("--api-key", type=str, default=os.environ.get("LLMSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="Per-request timeout (s).")
    parser.add_argument("--percentile-metrics", type=str, default="ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", type=str, default="99")
    parser.add_argument("--structured-output-schema", type=str, default=None,
                        help="Send every request with response_format json_schema: a JSON schema file, or "
                             "'builtin' (an array of small objects that does not complete within the output length, "
                             "so constrained and unconstrained requests generate the same number of tokens).")
    parser.add_argument("--structured-output-compare", action="store_true",
                        help="With --structured-output-schema: first run the same requests unconstrained, then "
                             "constrained, and report the output-throughput ratio (constrained / unconstrained).")
    parser.add_argument("--structured-output-rounds", type=int, default=1,
                        help="With --structured-output-compare: alternate unconstrained and constrained runs this "
                             "many times each and report the median ratio (a shared machine's load drifts).")
    parser.add_argument("--compare-url", type=str, default=None,
                        help="Also run the same requests against this second server (e.g. llama-server) "
                             "right after, and print the ratios of the two (throughput, median TTFT/TPOT).")
    parser.add_argument("--save-result", action="store_true", help="Write the result as JSON.")
    parser.add_argument("--result-dir", type=str, default=".")
    parser.add_argument("--result-filename", type=str, default=None)


def _validate(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be positive (inf for no pacing)")
    if not args.burstiness > 0:
        raise ValueError("--burstiness must be positive")
    for m in args.percentile_metrics.split(","):
        if m.strip() and m.strip() not in METRICS:
            raise ValueError(f"--percentile-metrics: unknown metric {m!r} (choose from {', '.join(METRICS)})")


# --structured-output-schema builtin: never complete within a bench's output length.
BUILTIN_SCHEMA = {"type": "object", "properties": {"rows": {
    "type": "array", "minItems": 512, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                                         "ok": {"type": "boolean"}},
        "required": ["id", "name", "ok"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}


def structured_body(schema: Optional[str]) -> dict[str, Any]:
    """The request fields of ``--structured-output-schema`` (a file or 'builtin'); {} for None.
    Raises ValueError for a file that is not a JSON object."""
    if not schema:
        return {}
    if schema == "builtin":
        value = BUILTIN_SCHEMA
    else:
        with open(schema, encoding="utf-8") as f:
            value = json.load(f)
        if not isinstance(value, dict):
            raise ValueError(f"--structured-output-schema: {schema} does not hold a JSON object")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": value}}}


def _compare_rounds(args: argparse.Namespace, api_url: str, model: str, requests: list, chat: bool,
                    body: dict[str, Any]) -> dict[str, Any]:
    """--structured-output-compare: unconstrained (A) and JSON-schema (B) runs of the same
    requests, ``--structured-output-rounds`` rounds in ABBA order; the last B result, with
    per-round and median output-throughput ratios B / A added."""
    import statistics

    ratios, base_tps, so_tps = [], [], []
    result: dict[str, Any] = {}
    for r in range(max(1, args.structured_output_rounds)):
        runs = {}
        # ABBA order: a load that drifts during a round favours neither side.
        for constrained in ((False, True) if r % 2 == 0 else (True, False)):
            args._structured_body = body if constrained else {}
            runs[constrained] = asyncio.run(benchmark(args, api_url, model, requests, chat))
        result = runs[True]
        a, b = runs[False]["output_throughput"], result["output_throughput"]
        base_tps.append(a)
        so_tps.append(b)
        ratios.append(b / a if a else 0.0)
        print(f"round {r + 1}: unconstrained {a:.2f} tok/s, JSON schema {b:.2f} tok/s, ratio {ratios[-1]:.3f}x")
    result["unconstrained_output_throughput"] = statistics.median(base_tps)
    result["structured_output_throughput"] = statistics.median(so_tps)
    result["structured_output_throughput_ratios"] = ratios
    result["structured_output_throughput_ratio"] = statistics.median(ratios)
    print(f"Output token throughput, JSON schema / unconstrained (median of {len(ratios)} alternating rounds): "
          f"{result['structured_output_throughput']:.2f} / {result['unconstrained_output_throughput']:.2f} tok/s, "
          f"ratio {result['structured_output_throughput_ratio']:.3f}x")
    return result


def _server_model(base_url: str, api_key: Optional[str]) -> str:
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; prints the table and returns the result dict (also written to
    JSON with --save-result). Raises ValueError for bad flags."""
    from llmserve.engine_args import DEFAULT_MODEL
    from llmserve.tokenizer import get_tokenizer

    _validate(args)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    model = args.model or _server_model(base_url, args.api_key)
    tok_name = args.tokenizer or model
    try:
        tokenizer = get_tokenizer(tok_name)
    except ValueError:
        if args.tokenizer:
            raise
        tokenizer = get_tokenizer(DEFAULT_MODEL)
    chat = "chat" in args.endpoint or "responses" in args.endpoint  # text prompts

    def sample(seed: int) -> list[tuple[list[int], int]]:
        return sample_random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, seed)

    def as_requests(picked: list[tuple[list[int], int]]) -> list[tuple[Any, int, int]]:
        """(prompt: text for chat endpoints, else the ids; prompt length; output length) each."""
        return [((tokenizer.decode(ids) if chat else ids), len(ids), olen) for ids, olen in picked]

    sampled = sample(args.seed)
    requests = as_requests(sampled)
    api_url = base_url.rstrip("/") + args.endpoint
    adapters = getattr(args, "lora_modules", None) or []
    spread = f" (spread over LoRA adapters {', '.join(adapters)})" if adapters else ""
    print(f"Benchmarking {model}{spread} at {api_url}: {len(requests)} requests, input ~{args.random_input_len}, "
          f"output ~{args.random_output_len}, concurrency {args.max_concurrency or 'inf'}, "
          f"rate {args.request_rate}")
    if args.compare_url and args.compare_url_rounds:  # alternating rounds on two servers
        from llmserve.benchmarks.server_compare import compare_servers

        other = args.compare_url.rstrip("/")
        return compare_servers(args, [api_url, other + args.endpoint], [model, _server_model(other, args.api_key)],
                               lambda seed: as_requests(sample(seed)), chat, benchmark)
    if args.compare_endpoint:
        from llmserve.benchmarks.endpoint_compare import compare_endpoints

        return compare_endpoints(args, base_url, model, tokenizer, sampled, benchmark)
    body = structured_body(args.structured_output_schema)
    if body and args.structured_output_compare:
        result = _compare_rounds(args, api_url, model, requests, chat, body)
    else:
        args._structured_body = body
        result = asyncio.run(benchmark(args, api_url, model, requests, chat))
    result.update({"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "model_id": model, "endpoint": args.endpoint,
                   "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
                   "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
                   "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
                   "lora_modules": adapters})
    print_result(result, args)
    if args.compare_url:
        result["compare"] = _compare(args, requests, chat, result)
    if args.save_result:
        name = args.result_filename or (f"bench-serve-{model.replace('/', '_')}-c{args.max_concurrency or 'inf'}-"
                                        f"{result['date']}.json")
        path = os.path.join(args.result_dir, name)
        os.makedirs(args.result_dir or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"Saved result to {path}")
    return result


_COMPARED = (("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT ms"),
             ("median_tpot_ms", "median TPOT ms"))


def _compare(args: argparse.Namespace, requests: list[tuple[Any, int, int]], chat: bool,
             ours: dict[str, Any]) -> dict[str, Any]:
    """The same requests against ``--compare-url`` (its own first model); returns its
    metrics plus ``ratio_*`` (this server / the other) of the compared figures."""
    other_url = args.compare_url.rstrip("/")
    other_model = _server_model(other_url, args.api_key)
    print(f"Comparing with {other_model} at {other_url}")
    other = asyncio.run(benchmark(args, other_url + args.endpoint, other_model, requests, chat))
    print_result(other, args)
    print(f"{'figure':<16} {'this':>10} {'compare':>10} {'ratio':>7}  (load {os.getloadavg()[0]:.1f})")
    for key, label in _COMPARED:
        a, b = ours.get(key) or 0.0, other.get(key) or 0.0
        other[f"ratio_{key}"] = a / b if b else float("inf")
        print(f"{label:<16} {a:>10.2f} {b:>10.2f} {other[f'ratio_{key}']:>6.2f}x")
    return other


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(p)
    main(p.parse_args())
