# Everyday commands; the README's two quick-start commands need none of these.
PY ?= .venv/bin/python
# `make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu` for the CPU build on a machine
# where a plain `pip install torch` would fetch the CUDA one.
TORCH_INDEX ?=
# JupyterLab refuses to start as root (in a container, say) without --allow-root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: venv test notebooks lab render lint format bench verify properties mutations rule-mutations planted-bugs \
	battery-times adversarial gpu-wheels gpu-dry-run cuda-mutants

venv:            ## .venv with the pinned torch, the dev tools and the onnx extra
	python3.11 -m venv .venv
	.venv/bin/pip install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	.venv/bin/pip install -e ".[dev,onnx]"

test:            ## unit tests and every notebook, outputs compared (what CI runs)
	$(PY) -m pytest --nbval

# The run times go to notebooks/run_times.txt, the one place they are stated from: the README's
# notebook table is held to it (tests/test_readme.py). The file is replaced only when all ran.
notebooks:       ## re-execute every notebook in place, top to bottom, and record how long each took
	@: > notebooks/.run_times.partial; \
	for nb in notebooks/*.ipynb; do \
	  start=$$(date +%s); \
	  $(PY) -m jupyter nbconvert --to notebook --execute --inplace --log-level WARN \
	    --ExecutePreprocessor.timeout=600 --ExecutePreprocessor.record_timing=False $$nb \
	    || exit 1; \
	  secs=$$(( $$(date +%s) - start )); \
	  echo "$$nb: $$secs s"; \
	  echo "$$(basename $$nb) $$secs" >> notebooks/.run_times.partial; \
	done; \
	{ echo "# seconds per notebook, one make notebooks on $$(nproc) cores, load $$(cut -d' ' -f1-3 /proc/loadavg)"; \
	  cat notebooks/.run_times.partial; } > notebooks/run_times.txt; \
	rm notebooks/.run_times.partial

lab:             ## JupyterLab on 127.0.0.1 for the notebooks (open the URL it prints)
	$(PY) -m jupyter lab --ip 127.0.0.1 --no-browser $(ROOT_FLAG) notebooks

render:          ## screenshots of the notebooks in JupyterLab, in results/render/ (needs the dev extra and chromium)
	$(PY) scripts/render_notebooks.py

properties:      ## the property tests with many random examples (the default run takes a few)
	HYPOTHESIS_PROFILE=long $(PY) -m pytest tests/test_properties.py -q

# Two configurations of one engine (scripts/mutations/engine.py). Verdicts are keyed by function:
# a run judges only the functions whose code changed since the record (pending), from a fresh
# clone too. mutmut's caches (git-ignored): mutants/ for the backends, mutants-rule/ for the rule.
mutations:       ## judge the pending functions' mutants by the default battery; writes scripts/mutations/record.json
	$(PY) scripts/mutations/run.py backends

rule-mutations:  ## mutation testing of the tolerance rule against the harness's tests; writes scripts/mutations/rule_record.json
	$(PY) scripts/mutations/run.py rule

planted-bugs:    ## the bug classes a mutation tool cannot write, planted in a backend, and what catches each
	$(PY) scripts/mutations/planted_bugs.py

battery-times:   ## time `check einsum_baseline` (default and --full) for the times check --help states
	$(PY) scripts/time_battery.py

adversarial:     ## odd and invalid inputs at the public API, results judged by the oracle's rule
	$(PY) scripts/adversarial.py

# The lent GPU machine has Python 3.12 and torch 2.11 but no package registry: it gets the rest as
# wheels carried with the working tree (64 MiB in all), which scripts/gpu_check.sh installs.
gpu-wheels:      ## .whl/ (git-ignored): fovi_ref's wheel and scripts/gpu-requirements.txt's, for Python 3.12
	rm -rf .whl && mkdir .whl
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w .whl .
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux2014_x86_64 -d .whl -r scripts/gpu-requirements.txt
	du -sh .whl

cuda-mutants:    ## results/cuda-mutants/: the record's CUDA-only mutants, for gpu_check.sh to judge
	$(PY) scripts/mutations/on_cuda.py export results/cuda-mutants

gpu-dry-run:     ## every step of scripts/gpu_check.sh on the CPU with tiny sizes, no install (CI runs it)
	PYTHON=$(PY) bash scripts/gpu_check.sh --dry-run results/gpu-dry-run

lint:
	$(PY) -m ruff check fovi_ref tests notebooks scripts
	$(PY) -m ruff format --check fovi_ref tests scripts

format:
	$(PY) -m ruff format fovi_ref tests scripts notebooks

verify:
	$(PY) -m fovi_ref verify

bench:
	$(PY) -m fovi_ref bench
