"""The ``llmserve`` CLI (help, flag names, dispatch) and the Prometheus stat logger."""
from __future__ import annotations

import argparse
import subprocess
import sys
from types import SimpleNamespace

from llmserve.entrypoints.cli import make_parser
from llmserve.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", *argv], capture_output=True,
                          text=True, timeout=120, env=env)


def test_help_texts():
    top = _run("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "bench" in top.stdout
    serve = _run("serve", "--help")
    assert serve.returncode == 0
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--kv-cache-memory", "--enable-prefix-caching", "--dtype", "--seed",
                 "--chat-template", "--generation-config", "--allowed-origins", "--uvicorn-log-level",
                 "--disable-log-requests"):
        assert flag in serve.stdout, flag
    bench = _run("bench", "serve", "--help")
    assert bench.returncode == 0
    for flag in ("--base-url", "--random-input-len", "--random-output-len", "--num-prompts", "--max-concurrency",
                 "--request-rate", "--save-result", "--seed"):
        assert flag in bench.stdout, flag


def test_serve_args():
    p = make_parser(["serve", "my-model"])
    args = p.parse_args(["serve", "my-model", "--port", "9000", "--served-model-name", "a", "b",
                         "--allowed-origins", '["http://x"]', "--max-model-len", "512", "--no-enable-prefix-caching"])
    validate_parsed_serve_args(args)
    assert args.model == "my-model" and args.port == 9000 and args.served_model_name == ["a", "b"]
    assert args.allowed_origins == ["http://x"] and args.max_model_len == 512 and args.enable_prefix_caching is False
    plain = make_arg_parser(argparse.ArgumentParser()).parse_args([])
    validate_parsed_serve_args(plain)
    assert plain.model == "SmolLM2-135M-Instruct" and plain.port == 8000


def test_bench_dispatch_imports_only_the_chosen_module():
    args = make_parser(["bench", "serve"]).parse_args(["bench", "serve", "--num-prompts", "3"])
    from llmserve.benchmarks import serve

    assert args.dispatch is serve.main and args.num_prompts == 3


def _config(name="m"):
    return SimpleNamespace(model_config=SimpleNamespace(served_model_name=(name,), model=name, max_model_len=2048),
                           cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=True))


def test_prometheus_logger_records_and_renders():
    a, b = PrometheusStatLogger(_config()), PrometheusStatLogger(_config())  # own registries: no clash
    a.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=10,
                            prefix_cache_hits=4, num_preemptions=1),
             IterationStats(num_prompt_tokens=7, num_generation_tokens=5, time_to_first_tokens_iter=[0.1],
                            inter_token_latencies_iter=[0.02, 0.03],
                            finished_requests=[FinishedRequestStats("length", 1.5, 7, 5, 0.1, 0.02)]))
    a.record(None, None)
    text = a.render().decode()
    lab = 'engine="0",model_name="m"'
    for line in (f"vllm:num_requests_running{{{lab}}} 3.0", f"vllm:num_requests_waiting{{{lab}}} 1.0",
                 f"vllm:kv_cache_usage_perc{{{lab}}} 0.25", f"vllm:prompt_tokens_total{{{lab}}} 7.0",
                 f"vllm:generation_tokens_total{{{lab}}} 5.0", f"vllm:num_preemptions_total{{{lab}}} 1.0",
                 f"vllm:prefix_cache_hits_total{{{lab}}} 4.0",
                 f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} 1.0',
                 f"vllm:time_to_first_token_seconds_count{{{lab}}} 1.0",
                 f"vllm:inter_token_latency_seconds_count{{{lab}}} 2.0",
                 f"vllm:e2e_request_latency_seconds_count{{{lab}}} 1.0"):
        assert line in text, line
    assert "vllm:generation_tokens_total" in b.render().decode()
    assert f"vllm:generation_tokens_total{{{lab}}} 0.0" in b.render().decode()
    a.set_engine_stats({"num_running_reqs": 0, "num_waiting_reqs": 0, "kv_cache_usage": 0.0})
    assert f"vllm:num_requests_running{{{lab}}} 0.0" in a.render().decode()


def test_serve_unknown_model_is_a_one_line_error():
    proc = _run("serve", "no-such-model-xyz", "--port", "0")
    assert proc.returncode == 2
    assert "error" in proc.stderr and "no-such-model-xyz" in proc.stderr and "Traceback" not in proc.stderr


def _engine_interpreters(mark: str) -> set[int]:
    """Pids of live ``python -m llmserve.engine.core`` processes whose environment holds
    ``mark`` (started by this test's server: a shared machine runs other engines)."""
    import os
    pids = set()
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if b"llmserve.engine.core" not in f.read():
                    continue
            with open(f"/proc/{d}/environ", "rb") as f:
                if mark.encode() in f.read().split(b"\0"):
                    pids.add(int(d))
        except (OSError, ValueError):
            pass
    return pids


def test_serve_error_leaves_no_prestarted_engine():
    """``serve`` starts the engine's interpreter before its own imports (start-up overlap);
    when the server then stops on a bad model, that interpreter goes with it."""
    import os
    import uuid
    mark = f"LLMSERVE_TEST_MARK={uuid.uuid4().hex}"
    key, value = mark.split("=")
    proc = _run("serve", "no-such-model-xyz", "--port", "0", env={**os.environ, key: value})
    assert proc.returncode == 2
    assert not _engine_interpreters(mark)


def test_bad_flag_leaves_no_prestarted_engine():
    """A plain ``serve`` starts the engine's interpreter before its flags are parsed; a
    flag argparse refuses (exit 2) takes that interpreter with it."""
    import os
    import uuid
    mark = f"LLMSERVE_TEST_MARK={uuid.uuid4().hex}"
    key, value = mark.split("=")
    proc = _run("serve", "--port", "not-a-port", env={**os.environ, key: value})
    assert proc.returncode == 2 and "--port" in proc.stderr
    # the error and where the options are, not ~200 lines of usage in front of it
    assert proc.stderr.splitlines()[0] == "llmserve serve: error: argument --port: invalid int value: 'not-a-port'"
    assert len(proc.stderr.splitlines()) == 2 and "usage:" not in proc.stderr
    assert not _engine_interpreters(mark)


def test_taken_port_fails_before_the_engine_loads():
    """As vLLM, the server binds its port before starting the engine: a taken port is a
    one-line error (exit 2) naming the address, and no engine interpreter is left."""
    import os
    import socket
    import uuid
    mark = f"LLMSERVE_TEST_MARK={uuid.uuid4().hex}"
    key, value = mark.split("=")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = _run("serve", "--host", "127.0.0.1", "--port", str(port), env={**os.environ, key: value})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "Serving" not in proc.stderr
    assert not _engine_interpreters(mark)


def test_listening_sockets_get_nodelay_connections():
    """The sockets the server binds itself (one server; several API servers) say TCP as
    their proto, so asyncio turns Nagle's algorithm off on each accepted connection: a
    streamed chunk is sent at once, not held for the client's delayed ACK."""
    import asyncio
    import socket

    from llmserve.entrypoints.launcher import bind_listening_socket
    from llmserve.entrypoints.openai.multi_api_server import _bind

    async def accepted_nodelay(sock: socket.socket) -> int:
        seen = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            flag = await asyncio.wait_for(seen, 10)
            writer.close()
        return flag

    for sock in (bind_listening_socket("127.0.0.1", 0), _bind("127.0.0.1", 0, 1)[0]):
        assert sock.proto == socket.IPPROTO_TCP
        assert asyncio.run(accepted_nodelay(sock)) != 0


def test_engine_load_failure_is_a_one_line_error(tmp_path):
    """A model the engine cannot load (a config without weights) fails the start with the
    engine's reason in one line each from the engine and the CLI, exit 1; no traceback."""
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 49152, "max_position_embeddings": 256}))
    proc = _run("serve", str(tmp_path), "--tokenizer", "SmolLM2-135M-Instruct", "--port", "0")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("llmserve serve: error: ") and "no .safetensors weights" in last, last


def test_uds_in_a_missing_folder_fails_before_the_engine_loads():
    proc = _run("serve", "--uds", "/nonexistent-llmserve-dir/sock")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "(--uds): folder '/nonexistent-llmserve-dir' does not exist" in proc.stderr


def test_engine_starts_before_the_parser_only_for_one_engine():
    from llmserve.entrypoints.cli import _plain_serve

    assert _plain_serve(["serve"]) and _plain_serve(["serve", "--model", "m", "--port", "8001"])
    for argv in (["serve", "--help"], ["serve", "-h"], ["serve", "--data-parallel-size", "2"], ["serve", "-dp", "2"],
                 ["serve", "--api-server-count=2"], ["serve", "--headless"], ["serve", "--config", "c.yaml"],
                 ["bench", "serve"], []):
        assert not _plain_serve(argv), argv


def test_batching_defaults_follow_usage_context():
    """vLLM's CPU defaults: the offline LLM takes 4096-token steps over up to 256 requests,
    the server 2048 over 128; explicit values always win."""
    from llmserve.engine_args import EngineArgs, UsageContext

    args = EngineArgs(device="cpu")
    offline = args.create_engine_config(UsageContext.LLM_CLASS).scheduler_config
    server = args.create_engine_config(UsageContext.OPENAI_API_SERVER).scheduler_config
    direct = args.create_engine_config().scheduler_config
    assert (offline.max_num_batched_tokens, offline.max_num_seqs) == (4096, 256)
    assert (server.max_num_batched_tokens, server.max_num_seqs) == (2048, 128)
    assert (direct.max_num_batched_tokens, direct.max_num_seqs) == (2048, 128)
    explicit = EngineArgs(device="cpu", max_num_batched_tokens=300, max_num_seqs=7)
    sc = explicit.create_engine_config(UsageContext.LLM_CLASS).scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_num_seqs) == (300, 7)
    # Without chunked prefill a whole max_model_len prompt must fit in one step.
    whole = EngineArgs(device="cpu", enable_chunked_prefill=False, max_model_len=2048)
    assert whole.create_engine_config(UsageContext.OPENAI_API_SERVER).scheduler_config.max_num_batched_tokens >= 2048


def test_llm_passes_its_usage_context(monkeypatch):
    """LLM(...) builds its engine with the LLM_CLASS defaults."""
    import llmserve.engine.llm_engine as le
    from llmserve import LLM
    seen = []

    def fake_init(self, config, *args, **kwargs):
        seen.append(config.scheduler_config.max_num_batched_tokens)
        raise RuntimeError("stop here")

    monkeypatch.setattr(le.LLMEngine, "__init__", fake_init)
    try:
        LLM(device="cpu")
    except RuntimeError:
        pass
    assert seen == [4096]
