# The two commands a user needs: `make demo` and `make test`. Each installs what
# it is missing (only what that target uses), builds the extension, and runs.
#
#   make demo                                   torch from pip's default index (PyPI)
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu     the CPU build of torch
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cu130   a CUDA 13.0 build
#   make test VERBOSE=1                         the compiler's whole output on the terminal
#
# A torch >= 2.11 already installed is used as it is: TORCH_SPEC and TORCH_INDEX
# only matter when there is none.
PY          ?= python3
NPROC       ?= 2
VERBOSE     ?=
PYTEST_ARGS ?=
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
SOURCES     := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu') setup.py pyproject.toml

# What each target imports beyond torch, as pip names it. scripts/tools/check_deps.py
# checks exactly these and prints the ones missing, which are then installed.
DEPS_BUILD  := ninja setuptools>=77.0.3
# numpy for every run: torch's object collectives (all_gather_object, ...) go
# through Tensor.numpy(), and torch does not depend on numpy.
DEPS_RUN    := numpy
DEPS_DEMO   := $(DEPS_RUN) tqdm
DEPS_BENCH  := $(DEPS_RUN) tqdm
# tests/ (the notebook tests run the notebooks and scripts/studies/paradigms.py on
# scikit-learn's digits; test_docs builds the site with mkdocs; torch's own test
# suite, which test_torch_conformance runs, imports expecttest)
DEPS_TEST   := $(DEPS_RUN) pytest hypothesis scikit-learn nbformat nbclient ipykernel matplotlib \
               mkdocs-material==9.* expecttest
DEPS_DOCS   := mkdocs-material==9.*
DEPS_REPORT := $(DEPS_RUN) tqdm scikit-learn nbformat nbclient ipykernel matplotlib

.PHONY: deps deps-torch deps-build deps-run deps-demo deps-bench deps-test deps-report \
	deps-docs build demo demo-collectives test bench report docs clean

# $(call install,TARGET,REQUIREMENTS,WHY): pip-installs those of REQUIREMENTS not
# installed, in one line saying which. set -f: `==9.*` stays a version, not a glob.
define install
	@set -f; missing=$$($(PY) scripts/tools/check_deps.py $(foreach r,$(2),'$(r)')) || { \
		echo "$(1): installing $$missing ($(3))"; \
		$(PY) -m pip install -q $$missing; }
endef

# Everything every target needs.
deps: deps-build deps-run deps-demo deps-bench deps-test deps-docs deps-report

# torch: an installed 2.11+ is used as it is (scripts/tools/check_torch.py); otherwise
# TORCH_SPEC from TORCH_INDEX, or from pip's default index when it is empty.
ifeq ($(TORCH_INDEX),)
TORCH_FROM := pip's default index (PyPI unless your pip configuration names another). \
	On Linux x86_64 that is PyPI's CUDA build, several GB of NVIDIA wheels; for the CPU \
	build (about 200 MB) press Ctrl-C and run: make $(or $(MAKECMDGOALS),deps) $(if $(filter command line,$(origin PY)),PY=$(PY) )\
	TORCH_INDEX=https://download.pytorch.org/whl/cpu
else
TORCH_FROM := $(TORCH_INDEX) (pip --index-url)
endif
deps-torch:
	@$(PY) scripts/tools/check_torch.py || { \
		echo "deps-torch: no torch >= 2.11 for $(PY): installing $(TORCH_SPEC) from $(TORCH_FROM)"; \
		$(PY) -m pip install -q '$(TORCH_SPEC)' $(if $(TORCH_INDEX),--index-url '$(TORCH_INDEX)'); }

deps-build: deps-torch
	$(call install,deps-build,$(DEPS_BUILD),to compile the extension)

deps-run:
	$(call install,deps-run,$(DEPS_RUN),for torch's object collectives)

deps-demo:
	$(call install,deps-demo,$(DEPS_DEMO),for make demo)

deps-bench:
	$(call install,deps-bench,$(DEPS_BENCH),for make bench)

deps-test:
	$(call install,deps-test,$(DEPS_TEST),for what tests/ imports and runs)

deps-docs:
	$(call install,deps-docs,$(DEPS_DOCS),to build the docs site)

deps-report:
	$(call install,deps-report,$(DEPS_REPORT),for the runs and notebooks of make report)

# scripts/: entry points run as modules from this folder (python -m scripts.<purpose>.<name>);
# the tools above run as plain files, before torch or the package is installed.

# Builds the extension in place (ninja keeps build/ so rebuilds are
# incremental) with one progress line (scripts/tools/build_ext.py; the compiler's
# output in build/build.log, all of it on the terminal with VERBOSE=1), then
# installs the package in editable mode without compiling again, for the
# `torch.backends` entry point that lets `import torch` register the backend.
# A replaced torch rebuilds too: the build must match the torch it runs with.
TORCH_VERSION_PY := $(shell $(PY) -c "import importlib.util as u; s = u.find_spec('torch'); \
	print(s.submodule_search_locations[0] + '/version.py' if s else '')" 2>/dev/null)
.build-stamp: $(SOURCES) $(TORCH_VERSION_PY) | deps-build
ifeq ($(VERBOSE),)
	@$(PY) scripts/tools/build_ext.py --jobs $(NPROC) --log build/build.log
else
	MAX_JOBS=$(NPROC) $(PY) setup.py -q build_ext --inplace
endif
	@touch $@

build: deps-build .build-stamp
	@$(PY) scripts/tools/check_install.py || { \
		echo "build: pip install -e . (no compiling: for the entry point that registers the backend)"; \
		RINGREDUCE_METADATA_ONLY=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .; }

# A short 2-process CIFAR-100-shaped training run on ringreduce (synthetic
# data unless data/cifar-100-python exists), our DDP and SyncBatchNorm.
demo: deps-demo build
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 -m scripts.training.ddp_cifar100 \
		--synthetic --train-size 6144 --val-size 1000 --epochs 2 --width 8 --batch-size 32 \
		--ddp ours --sync-bn ours --json results/demo_train.json

# Every collective once on 2 ranks, checked, as a table.
demo-collectives: deps-run build
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 -m scripts.benchmarks.demo

test: deps-test build
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

bench: deps-bench build
	$(PY) -m torch_ringreduce.bench --nproc 2 --backends ringreduce gloo -b 4K -e 64M -f 4
	$(PY) -m torch_ringreduce.bench --nproc 4 --backends ringreduce gloo -b 4K -e 64M -f 4

# Full benchmarks and training comparisons into results/, then the notebooks
# executed in place (about 15 minutes on 2 cores).
report: deps-report build
	$(PY) -m scripts.tools.make_report

# The docs site into build/site (mkdocs.yml; strict: a broken link or anchor fails).
# `python -m mkdocs serve` serves it while you edit.
docs: deps-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf build *.egg-info torch_ringreduce/_C*.so torch_ringreduce/_build_info.py .build-stamp
