# Two-command quickstart: `make train` and `make test` each create .venv on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= moe-8x

.PHONY: train test bench lint clean gpu-check

$(STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh
	touch $@

train: $(STAMP)
	$(PY) train.py --config $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/moe_layer.py

# on a GPU machine, with the image's own Python and torch (no .venv, no network): GPU_CHECK_ARGS="--wheels DIR"
gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .cache
