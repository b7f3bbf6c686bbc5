# The two README commands. Each bootstraps the same venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TRAIN_STAMP := $(VENV)/.installed-train
# The CPU wheel that lies on disk here; on a machine that already has torch, nothing is replaced.
TORCH  ?= torch==2.13.0
DFLASH_REF ?= dflash==0.1.0

.PHONY: check test suite bytecode test-fp8 test-speculators test-wandb lint demo venv clean fp8-wheel

venv: $(STAMP)

# Two stamps: what the demo runs on (the controller and the trainer: torch, transformers & co), and,
# on top, what the tests need (pytest, ruff, mypy, the DFlash reference). `make demo` on a fresh
# clone installs the first only, so a first demo does not wait for the test tools; `make test` adds
# the rest to the same venv.
#
# The packages go in with uv (pinned, installed into the venv by pip), which installs a fresh venv
# faster than pip (docs/decisions.md, "The test suite and the demo"), with bytecode compiled
# (--compile-bytecode; without it, a shell with PYTHONDONTWRITEBYTECODE=1 would compile torch from
# source in every process). uv reads no pip configuration: $PIP_FIND_LINKS is passed on, and where
# uv cannot install (no wheel of it for the machine, a registry only pip is set up for) the same
# line runs with pip.
UV_VERSION := 0.13.9
UV  := $(VENV)/bin/uv
PIP := $(PY) -m pip install -q --disable-pip-version-check
INSTALL = sh -c '$(UV) pip install -q --python $(PY) --compile-bytecode \
	$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) "$$@" || $(PIP) "$$@"' install

# A venv whose base interpreter is gone (another Python installed, pyenv's version removed) fails every
# call with exit 127: found when make reads this file, before any stamp is trusted, and rebuilt.
ifeq ($(shell [ -L $(PY) -o -e $(PY) ] && ! $(PY) -c '' 2>/dev/null && echo gone),gone)
$(info make: $(VENV)'s Python no longer runs (its base interpreter is gone): rebuilding $(VENV))
$(shell rm -rf $(VENV))
endif

$(TRAIN_STAMP): pyproject.toml trainer/requirements.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -x $(UV) || $(PIP) uv==$(UV_VERSION) || true
	$(PY) -c "import torch" 2>/dev/null || $(INSTALL) "$(TORCH)"
	$(INSTALL) -e '.[train]'
	touch $(TRAIN_STAMP)

$(STAMP): $(TRAIN_STAMP)
	$(INSTALL) -e '.[train,test]'
	# The DFlash reference implementation, for the export parity test. --no-deps: its model code
	# needs only torch and transformers (here already); its own pins would pull datasets & co.
	$(INSTALL) --no-deps "$(DFLASH_REF)"
	touch $(STAMP)

# ruff (pinned in the test extra, configured in pyproject.toml): pyflakes and pycodestyle, lines up
# to 120 columns. Only checks: nothing here rewrites or reformats the tree. Then mypy (pinned there
# too, [tool.mypy]): the type hints of orchestrator/ and trainer/ at mypy's default strictness
# (docs/architecture.md, "Checks"). Its cache is .scratch/mypy-cache (ignored, ~45 MB): a cold run (a fresh
# clone, a new mypy or torch) reads torch whole and is the long part of `make lint`; a warm one reads
# only the files changed and what imports them.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

# The quick room, before every commit: lint, types, the tests marked `quick` by tests/conftest.py (every
# test that starts no sshd, pct or container and compiles nothing, plus one real-sshd smoke of deploy ->
# launch -> follow). `make test` runs everything.
check: lint bytecode
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m quick tests

# Everything: lint and types beside the start of the main suite, then the three suites that need a
# package the venv lacks, each with its own PYTHONPATH, side by side (after the main suite, never beside
# it: docs/decisions.md), each one's output kept together.
test: bytecode
	$(MAKE) --no-print-directory -j2 lint suite
	$(MAKE) --no-print-directory -j3 -Otarget test-fp8 test-speculators test-wandb

# The main suite: three pytest workers, one test file each at a time (module fixtures stay within one
# worker), handed out in collection order, where tests/conftest.py puts the slowest first (SLOW_FILES),
# not xdist's own (most tests first), which left the long files of few tests to the end. Three on 2
# cores: the suite's processes often wait (on a trainer, an sshd, a container), and no test times
# anything a loaded machine can move (docs/decisions.md has the figures; docs/benchmarks.md the times).
suite: bytecode
	$(PY) -m pytest -q -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder tests

# --precision fp8's tests with torchao importable, and nothing else: torchao is installed into an
# ignored folder on their PYTHONPATH only. Wherever torchao is importable, transformers imports it in
# every process that builds a model (about a second each, and torchao's warnings on stderr), so it is
# not in the venv the rest of the suite, the demo and the trainer's users run in.
TORCHAO_DIR := .scratch/torchao
# The repo's own modules compiled once: under PYTHONDONTWRITEBYTECODE (set in some shells and CI
# images) each python process the suite starts from this tree would compile what it imports again.
bytecode: $(STAMP)
	$(PY) -m compileall -q orchestrator trainer tests benchmarks

test-fp8: $(STAMP)
	test -d $(TORCHAO_DIR)/torchao || $(PY) -m pip install -q --disable-pip-version-check --no-deps \
		--target $(TORCHAO_DIR) torchao==$(TORCHAO_VERSION)
	PYTHONPATH="$(abspath $(TORCHAO_DIR))" $(PY) -m pytest -q -p no:cacheprovider tests/test_fp8.py

# The export loaded by vLLM's speculators (tests/test_export_speculators.py), in an ignored folder on
# that file's PYTHONPATH only, as torchao above. --no-deps: its pins want transformers <= 5.19 and
# datasets, openai, torchvision & co for its training pipeline. Its DFlash model and converter run
# on what the venv has (transformers 5.24 included) plus loguru and hs-connectors (pure Python, which
# `import speculators` needs); the test stands in for openai and datasets, imported but never used.
SPECULATORS_DIR := .scratch/speculators
SPECULATORS     := speculators==0.9.0 loguru==0.7.3 hs-connectors==0.9.0
test-speculators: $(STAMP)
	test -d $(SPECULATORS_DIR)/speculators || $(PY) -m pip install -q --disable-pip-version-check --no-deps \
		--target $(SPECULATORS_DIR) $(SPECULATORS)
	PYTHONPATH="$(abspath $(SPECULATORS_DIR))" $(PY) -m pytest -q -p no:cacheprovider tests/test_export_speculators.py

# --report-to wandb (trainer/run/trackers.py) with wandb importable, offline (WANDB_MODE=offline: nothing is
# sent): wandb and its dependencies go into an ignored folder on that test's PYTHONPATH only, as torchao
# above. wandb is no dependency of the project: only those who ask for W&B install it.
WANDB_DIR := .scratch/wandb
test-wandb: $(STAMP)
	test -d $(WANDB_DIR)/wandb || $(PY) -m pip install -q --disable-pip-version-check --target $(WANDB_DIR) wandb==0.30.0
	PYTHONPATH="$(abspath $(WANDB_DIR))" WANDB_MODE=offline $(PY) -m pytest -q -p no:cacheprovider tests/test_trackers.py -k wandb

demo: $(TRAIN_STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/demo.sh

# torchao's wheel for --precision fp8 on a GPU machine that reaches no package registry
# (docs/precision.md): downloaded here into an ignored folder, carried with the device call, and
# installed there with `pip install --no-deps` (scripts/fp8_check.sh does). One abi3 wheel for
# Python >= 3.10 on x86-64 Linux, whatever this machine's Python; its sha256 is checked.
TORCHAO_VERSION := 0.18.0
TORCHAO_WHEEL   := torchao-$(TORCHAO_VERSION)-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
TORCHAO_SHA256  := 6540b148e40ba81cbd4de86392225a076a1591146e9cebb099b3b234ba9feebe
fp8-wheel: .scratch/wheels/$(TORCHAO_WHEEL)

.scratch/wheels/$(TORCHAO_WHEEL):
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--platform manylinux_2_28_x86_64 --python-version 3.10 --implementation cp \
		torchao==$(TORCHAO_VERSION) -d .scratch/wheels
	echo "$(TORCHAO_SHA256)  $@" | sha256sum -c --quiet

clean:
	rm -rf $(VENV) build *.egg-info
