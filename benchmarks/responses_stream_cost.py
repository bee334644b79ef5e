"""API-server cost of a streamed ``/v1/responses`` token next to a streamed
``/v1/chat/completions`` token (issue 13), without a model: a stub engine yields one
DELTA output per token at once, so the time measured is the handler's own (request
preparation, event building, JSON), the part of the server that differs between the
two endpoints. Rounds alternate chat / responses and the medians are compared.

    PYTHONPATH=$PWD flock /tmp/measure.lock python benchmarks/responses_stream_cost.py \
        [--requests 32] [--tokens 32] [--rounds 5]

Prints µs per token of each endpoint, their ratio, and the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from types import SimpleNamespace

from llmserve.entrypoints.openai.api_server import build_app, init_app_state
from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.cli_args import make_arg_parser
from llmserve.entrypoints.openai.responses.protocol import ResponsesRequest
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.tokenizer import get_tokenizer


class StubEngine:
    """Yields ``tokens`` one-token DELTA outputs per request (the last finishes)."""

    def __init__(self, tokenizer, tokens: int) -> None:
        self.tokenizer, self.tokens = tokenizer, tokens
        self.model_config = SimpleNamespace(max_model_len=2048, vocab_size=49152, served_model_name=("m",),
                                            model="m")
        self.generation_config_defaults = {}
        self.errored = False

    async def check_health(self) -> None:
        return None

    async def generate(self, prompt, params, request_id, priority=0, **kwargs):
        for i in range(self.tokens):
            finish = "length" if i == self.tokens - 1 else None
            yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None,
                                [CompletionOutput(0, " word", [1000 + i], None, None, finish)], finish is not None)
            await asyncio.sleep(0)  # as the engine's output handler hands over between steps


async def _drain(gen) -> int:
    n = 0
    async for chunk in gen:
        n += len(chunk)
    return n


async def _round(state, endpoint: str, requests: int) -> float:
    prompt = "Tell me about the sea. " * 4
    if endpoint == "chat":
        make = lambda: state.openai_serving_chat.create_chat_completion(ChatCompletionRequest(  # noqa: E731
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=32, stream=True,
            stream_options={"include_usage": True}, temperature=0))
    else:
        make = lambda: state.openai_serving_responses.create_responses(ResponsesRequest(  # noqa: E731
            model="m", input=prompt, max_output_tokens=32, stream=True, store=False, temperature=0))
    start = time.perf_counter()

    async def one():
        return await _drain(await make())

    await asyncio.gather(*(one() for _ in range(requests)))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    flags = make_arg_parser(argparse.ArgumentParser()).parse_args([])
    app = build_app(flags)
    engine = StubEngine(get_tokenizer("SmolLM2-135M-Instruct"), args.tokens)

    async def run():
        await init_app_state(engine, app.state, flags)
        times = {"chat": [], "responses": []}
        await _round(app.state, "chat", 2)  # warm up (template, caches)
        await _round(app.state, "responses", 2)
        for r in range(args.rounds):
            for endpoint in (("chat", "responses") if r % 2 == 0 else ("responses", "chat")):
                times[endpoint].append(await _round(app.state, endpoint, args.requests))
        return times

    times = asyncio.run(run())
    per_token = {e: statistics.median(t) / (args.requests * args.tokens) * 1e6 for e, t in times.items()}
    print(f"{args.requests} requests x {args.tokens} tokens, {args.rounds} alternating rounds (medians):")
    for e, us in per_token.items():
        print(f"  {e:<10} {us:7.1f} us/token  (handler only, stub engine)")
    print(f"  responses / chat cost: {per_token['responses'] / per_token['chat']:.3f}x  "
          f"(load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
