"""Screenshots of the built-in page for the README (docs/webui-playground.png and
docs/webui-live.png), taken with headless Debian chromium through Playwright.

Start a server first, e.g. ``llmserve serve --api-key k --max-num-seqs 6`` (6 seats, so
that some of the streams below wait in the queue), then
``python scripts/webui_screenshots.py --url http://127.0.0.1:8000 --api-key k``.
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time

import httpx
from playwright.sync_api import expect, sync_playwright

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOPICS = ["a lighthouse", "the sea", "a robot", "a garden", "a city at night", "a mountain", "a train", "a cat",
          "the moon", "a library"]


def stream(args: argparse.Namespace, i: int, max_tokens: int) -> None:
    body = {"model": args.model, "messages": [{"role": "user", "content": f"Tell a story about {TOPICS[i % 10]}."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{args.url}/v1/chat/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {args.api_key}"}) as r:
        for _ in r.iter_lines():
            pass


def wave(args: argparse.Namespace, lengths: list[int]) -> list[threading.Thread]:
    threads = [threading.Thread(target=stream, args=(args, i, n)) for i, n in enumerate(lengths)]
    for t in threads:
        t.start()
        time.sleep(0.15)  # arrivals spread a little, as from real clients
    return threads


def playground(context, args: argparse.Namespace) -> None:
    page = context.new_page()
    page.goto(args.url + "/")
    page.fill("#key-input", args.api_key)
    page.click("#key-ok")
    expect(page.locator("#model option")).not_to_have_count(0)
    page.fill("#system", "You are a concise assistant. Answer in markdown.")
    page.fill("#max_tokens", "96")
    page.fill("#temperature", "0")
    for prompt in ("Write a Python function that reverses a string.",
                   "Give three tips for writing clear code, as a list."):
        page.fill("#prompt", prompt)
        page.press("#prompt", "Enter")
        expect(page.locator("#send")).to_be_visible(timeout=600_000)
    page.screenshot(path=f"{args.out}/webui-playground.png")


def live(context, args: argparse.Namespace) -> None:
    page = context.new_page()
    page.goto(args.url + "/live")
    for t in wave(args, [24, 40, 32, 56, 28, 48]):  # finished ones, with their timelines
        t.join()
    threads = wave(args, [96, 64, 128, 80, 112, 72, 90, 70, 100, 60])
    expect(page.locator("#active tr[data-state=running]")).not_to_have_count(0)
    page.wait_for_timeout(args.running_s * 1000)
    page.screenshot(path=f"{args.out}/webui-live.png", full_page=True)
    for t in threads:
        t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="k")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--out", default="docs")
    parser.add_argument("--running-s", type=float, default=8.0, help="Seconds of streams before the live shot.")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(tempfile.mkdtemp(prefix="webui-shots-"), headless=True,
                                                       executable_path=args.chromium, args=FLAGS,
                                                       viewport={"width": 1400, "height": 860})
        playground(context, args)
        live(context, args)
        context.close()


if __name__ == "__main__":
    main()
