# The two commands a newcomer needs: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?= models/tiny-qwen3
export PYTHONUNBUFFERED := 1

.PHONY: install kernels model test run bench-engine clean

install: $(STAMP) kernels

kernels: $(STAMP)   # the CPU fast-path kernels, compiled once per machine (a no-op when up to date)
	$(BIN)/python -m keyacc_ray.kernels

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

model: install
	@test -f $(MODEL)/config.json || $(BIN)/python scripts/make_tiny_model.py --arch qwen3 --size tiny --out $(MODEL)

test: install model
	$(BIN)/python -m pytest -q -x --durations=10 --ignore=tests/cluster
	$(BIN)/python -m pytest -q -x tests/cluster   # its own process: it starts a Ray cluster of its own

run: install model
	$(BIN)/python -m keyacc_ray.serve.app $(BIN)/serve run deployments/app.yaml   # with CLUSTER_ENV (keyacc_ray/serve/app.py)

bench-engine: install model
	@test -f models/bench-qwen3/config.json || $(BIN)/python scripts/make_tiny_model.py --arch qwen3 --size bench --dtype bfloat16 --out models/bench-qwen3
	$(BIN)/python scripts/bench_engine.py --model models/bench-qwen3

clean:
	rm -rf $(VENV) models
