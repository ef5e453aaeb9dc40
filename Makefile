# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
# The virtual environment lives in .venv. torch is installed only when no torch is importable: a user who already
# has a (CUDA) torch in the Python that makes the venv keeps it, through --system-site-packages.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# Every extra of .[all] but `streaming`, whose litdata requires torchvision, and pip would replace the CPU torch with
# the CUDA torch the newest torchvision pins (multi-GB). litdata imports and streams without torchvision, so the venv
# gets it without its dependencies, then the ones it uses (keep LITDATA_SPEC as pyproject's `streaming` extra).
EXTRAS ?= wandb,export,gpu,plot,cli,lrfree
LITDATA_SPEC ?= litdata>=0.2.70,<0.3
LITDATA_DEPS ?= boto3 obstore tifffile requests urllib3 filelock

.PHONY: install demo test test-avx2 lint typecheck pytest clean

$(BIN)/python:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "make: using the torch already installed for $(PYTHON) (not replaced)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --upgrade --quiet pip
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "make: torch $$($(BIN)/python -c 'import torch; print(torch.__version__)') found, keeping it"; \
	else \
		$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"; \
	fi
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS),dev]"
	$(BIN)/python -m pip install --quiet --no-deps "$(LITDATA_SPEC)"
	$(BIN)/python -m pip install --quiet $(LITDATA_DEPS)
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/speedkit demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

# pytest's exit code 5 means no test ran: that is a failure, never a pass.
pytest: install
	@WANDB_MODE=disabled WANDB_SILENT=true $(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: pytest collected no tests: failing"; exit 1; fi; exit $$rc

test: lint typecheck pytest

# The hardware-sensitive tests again as an AVX2-only CPU (no AVX-512, no bf16, no VNNI) would run them: torch's kernel
# dispatch and oneDNN are forced down to AVX2 and speedkit's hardware facts follow (hardware.forced_isa). On an
# AVX-512 machine this catches what an AVX2 user would hit. DDP tests are left out: the ISA does not change them.
# On a CPU without AVX-512 the forced ISA changes nothing and `make test` already ran these as that CPU does, so the
# pass is skipped with a line saying so; FORCE_AVX2_PASS=1 runs it anyway. test_compile.py compiles at AVX2 on the
# inductor cache that `make test` filled at the machine's own ISA (a graph loaded across ISAs computed garbage).
HW_TESTS := tests/test_hardware.py tests/test_doctor.py tests/test_recommend.py tests/test_precision.py \
	tests/test_layout.py tests/test_channels_last.py tests/test_preset.py tests/test_demo_model.py \
	tests/test_int8.py tests/test_int8_multi_input.py tests/test_int8_formats.py tests/test_monitor.py \
	tests/test_fused.py tests/test_compile.py
test-avx2: install
	@if [ -z "$(FORCE_AVX2_PASS)" ] && ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
		echo "make test-avx2: this CPU has no AVX-512, so make test already ran as an AVX2-only CPU: skipped"; \
	else ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(MAKE) --no-print-directory pytest \
		PYTEST_ARGS="-m 'not ddp' $(HW_TESTS) $(PYTEST_ARGS)"; fi

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
