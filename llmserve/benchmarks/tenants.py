"""Tenants' fair share, measured (issue 34): ``llmserve bench tenants``.

Starts ``llmserve serve`` twice on the same model and flags, FIFO
(``--no-tenant-fair-share``, tenants named but without quotas: the behaviour before
issue 34) and fair (the default fair share, the flooder limited to ``2 * max_num_seqs``
requests in flight), and runs each phase on one then the other, phase by phase
(``--duration`` seconds each, in ``--rounds`` alternating rounds merged per server). The
flooder's load comes from its own process, as another client's would: on the measuring
event loop its ~200 requests/s delayed the quiet tenant's reads.

1. ``baseline``: the flooder sends exactly the server's capacity (``max_num_seqs``
   closed-loop streams, no queue) and the quiet tenant 1 request/s (open loop).
2. ``flood``: the flooder sends open-loop (Poisson) arrivals at ``--flood-factor`` times
   the capacity measured in phase 1 (requests/s), the quiet tenant the same 1/s. On the
   fair server the keys file is rewritten and the server sent SIGHUP every 5 s.
3. ``weights``: tenants of weight 1 and 3 each keep ``2 * max_num_seqs`` streams busy
   (together four times the batch: both always have a request waiting); their output
   tokens streamed within the phase are compared.

Both servers get ``--max-queue-delay 300`` (unless ``--server-args`` sets it): the global
queue-delay bound (1 s) would otherwise refuse even a first-in-line request on a slow CPU,
and this measures the scheduling, not that bound. Before the phases, ``max_num_seqs``
requests warm the server up (admission control knows its service time from then on).

Reports per phase the quiet tenant's TTFT (median, p99), the status counts per tenant,
refusals without ``Retry-After``, timeouts and errors, total output tokens/s, the
weight phase's token shares, and the ratios the issue asks for (quiet p99 flood /
baseline for each server; fair / FIFO output tok/s in the flood phase). The machine's
load average is recorded (a shared machine moves these numbers). Stdout gets a summary
table (:func:`format_summary`); ``--output-json`` writes every figure. Token counts:
``output_tokens`` are the tokens streamed within the phase's time (output tok/s and the
shares come from them), ``usage_completion_tokens`` the final ``usage`` of the requests that
finished (requests in flight at the phase's end run to completion, so it also counts their
tokens streamed after the end; a request that timed out or failed adds nothing).

    llmserve bench tenants --duration 160 --rounds 4 --max-num-seqs 8 --max-tokens 32
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import aiohttp

TENANTS = ("flooder", "quiet", "light", "heavy")
WEIGHTS = {"light": 1, "heavy": 3}


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


PHASES = ("baseline", "flood", "weights")
# The flags the bench sets itself on each server: a second --port in --server-args would win
# (argparse keeps the last) and the bench would poll /health on a port nobody listens on.
_BENCH_OWNED_SERVER_FLAGS = ("--host", "--port")
# Seconds `_start_server` waits for /health: a tiny model loads in ~10 s on the 2-core box,
# but a fresh machine's first serve builds the C++ kernels first (~4 min, commit 37e6754).
SERVER_START_TIMEOUT_S = 600.0


def _positive_float(text: str) -> float:
    """argparse type: a float > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def _phase_list(text: str) -> str:
    """argparse type of ``--phases``: comma-separated names from :data:`PHASES`, spaces
    around each stripped; returns them joined by commas (what ``split(",")`` reads).
    Raises ``argparse.ArgumentTypeError`` naming a bad (or empty) name and the valid ones."""
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in PHASES:
            raise argparse.ArgumentTypeError(
                f"unknown phase {name!r} in {text!r}; valid phases: {', '.join(PHASES)}")
    return ",".join(names)


def _server_args(text: str) -> str:
    """argparse type of ``--server-args``: refuses ``--host``/``--port`` (also ``--port=N``),
    which the bench chooses itself for each server it starts."""
    for token in text.split():
        flag = token.split("=", 1)[0]
        if flag in _BENCH_OWNED_SERVER_FLAGS:
            raise argparse.ArgumentTypeError(
                f"{flag} is not allowed here: the bench chooses each server's host and port itself")
    return text


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--duration", type=_positive_float, default=60.0, help="Seconds of each phase (> 0).")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="The servers' batch size (the capacity).")
    parser.add_argument("--max-tokens", type=int, default=32, help="Output tokens per request (ignore_eos).")
    parser.add_argument("--prompt", default="Write a short story about a robot learning to paint.")
    parser.add_argument("--flood-factor", type=float, default=10.0, help="Flood arrivals / measured capacity.")
    parser.add_argument("--quiet-rate", type=float, default=1.0, help="Quiet tenant's requests per second.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Client timeout per request (s).")
    parser.add_argument("--rounds", type=_positive_int, default=1,
                        help="Each phase in this many rounds per server (duration / rounds seconds each), "
                             "alternating FIFO and fair, merged per server.")
    parser.add_argument("--only", choices=("fifo", "fair"), default=None, help="Run one server only.")
    parser.add_argument("--phases", type=_phase_list, default=",".join(PHASES),
                        help=f"Comma-separated phases to run, in order, from: {', '.join(PHASES)}. "
                             "baseline: the flooder as max_num_seqs closed-loop streams plus the quiet tenant "
                             "(measures the capacity); flood: the flooder's Poisson arrivals at "
                             "--flood-factor x the capacity (max_num_seqs / 4 req/s without a baseline "
                             "phase) plus the quiet tenant; weights: closed-loop tenants of weights 1 and 3. "
                             "With --engine-steps the same names pick the engine phases.")
    parser.add_argument("--server-args", type=_server_args, default="",
                        help="Extra `llmserve serve` flags (one string); not --host/--port, which the "
                             "bench chooses.")
    parser.add_argument("--output-json", default=None,
                        help="Write every figure as JSON to this file (stdout gets the summary table only, "
                             "as `bench serve` with --save-result). Per phase, `output_tokens` counts the "
                             "tokens streamed within the phase's time (what output_tok_s and the weight "
                             "shares are computed from); `usage_completion_tokens` adds up the final `usage` "
                             "of the requests that finished, so it also counts the tokens of requests in "
                             "flight at the phase's end streamed after it (they run to completion), and "
                             "nothing of a request that timed out or failed.")
    parser.add_argument("--engine-steps", type=int, default=0,
                        help="Instead of servers: each phase for this many steps of an in-process engine "
                             "(the scheduler's fair share alone, no HTTP quotas).")
    parser.add_argument("--quiet-every", type=int, default=4, help="--engine-steps: a quiet request every N steps.")


def _keys(fair: bool, max_num_seqs: int, extra: int = 0) -> list[dict]:
    flooder: dict[str, Any] = {"key": "k-flooder", "tenant": "flooder"}
    if fair:
        flooder["max_concurrent_requests"] = 2 * max_num_seqs
    keys = [flooder, {"key": "k-quiet", "tenant": "quiet"}]
    keys += [{"key": f"k-{t}", "tenant": t, "weight": w} for t, w in WEIGHTS.items()]
    keys += [{"key": f"k-spare{i}", "tenant": "quiet"} for i in range(extra)]  # the reload's change
    return keys


def _start_server(args: argparse.Namespace, fair: bool, keys_path: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix=f"llmserve-bench-tenants-{'fair' if fair else 'fifo'}-",
                                      suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "llmserve.entrypoints.openai.api_server", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
           "--max-num-seqs", str(args.max_num_seqs), "--api-keys-file", keys_path,
           "--tenant-fair-share" if fair else "--no-tenant-fair-share", *args.server_args.split()]
    if "--max-queue-delay" not in args.server_args:
        cmd += ["--max-queue-delay", "300"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url, log.name, SERVER_START_TIMEOUT_S)
    return proc, url


def _wait_healthy(proc: subprocess.Popen, url: str, log_name: str, timeout_s: float) -> None:
    """Poll ``url``/health until it answers 200. Raises ``RuntimeError`` (naming the log) if
    ``proc`` exits first or ``timeout_s`` seconds pass; on the timeout the server is
    terminated, so nothing is left running."""
    import httpx
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise RuntimeError(f"the server did not answer {url}/health within {timeout_s:.0f} s; "
                               f"log: {log_name}")
        time.sleep(0.5)
    raise RuntimeError(f"the server exited with {proc.returncode}; log: {log_name}")


class _Stats:
    """Per-tenant outcomes of one phase."""

    def __init__(self) -> None:
        self.status: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.ttft: dict[str, list[float]] = collections.defaultdict(list)
        self.tokens: collections.Counter = collections.Counter()  # streamed within the phase
        self.usage_tokens: collections.Counter = collections.Counter()  # usage of finished requests
        self.no_retry_after = collections.Counter()
        self.timeouts = collections.Counter()
        self.errors: list = []


async def _one(session: aiohttp.ClientSession, args: argparse.Namespace, url: str, tenant: str,
               st: _Stats, end: float) -> float:
    """One streamed completion of ``tenant``; returns its Retry-After (0 when served)."""
    body = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer k-{tenant}"},
                                timeout=aiohttp.ClientTimeout(total=args.timeout)) as resp:
            st.status[tenant][resp.status] += 1
            if resp.status != 200:
                retry = resp.headers.get("Retry-After")
                if retry is None and resp.status in (429, 503):
                    st.no_retry_after[tenant] += 1
                elif resp.status not in (429, 503):
                    st.errors.append((tenant, resp.status, (await resp.text())[:200]))
                await resp.read()
                return float(retry or 1)
            first = None
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if any(c.get("text") for c in chunk.get("choices", [])):
                    first = first if first is not None else time.perf_counter() - start
                    if time.monotonic() <= end:  # tokens streamed within the phase (one per chunk)
                        st.tokens[tenant] += 1
                usage = chunk.get("usage")
                if usage:
                    st.usage_tokens[tenant] += usage["completion_tokens"]
            if first is not None:
                st.ttft[tenant].append(first)
            return 0.0
    except asyncio.TimeoutError:
        st.timeouts[tenant] += 1
    except aiohttp.ClientError as e:
        st.errors.append((tenant, "client", str(e)[:200]))
    return 1.0


async def _closed_loop(session, args, url, tenant, st, end) -> None:
    while time.monotonic() < end:
        wait = await _one(session, args, url, tenant, st, end)
        if wait:
            await asyncio.sleep(min(wait, max(0.0, end - time.monotonic())))


async def _open_loop(session, args, url, tenant, st, end, rate: float, poisson: bool) -> None:
    rng = random.Random(0)
    tasks = []
    while time.monotonic() < end:
        tasks.append(asyncio.ensure_future(_one(session, args, url, tenant, st, end)))
        await asyncio.sleep(rng.expovariate(rate) if poisson else 1.0 / rate)
    await asyncio.gather(*tasks)


async def _reloader(keys_path: str, pid: int, args: argparse.Namespace, end: float) -> int:
    """Rewrite the keys file and SIGHUP the server every 5 s; returns the reload count."""
    n = 0
    while time.monotonic() + 5 < end:
        await asyncio.sleep(5)
        n += 1
        with open(keys_path, "w") as f:
            json.dump(_keys(True, args.max_num_seqs, extra=n % 3), f)
        os.kill(pid, signal.SIGHUP)
    return n


async def _flooder_jobs(name: str, args: argparse.Namespace, url: str, capacity: float, end: float) -> _Stats:
    """The flooder's load of phase ``name``: ``max_num_seqs`` closed-loop streams (baseline)
    or open-loop Poisson arrivals at ``flood_factor * capacity`` (flood)."""
    st = _Stats()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        if name == "baseline":
            await asyncio.gather(*(_closed_loop(s, args, url, "flooder", st, end) for _ in range(args.max_num_seqs)))
        else:
            await _open_loop(s, args, url, "flooder", st, end, args.flood_factor * capacity, poisson=True)
    return st


def _flooder_main(name: str, args: argparse.Namespace, url: str, capacity: float, end: float, conn: Any) -> None:
    """Child process body: run the flooder and send its stats back (plain dicts)."""
    st = asyncio.run(_flooder_jobs(name, args, url, capacity, end))
    conn.send({k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(st).items()})
    conn.close()


async def _flooder_elsewhere(name: str, args: argparse.Namespace, url: str, capacity: float, end: float,
                             st: _Stats) -> None:
    """Run the flooder in its own process and merge its outcomes into ``st``. The flooder is
    another client: in the measuring process its ~200 requests/s of the flood (each refusal
    read, each served stream parsed) queued the quiet tenant's own reads behind them on one
    event loop, and that client-side delay counted as the quiet tenant's TTFT."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})  # picklable
    proc = ctx.Process(target=_flooder_main, args=(name, plain, url, capacity, end, child), daemon=True)
    proc.start()
    child.close()
    got = await asyncio.get_running_loop().run_in_executor(None, parent.recv)
    await asyncio.get_running_loop().run_in_executor(None, proc.join)
    _merge(st, got)


def _merge(st: _Stats, got: dict) -> None:
    """Add another process's ``_Stats`` fields (as plain dicts) into ``st``."""
    for tenant, counts in got["status"].items():
        st.status[tenant].update(counts)
    for tenant, xs in got["ttft"].items():
        st.ttft[tenant].extend(xs)
    for field in ("tokens", "usage_tokens", "no_retry_after", "timeouts"):
        getattr(st, field).update(got[field])
    st.errors.extend(got["errors"])


def _pct(xs: list[float], q: float) -> Optional[float]:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def _summary(st: _Stats, duration: float) -> dict:
    q = st.ttft.get("quiet", [])
    return {"status": {t: dict(c) for t, c in st.status.items()},
            "quiet_ttft_median_s": statistics.median(q) if q else None, "quiet_ttft_p99_s": _pct(q, 0.99),
            "quiet_ttft_p90_s": _pct(q, 0.90), "quiet_ttft_slowest_s": sorted(q)[-5:],
            "quiet_n": len(q), "output_tokens": dict(st.tokens), "usage_completion_tokens": dict(st.usage_tokens),
            "output_tok_s": sum(st.tokens.values()) / duration,
            "refusals_without_retry_after": dict(st.no_retry_after), "timeouts": dict(st.timeouts),
            "errors": st.errors[:5], "n_errors": len(st.errors), "load_avg": os.getloadavg()[0]}


async def _phase(name: str, args: argparse.Namespace, url: str, capacity: float,
                 reload: Optional[tuple[str, int]], st: _Stats, duration: float) -> int:
    """Run phase ``name`` on ``url`` for ``duration`` seconds, adding its outcomes to
    ``st``; returns the keys-file reloads done (flood phase of the fair server)."""
    end = time.monotonic() + duration
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        jobs = []
        if name == "weights":
            # 2x the batch each: a tenant always has a request waiting when a seat frees,
            # even while its finished streams are between requests (with max_num_seqs
            # streams each, the weight-3 tenant's spare streams were mostly in transit
            # and the 1:3 shares came out 0.44:0.56 on this 2-core machine)
            jobs += [_closed_loop(s, args, url, t, st, end) for t in WEIGHTS for _ in range(2 * args.max_num_seqs)]
        else:
            jobs.append(_open_loop(s, args, url, "quiet", st, end, args.quiet_rate, poisson=False))
            jobs.append(_flooder_elsewhere(name, args, url, capacity, end, st))
        reloads = asyncio.ensure_future(_reloader(*reload, args, end)) if reload and name == "flood" else None
        await asyncio.gather(*jobs)
    return await reloads if reloads is not None else 0


def _phase_summary(name: str, st: _Stats, duration: float, reloads: Optional[int]) -> dict:
    """The figures of a phase's (merged) outcomes over ``duration`` seconds."""
    out = _summary(st, duration)
    out["flooder_req_s"] = st.status["flooder"][200] / duration if "flooder" in st.status else None
    if reloads is not None:
        out["keys_reloads"] = reloads
    if name == "weights":
        total = sum(st.tokens[t] for t in WEIGHTS) or 1
        out["shares"] = {t: st.tokens[t] / total for t in WEIGHTS}
        out["heavy_to_light"] = st.tokens["heavy"] / max(st.tokens["light"], 1)
    return out


async def _run_servers(args: argparse.Namespace, kinds: list[str]) -> dict:
    """Start one server per kind ("fifo", "fair"), then run each phase on each server in
    turn, phase by phase, in ``--rounds`` rounds of ``duration / rounds`` seconds whose
    order alternates (FIFO, fair, fair, FIFO, ...), each server's rounds merged: a shared
    machine's drift over the minutes falls on both alike (one 120 s flood phase each, run
    one after the other while other jobs started and stopped, gave fair/FIFO output
    tok/s of 1.025 in a quiet run and 0.911 in a loaded one). Each server's flood is
    sized by its own baseline."""
    servers: dict[str, tuple] = {}
    res: dict = {kind: {} for kind in kinds}
    try:
        for kind in kinds:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(_keys(kind == "fair", args.max_num_seqs), f)
            servers[kind] = (*_start_server(args, kind == "fair", f.name), f.name)
        for kind, (_, url, _) in servers.items():
            warm = _Stats()
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(*(_one(s, args, url, "quiet", warm, time.monotonic())
                                       for _ in range(args.max_num_seqs)))
        for name in args.phases.split(","):
            stats = {kind: _Stats() for kind in servers}
            reloads: dict[str, Optional[int]] = {kind: None for kind in servers}
            for r in range(args.rounds):
                for kind in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                    proc, url, keys_path = servers[kind]
                    capacity = res[kind].get("capacity_req_s", args.max_num_seqs / 4.0)
                    reload = (keys_path, proc.pid) if kind == "fair" else None
                    n = await _phase(name, args, url, capacity, reload, stats[kind], args.duration / args.rounds)
                    if reload and name == "flood":
                        reloads[kind] = (reloads[kind] or 0) + n
                    await asyncio.sleep(5)  # the queue drains: each phase starts alike
            for kind in servers:
                res[kind][name] = _phase_summary(name, stats[kind], args.duration, reloads[kind])
                if name == "baseline":
                    res[kind]["capacity_req_s"] = _capacity(res[kind][name], args)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    return res


def _capacity(baseline: dict, args: argparse.Namespace) -> float:
    """Requests/s the server finished in the baseline phase (its capacity)."""
    capacity = (baseline["flooder_req_s"] or 0.0) + args.quiet_rate * (baseline["quiet_n"] > 0)
    if capacity <= 0:
        raise RuntimeError(f"no request finished in the baseline phase: {baseline}")
    return capacity


def _ratios(res: dict) -> dict:
    out = {}
    for kind in ("fifo", "fair"):
        r = res.get(kind, {})
        if "baseline" in r and "flood" in r and r["baseline"]["quiet_ttft_p99_s"] and r["flood"]["quiet_ttft_p99_s"]:
            out[f"{kind}_quiet_p99_flood_over_baseline"] = r["flood"]["quiet_ttft_p99_s"] / r["baseline"]["quiet_ttft_p99_s"]
    if "flood" in res.get("fifo", {}) and "flood" in res.get("fair", {}):
        out["flood_output_tok_s_fair_over_fifo"] = res["fair"]["flood"]["output_tok_s"] / max(
            res["fifo"]["flood"]["output_tok_s"], 1e-9)
    return out


def main(args: argparse.Namespace) -> dict:
    """Run the servers and phases; prints and returns the results."""
    res: dict = {"load_avg_start": os.getloadavg()[0], "cpus": os.cpu_count(), "args": vars(args).copy()}
    res["args"].pop("dispatch", None)
    if args.engine_steps:
        res.update(engine_main(args))
    if not args.engine_steps:
        res.update(asyncio.run(_run_servers(args, [k for k in ("fifo", "fair") if args.only in (None, k)])))
    if not args.engine_steps:
        res.update(_ratios(res))
    res["load_avg_end"] = os.getloadavg()[0]
    print(format_summary(res))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"Saved result to {args.output_json}")
    return res


_SUMMARY_COLUMNS = (("phase", 8), ("server", 6), ("quiet n", 7), ("p50 TTFT s", 10), ("p99 TTFT s", 10),
                    ("p99 flood/base", 14), ("out tok/s", 9), ("429s", 6), ("shares light:heavy", 18))


def _count_status(status: dict, code: int) -> int:
    """Responses with HTTP ``code`` over all tenants of a phase's ``status`` (tenant ->
    code -> count; codes are ints in memory, strings after a JSON round trip)."""
    return sum(c.get(code, c.get(str(code), 0)) for c in status.values())


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _summary_row(phase: str, kind: str, figures: dict, res: dict) -> list[str]:
    """One table row: the quiet tenant's TTFT, the flood/baseline p99 ratio (flood rows),
    output tok/s, 429s (server runs only) and the weight phase's output-token shares."""
    shares = figures.get("shares")
    if shares is None and figures.get("heavy_share") is not None:  # --engine-steps
        shares = {"light": 1 - figures["heavy_share"], "heavy": figures["heavy_share"]}
    ratio = res.get(f"{kind}_quiet_p99_flood_over_baseline") if phase == "flood" else None
    status = figures.get("status")
    return [phase, kind, _fmt(figures.get("quiet_n") if phase != "weights" else None, "d"),
            _fmt(figures.get("quiet_ttft_median_s"), ".3f"), _fmt(figures.get("quiet_ttft_p99_s"), ".3f"),
            _fmt(ratio, ".2f") + ("x" if ratio is not None else ""), _fmt(figures.get("output_tok_s"), ".1f"),
            _fmt(_count_status(status, 429) if status is not None else None, "d"),
            f"{shares['light']:.3f}:{shares['heavy']:.3f}" if shares else "-"]


def _problems(phase: str, kind: str, figures: dict) -> Optional[str]:
    """A line naming a phase's timeouts, errors and refusals without Retry-After (None: none)."""
    parts = [f"{sum(figures.get(k, {}).values())} {label}" for k, label in
             (("timeouts", "timeouts"), ("refusals_without_retry_after", "429/503 without Retry-After"))
             if sum(figures.get(k, {}).values())]
    if figures.get("n_errors"):
        parts.append(f"{figures['n_errors']} errors")
    return f"{kind} {phase}: " + ", ".join(parts) if parts else None


def format_summary(res: dict) -> str:
    """The result of :func:`main` (or ``engine_main``) as a text table: per phase and
    server (FIFO, fair), the quiet tenant's answered requests and median / p99 TTFT (s),
    its p99 in the flood over its p99 in the baseline, total output tok/s (tokens streamed
    within the phase), 429 responses (all tenants), the weight phase's output-token shares
    (weights 1:3); then fair/FIFO output tok/s in the flood, any timeouts, errors or
    refusals without Retry-After, and the load average. A figure a run has not got is "-"."""
    kinds = [k for k in ("fifo", "fair") if isinstance(res.get(k), dict)]
    phases = list(dict.fromkeys(p for k in kinds for p, v in res[k].items() if isinstance(v, dict)))
    rows = [[name for name, _ in _SUMMARY_COLUMNS]]
    rows += [_summary_row(p, k, res[k][p], res) for p in phases for k in kinds if isinstance(res[k].get(p), dict)]
    widths = [max(w, *(len(r[i]) for r in rows)) for i, (_, w) in enumerate(_SUMMARY_COLUMNS)]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    if res.get("flood_output_tok_s_fair_over_fifo") is not None:
        lines.append(f"flood output tok/s, fair / FIFO: {res['flood_output_tok_s_fair_over_fifo']:.3f}")
    lines += [line for p in phases for k in kinds if isinstance(res[k].get(p), dict)
              if (line := _problems(p, k, res[k][p])) is not None]
    if res.get("load_avg_start") is not None and res.get("load_avg_end") is not None:
        lines.append(f"load average {res['load_avg_start']:.1f} at start, {res['load_avg_end']:.1f} at end")
    return "\n".join(lines)


# ---- --engine-steps: the same questions asked of an in-process engine (no HTTP) -----------
def _engine(args: argparse.Namespace, fair: bool) -> Any:
    from llmserve import LLM
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, tenant_fair_share=fair, multiprocess_mode=False,
              kv_cache_memory="256MiB", max_model_len=512, disable_log_stats=True)
    return llm  # the LLM, not only its engine: its finalizer shuts the engine down


class _EngineDriver:
    """Keeps each tenant at its number of outstanding requests; counts tokens per tenant
    and the quiet tenant's time to first token (seconds and engine steps)."""

    def __init__(self, eng: Any, args: argparse.Namespace):
        from llmserve import RequestOutputKind, SamplingParams
        self.eng, self.args, self.n = eng, args, 0
        self.sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0,
                                 output_kind=RequestOutputKind.DELTA)
        self.tenant_of: dict[str, str] = {}
        self.started: dict[str, tuple[float, int]] = {}
        self.outstanding: collections.Counter = collections.Counter()
        self.tokens: collections.Counter = collections.Counter()
        self.ttft: list[float] = []
        self.ttft_steps: list[int] = []

    def add(self, tenant: str, weight: float, step: int) -> None:
        from llmserve.engine.tenant_context import reset_current_tenant, set_current_tenant
        self.n += 1
        rid = f"{tenant}-{self.n}"
        token = set_current_tenant(argparse.Namespace(name=tenant, weight=weight))
        try:
            self.eng.add_request(rid, self.args.prompt, self.sp)
        finally:
            reset_current_tenant(token)
        self.tenant_of[rid], self.started[rid] = tenant, (time.perf_counter(), step)
        self.outstanding[tenant] += 1

    def step(self, step: int) -> None:
        for out in self.eng.step():
            tenant = self.tenant_of[out.request_id]
            new = len(out.outputs[0].token_ids)
            if new and out.request_id in self.started and tenant == "quiet":
                t0, s0 = self.started.pop(out.request_id)
                self.ttft.append(time.perf_counter() - t0)
                self.ttft_steps.append(step - s0)
            self.tokens[tenant] += new
            if out.finished:
                self.outstanding[tenant] -= 1


def _engine_phase(eng: Any, args: argparse.Namespace, name: str) -> dict:
    drv, steps = _EngineDriver(eng, args), args.engine_steps
    depth = {"baseline": {"flooder": args.max_num_seqs}, "flood": {"flooder": 10 * args.max_num_seqs},
             "weights": {t: args.max_num_seqs for t in WEIGHTS}}[name]
    t0 = time.perf_counter()
    for step in range(steps):
        for tenant, want in depth.items():
            while drv.outstanding[tenant] < want:
                drv.add(tenant, WEIGHTS.get(tenant, 1), step)
        if name != "weights" and step % args.quiet_every == 0:
            drv.add("quiet", 1, step)
        drv.step(step)
    wall = time.perf_counter() - t0
    while eng.has_unfinished_requests():  # drain: the next phase starts empty
        eng.step()
    out = {"steps": steps, "wall_s": wall, "tokens": dict(drv.tokens),
           "quiet_sent": sum(1 for t in drv.tenant_of.values() if t == "quiet"),
           "output_tok_s": sum(drv.tokens.values()) / wall, "quiet_n": len(drv.ttft),
           "quiet_ttft_p99_s": _pct(drv.ttft, 0.99), "quiet_ttft_median_s": _pct(drv.ttft, 0.5),
           "quiet_ttft_p99_steps": _pct(drv.ttft_steps, 0.99), "load_avg": os.getloadavg()[0]}
    if name == "weights":
        total = sum(drv.tokens[t] for t in WEIGHTS) or 1
        out["heavy_share"] = drv.tokens["heavy"] / total
    return out


def _warm_up(eng: Any, args: argparse.Namespace) -> None:
    """A full batch of short requests run to the end before any phase is timed, so that
    the first phase (FIFO's baseline) is not charged with the engine's first-step costs
    (allocations, kernel dispatch caches): the finding of the stop-42 review."""
    from llmserve import SamplingParams
    sp = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    for i in range(args.max_num_seqs):
        eng.add_request(f"warm-up-{i}", args.prompt, sp)
    while eng.has_unfinished_requests():
        eng.step()


def engine_main(args: argparse.Namespace) -> dict:
    """``--engine-steps N``: each phase for N steps of an in-process engine, FIFO then fair,
    each engine warmed up first (:func:`_warm_up`)."""
    res: dict = {"load_avg_start": os.getloadavg()[0]}
    for kind in ("fifo", "fair"):
        llm = _engine(args, fair=kind == "fair")
        _warm_up(llm.llm_engine, args)
        res[kind] = {name: _engine_phase(llm.llm_engine, args, name) for name in args.phases.split(",")}
        del llm
    for kind in ("fifo", "fair"):
        r = res[kind]
        if "baseline" in r and "flood" in r and r["baseline"]["quiet_ttft_p99_s"] and r["flood"]["quiet_ttft_p99_s"]:
            res[f"{kind}_quiet_p99_flood_over_baseline"] = r["flood"]["quiet_ttft_p99_s"] / r["baseline"]["quiet_ttft_p99_s"]
    if "flood" in res["fifo"]:
        res["flood_output_tok_s_fair_over_fifo"] = res["fair"]["flood"]["output_tok_s"] / res["fifo"]["flood"]["output_tok_s"]
    return res
