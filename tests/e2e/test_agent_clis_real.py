"""The real agent CLIs against a real server: Claude Code (npm ``@anthropic-ai/claude-code``,
``claude -p``) on ``/v1/messages`` and Codex CLI (npm ``@openai/codex``, ``codex exec``) on
``/v1/responses``, as a custom model provider and as ``--oss`` Ollama. Pinned versions are
installed by ``make agent-clis`` into ``.venv/agent-clis`` (658 MB); a missing
install fails these tests (it does not skip them).

In ``make test`` (which installs them first): the install took 6.3-6.7 s with an empty npm
cache (13.5 s the first time here, once 31 s with the machine loaded) and this module 23 s
(its server's start 12.6 s, the five CLI runs ~10 s): ~30 s, under the 40 s ``make test``
could spare. ``test_agent_cli_requests.py``
replays the CLIs' recorded requests, without the CLIs.

The server (default 2048-token context) finds tool calls (Codex always sends ``tool_choice:
"auto"``), answers greedily in at most 48 tokens when a request sets no budget (Codex sets
none; Claude Code's comes from CLAUDE_CODE_MAX_OUTPUT_TOKENS), and shows the model only the
last line of the last user message (:data:`LAST_LINE_TEMPLATE`).
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from e2e_utils import MODEL, RemoteServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = ROOT / ".venv" / "agent-clis" / "node_modules" / ".bin"
CLAUDE, CODEX = BIN / "claude", BIN / "codex"
RUN_TIMEOUT_S = 240
# The model sees only the last line of the last user message, under SmolLM2's default
# system prompt: 135M parameters under the CLIs' ~3000-token instructions loop greedily until
# the budget (Claude Code then reports "response exceeded the N output token maximum", Codex
# "Incomplete response returned"), and the harness text the CLIs put in user messages (the
# date, the working folder) would change the greedy answer from run to run. "Say hello."
# alone ends in ~30 tokens. The requests still carry everything the CLIs send.
LAST_LINE_TEMPLATE = (
    "{% set last = namespace(text='') %}"
    "{% for m in messages %}{% if m.role == 'user' and m.content is string %}{% set last.text = m.content %}"
    "{% endif %}{% endfor %}"
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n{{ last.text.split('\\n') | last }}<|im_end|>\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def cli_server():
    missing = [str(p) for p in (CLAUDE, CODEX) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"agent CLIs not installed ({', '.join(missing)}): run `make agent-clis`")
    # No --api-key: Codex's --oss (Ollama) provider sends none (the other runs send a dummy)
    srv = RemoteServer(api_key=None, args=["--kv-cache-memory", "128MiB", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes",
                        "--override-generation-config", '{"max_new_tokens": 48, "temperature": 0}',
                        "--chat-template", LAST_LINE_TEMPLATE])
    yield srv
    srv.stop()


def run(cmd: list[str], home: pathlib.Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A CLI run in an empty home and working folder (no user config, no git repo)."""
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_"))}
    return subprocess.run(cmd, cwd=work, env={**base, "HOME": str(home), **env}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def claude(server: RemoteServer, home: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {"ANTHROPIC_BASE_URL": server.url_root, "ANTHROPIC_API_KEY": "dummy", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "48",
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
           "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL}
    return run([str(CLAUDE), "-p", *args, "--model", MODEL, "--output-format", "stream-json", "--verbose"],
               home, env)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_claude_code_prints_the_models_answer(cli_server, tmp_path):
    out = claude(cli_server, tmp_path, "Say hello.")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    events = json_lines(out.stdout)
    answers = [e["message"] for e in events if e["type"] == "assistant"]
    assert answers and answers[-1]["model"] == MODEL and answers[-1]["content"][0]["text"].strip()
    result = events[-1]
    assert result["type"] == "result" and result["is_error"] is False, result
    assert result["result"] == answers[-1]["content"][0]["text"]
    assert result["usage"]["output_tokens"] >= 1 and result["stop_reason"] == "end_turn"


@pytest.mark.slow  # the recorded request's 400 is replayed in make test (test_agent_cli_requests.py)
def test_claude_code_shows_prompt_too_long(cli_server, tmp_path):
    # A ~3000-token prompt: past the 2048-token context. The CLI recognises Anthropic's
    # wording and says so, with the sizes, instead of a bare "API Error: 400".
    out = claude(cli_server, tmp_path, "Say hello. " + "note " * 3000)
    result = json_lines(out.stdout)[-1]
    assert out.returncode == 1 and result["is_error"] is True and result["api_error_status"] == 400, result
    assert result["result"].startswith("Prompt is too long"), result
    assert "(limit 2047)" in result["result"], result


def codex(server: RemoteServer, home: pathlib.Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [str(CODEX), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--json", "-m", MODEL, *args]
    return run(cmd, home, {"CODEX_HOME": str(home / "codex"), **env})


def codex_answer(out: subprocess.CompletedProcess) -> tuple[str, dict]:
    """The agent's message and the turn's usage of a ``codex exec --json`` run."""
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    events = json_lines(out.stdout)
    texts = [e["item"]["text"] for e in events
             if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    done = [e for e in events if e["type"] == "turn.completed"]
    assert texts and done, events
    return texts[-1], done[-1]["usage"]


def test_codex_exec_on_a_responses_provider(cli_server, tmp_path):
    (tmp_path / "codex").mkdir()
    provider = (f'model_providers.llmserve={{name="llmserve",base_url="{cli_server.url_root}/v1",'
                'wire_api="responses",env_key="LLMSERVE_KEY"}')
    out = codex(cli_server, tmp_path, "-c", "model_provider=llmserve", "-c", provider, "Say hello.",
                env={"LLMSERVE_KEY": "dummy"})
    text, usage = codex_answer(out)
    assert text.strip() and usage["input_tokens"] > 0 and usage["output_tokens"] >= 1


def test_codex_says_it_ran_out_of_room(cli_server, tmp_path):
    # A ~3000-token prompt: past the 2048-token context. The streamed overflow is a
    # response.failed with code "context_length_exceeded", which Codex turns into its own
    # message (it printed the raw 400 body before). ~3 s.
    (tmp_path / "codex").mkdir()
    provider = (f'model_providers.llmserve={{name="llmserve",base_url="{cli_server.url_root}/v1",'
                'wire_api="responses",env_key="LLMSERVE_KEY"}')
    out = codex(cli_server, tmp_path, "-c", "model_provider=llmserve", "-c", provider,
                "Say hello. " + "note " * 3000, env={"LLMSERVE_KEY": "dummy"})
    failed = [e for e in json_lines(out.stdout) if e["type"] == "turn.failed"]
    assert out.returncode == 1 and failed, out.stdout[-2000:] + out.stderr[-2000:]
    assert failed[-1]["error"]["message"].startswith("Codex ran out of room in the model's context window"), failed


@pytest.mark.slow  # its handshake is replayed in make test (test_agent_cli_requests.py)
def test_codex_exec_oss_ollama(cli_server, tmp_path):
    # --oss asks /v1/models, /api/version (refused below 0.13.4) and /api/tags (the model
    # must be listed) before it uses /v1/responses.
    (tmp_path / "codex").mkdir()
    out = codex(cli_server, tmp_path, "--oss", "--local-provider", "ollama", "Say hello.",
                env={"CODEX_OSS_BASE_URL": f"{cli_server.url_root}/v1"})
    text, usage = codex_answer(out)
    assert text.strip() and usage["output_tokens"] >= 1
