# The two commands a user needs: `make demo` and `make test`. Both install what
# is missing, build the extension, and run.
PY        ?= python3
NPROC     ?= 2
SOURCES   := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu') setup.py pyproject.toml
PYTEST_ARGS ?=

.PHONY: deps build demo demo-collectives test bench report clean

# torch: an installed 2.11+ is used as it is; otherwise the pinned CPU build.
deps:
	@$(PY) scripts/check_torch.py || $(PY) -m pip install -q torch==2.13.0
	@$(PY) -c "import pytest, numpy, tqdm, ninja, nbformat, nbclient, ipykernel, matplotlib, sklearn" \
		2>/dev/null || $(PY) -m pip install -q pytest numpy tqdm ninja nbformat nbclient ipykernel \
		matplotlib scikit-learn

# Builds the extension in place (ninja keeps build/ so rebuilds are
# incremental), then installs the package in editable mode without compiling
# again, for the `torch.backends` entry point that lets `import torch` register
# the backend.
# A replaced torch rebuilds too: the build must match the torch it runs with.
TORCH_VERSION_PY := $(shell $(PY) -c "import importlib.util as u; s = u.find_spec('torch'); \
	print(s.submodule_search_locations[0] + '/version.py' if s else '')" 2>/dev/null)
.build-stamp: $(SOURCES) $(TORCH_VERSION_PY)
	MAX_JOBS=$(NPROC) $(PY) setup.py -q build_ext --inplace
	@touch $@

build: deps .build-stamp
	@$(PY) scripts/check_install.py || \
		RINGREDUCE_METADATA_ONLY=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .

# A short 2-process CIFAR-100-shaped training run on ringreduce (synthetic
# data unless data/cifar-100-python exists), our DDP and SyncBatchNorm.
demo: build
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 scripts/ddp_cifar100.py \
		--synthetic --train-size 6144 --val-size 1000 --epochs 2 --width 8 --batch-size 32 \
		--ddp ours --sync-bn ours --json results/demo_train.json

# Every collective once on 2 ranks, checked, as a table.
demo-collectives: build
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 scripts/demo.py

test: build
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

bench: build
	$(PY) scripts/bench_collectives.py --nproc 2 --backends ringreduce gloo -b 4K -e 64M -f 4
	$(PY) scripts/bench_collectives.py --nproc 4 --backends ringreduce gloo -b 4K -e 64M -f 4

# Full benchmarks and training comparisons into results/, then the notebooks
# executed in place (about 40 minutes on 2 cores).
report: build
	$(PY) scripts/make_report.py

clean:
	rm -rf build *.egg-info torch_ringreduce/_C*.so torch_ringreduce/_build_info.py .build-stamp
