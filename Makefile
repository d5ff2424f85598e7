# Set-up installs torch==2.13.0 first, pinned, so no other torch build is ever resolved.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint protos bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: install
	$(BIN)/specwire demo

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy specwire orchestrator client draft_service target_service bench

protos: install
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos protos/specwire/v1/*.proto

bench: install
	$(BIN)/specwire bench --json

clean:
	rm -rf $(VENV) build *.egg-info
