# Set-up installs torch==2.13.0 first, pinned, so no other torch build is ever resolved.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# buf (proto lint) from the npm registry, into an ignored local folder; skipped without npm.
BUF := .tools/node_modules/.bin/buf

.PHONY: install demo test lint protos bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	# dev = the test tools plus the plots and otlp extras, so every test runs.
	$(BIN)/pip install --quiet -e ".[dev]"
	if command -v npm >/dev/null; then npm install --silent --prefix .tools @bufbuild/buf; fi
	touch $(STAMP)

demo: install
	$(BIN)/specwire demo

# Two workers: most tests wait on one Python thread (services, gRPC), so two share 2 cores well.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy specwire orchestrator client draft_service target_service bench openai_http
	$(BUF) lint

protos: install
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos protos/specwire/v1/*.proto

bench: install
	$(BIN)/specwire bench --json

clean:
	rm -rf $(VENV) build *.egg-info .tools
