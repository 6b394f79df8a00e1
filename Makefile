# meshdit — GNU make build. `make` builds build/meshdit and build/libmeshdit.a; `make test` runs
# every test; `make check` runs the format check, the layer check (scripts/check-layers), cppcheck
# and clang-tidy; `make demo` runs the main job on the built-in tiny model.
# Switches: WERROR=1, DEBUG=1, SANITIZE=address,undefined.

CC       ?= gcc
MPI_PKG  ?= mpich
BUILD    ?= build
PKGS     := $(MPI_PKG) openblas libcjson libzmq
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)

WARN     := -Wall -Wextra -Wpedantic -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wvla
# The library targets the architecture's baseline; the CPU kernels (src/kernels/cpu/cpu.c) are
# compiled once per instruction set and picked at run time (cpu_dispatch.c).
ARCH     := $(shell uname -m)
ifeq ($(ARCH),x86_64)
OPT      := -O3 -march=x86-64 -mtune=generic -fno-trapping-math
CPU_ISAS := x86_64 avx2 avx512
else
OPT      := -O3 -fno-trapping-math
CPU_ISAS := generic
endif
ISA_FLAGS_x86_64  := -march=x86-64 -DMDT_CPU_ISA=1
ISA_FLAGS_avx2    := -march=x86-64-v3 -DMDT_CPU_ISA=2
ISA_FLAGS_avx512  := -march=x86-64-v4 -mprefer-vector-width=512 -DMDT_CPU_ISA=3
ISA_FLAGS_generic := -DMDT_CPU_ISA=0
ifeq ($(DEBUG),1)
OPT      := -O0 -g3
endif
CFLAGS   ?=
CFLAGS   += -std=c11 $(WARN) $(OPT) -g -MMD -MP -Iinclude -Isrc $(PKG_CFLAGS)
ifeq ($(WERROR),1)
CFLAGS   += -Werror
endif
# oneDNN (Debian libdnnl-dev, no pkg-config file): the CPU GEMM path on bf16 hardware (gemm.h);
# built with the OpenMP runtime, so libgomp too
LDLIBS   += $(PKG_LIBS) -ldnnl -lgomp -lm -ldl -lpthread
ifneq ($(SANITIZE),)
CFLAGS   += -fsanitize=$(SANITIZE) -fno-sanitize-recover=all -fno-omit-frame-pointer
LDFLAGS  += -fsanitize=$(SANITIZE) -fno-sanitize-recover=all
endif

LIB_SRC  := $(filter-out src/cli/% src/kernels/cpu/cpu.c,$(wildcard src/*/*.c src/*/*/*.c))
CPU_OBJ  := $(CPU_ISAS:%=$(BUILD)/src/kernels/cpu/isa/cpu_%.o)
# built-in config presets (configs/presets/FAMILY.NAME.json), embedded as a generated C table
PRESETS  := $(sort $(wildcard configs/presets/*.json))
PRESET_OBJ := $(BUILD)/gen/presets.o
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o) $(CPU_OBJ) $(PRESET_OBJ)
CLI_OBJ  := $(patsubst %.c,$(BUILD)/%.o,$(wildcard src/cli/*.c))
TEST_SRC := $(wildcard tests/unit/test_*.c)
TEST_BIN := $(TEST_SRC:tests/unit/%.c=$(BUILD)/tests/%)
MPI_TEST_BIN := $(patsubst tests/mpi/%.c,$(BUILD)/tests/mpi/%,$(wildcard tests/mpi/test_*.c))
FUZZ_NAMES := $(patsubst tests/fuzz/fuzz_%.c,%,$(wildcard tests/fuzz/fuzz_*.c))
REPLAY_BIN := $(FUZZ_NAMES:%=$(BUILD)/tests/replay_%)
ALL_SRC  := $(wildcard include/*.h src/*/*.[ch] src/*/*/*.[ch] tests/unit/*.[ch] tests/mpi/*.c tests/cli/*.c tests/gpu/*.c tests/fuzz/*.c bench/*.c tools/*.c)

.DEFAULT_GOAL := all

# CUDA backend: a plugin (build/libmeshdit_cuda.so) that `--device cuda` opens at run time, built
# whenever nvcc is found (NVCC=none skips it). sm_90 machine code plus compute_90 PTX.
NVCC     ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_ARCH ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
NVFLAGS  ?= -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -fPIC,-fvisibility=hidden,-Wall -Isrc
# the plugin: the kernels by concern (kernels/cuda) and the NCCL collectives (comm/nccl.cu)
CUDA_SRC := $(wildcard src/kernels/cuda/*.cu) src/comm/nccl.cu
CUDA_HDR := $(wildcard src/kernels/cuda/*.cuh) src/kernels/ops.h src/comm/device_comm.h
CUDA_LIB := $(if $(filter-out none,$(NVCC)),$(BUILD)/libmeshdit_cuda.so)

$(BUILD)/libmeshdit_cuda.so: $(CUDA_SRC) $(CUDA_HDR)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -shared -o $@ $(CUDA_SRC) -lcublas -ldl \
	  -Xlinker -rpath,$(CUDA_HOME)/lib64:/usr/local/cuda/lib64

cuda: $(CUDA_LIB)

.PHONY: test-cluster all test check cuda format format-check layers cppcheck tidy demo clean goldens bench fuzz fuzz-build \
        valgrind test-sanitize campaign venv test-python demo-python

all: $(BUILD)/meshdit $(TEST_BIN) $(MPI_TEST_BIN) $(REPLAY_BIN) $(CUDA_LIB) $(BUILD)/tests/gpu/test_gpu \
     $(BUILD)/tests/serve_client $(BUILD)/libmeshdit_loopback.so

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(CPU_OBJ): $(BUILD)/src/kernels/cpu/isa/cpu_%.o: src/kernels/cpu/cpu.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(ISA_FLAGS_$*) -c $< -o $@

$(BUILD)/gen/presets.c: $(PRESETS) scripts/embed-presets
	@mkdir -p $(dir $@)
	scripts/embed-presets $@ $(PRESETS)

$(PRESET_OBJ): $(BUILD)/gen/presets.c
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libmeshdit.a: $(LIB_OBJ)
	rm -f $@ && $(AR) rcs $@ $^

$(BUILD)/meshdit: $(CLI_OBJ) $(BUILD)/libmeshdit.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/tests/unit/%.o $(BUILD)/libmeshdit.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/tests/mpi/%: $(BUILD)/tests/mpi/%.o $(BUILD)/libmeshdit.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

# the CUDA backend's kernel checks: built always (plain C), run by scripts/gpu-check only
$(BUILD)/tests/gpu/test_gpu: tests/gpu/test_gpu.c $(BUILD)/libmeshdit.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/unit $(LDFLAGS) -o $@ $< $(BUILD)/libmeshdit.a $(LDLIBS)

# preloaded into a one-host job's mpiexec by the Python package: its sockets stay on loopback
$(BUILD)/libmeshdit_loopback.so: tools/loopback_bind.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 $(WARN) -O2 -fPIC -shared -o $@ $< -ldl

# the test client of `meshdit serve` (tests/cli/test_serve.sh), on libzmq directly
$(BUILD)/tests/serve_client: tests/cli/serve_client.c $(BUILD)/libmeshdit.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(BUILD)/libmeshdit.a $(LDLIBS)

$(BUILD)/tests/mpi/%.o: tests/mpi/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/unit -c $< -o $@

$(BUILD)/tests/replay_%: tests/fuzz/fuzz_%.c tests/fuzz/replay.c $(BUILD)/libmeshdit.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ tests/fuzz/fuzz_$*.c tests/fuzz/replay.c $(BUILD)/libmeshdit.a $(LDLIBS)

# libFuzzer targets (clang): `make fuzz FUZZ_SECONDS=N` runs each for N seconds on a copy of
# its seed corpus; a crash leaves its input in build-fuzz/ (keep it under tests/fuzz/regress/).
FUZZ_SECONDS ?= 60
FUZZ_BUILD   ?= build-fuzz
FUZZ_SAN     := -fsanitize=address,undefined -fno-sanitize-recover=all
fuzz-build:
	$(MAKE) CC=clang BUILD=$(FUZZ_BUILD) OPT="-O1 -g -march=x86-64-v3" \
	  SANITIZE=fuzzer-no-link,address,undefined $(FUZZ_BUILD)/libmeshdit.a
	for t in $(FUZZ_NAMES); do \
	  clang -std=c11 -O1 -g -fsanitize=fuzzer $(FUZZ_SAN) -Iinclude -Isrc $(PKG_CFLAGS) \
	    -o $(FUZZ_BUILD)/fuzz_$$t tests/fuzz/fuzz_$$t.c $(FUZZ_BUILD)/libmeshdit.a $(LDLIBS) || exit 1; \
	done

fuzz: fuzz-build
	for t in $(FUZZ_NAMES); do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$t && cp tests/fuzz/corpus/$$t/* $(FUZZ_BUILD)/corpus/$$t/ && \
	  (cd $(FUZZ_BUILD) && ./fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	    -timeout=10 -rss_limit_mb=2048 corpus/$$t ../tests/fuzz/regress/$$t) || exit 1; \
	done

test: all
	@BUILD=$(BUILD) SANITIZE=$(SANITIZE) bash tests/run.sh

# memcheck on the single-rank golden run (and the sampler): no error, no definite leak
valgrind: all
	OPENBLAS_NUM_THREADS=1 valgrind --error-exitcode=3 --leak-check=full \
	  --errors-for-leak-kinds=definite --suppressions=tests/valgrind.supp -q $(BUILD)/meshdit run \
	  --checkpoint tests/data/flux_tiny --inputs tests/data/flux_tiny/inputs.safetensors \
	  --out /tmp/meshdit-valgrind.safetensors --steps 2 --quiet
	OPENBLAS_NUM_THREADS=1 valgrind --error-exitcode=3 --leak-check=full \
	  --errors-for-leak-kinds=definite --suppressions=tests/valgrind.supp -q $(BUILD)/meshdit run \
	  --checkpoint tests/data/h3_tiny --inputs tests/data/h3_tiny/inputs.safetensors \
	  --out /tmp/meshdit-valgrind.safetensors --quiet
	@echo "valgrind: memcheck clean"

# the whole suite under AddressSanitizer + UndefinedBehaviorSanitizer, in its own build folder
test-sanitize:
	$(MAKE) BUILD=build-asan SANITIZE=address,undefined all
	$(MAKE) BUILD=build-asan SANITIZE=address,undefined test

demo: all
	@bash scripts/demo

# the hostile-input campaign (docs/reliability.md): every case classified, table in $(BUILD)/reliability.md
campaign: $(BUILD)/meshdit
	python3 scripts/reliability-campaign --bin $(BUILD)/meshdit --out $(BUILD)/reliability.md

format:
	clang-format -i $(ALL_SRC)

format-check:
	clang-format --dry-run -Werror $(ALL_SRC)

cppcheck:
	cppcheck --quiet --error-exitcode=1 --std=c11 --enable=warning,performance,portability \
	  --inline-suppr --suppress=missingIncludeSystem -Iinclude -Isrc -Itests/unit src tests/unit tests/mpi tests/cli tools

layers:
	scripts/check-layers

tidy:
	clang-tidy --quiet $(filter %.c,$(ALL_SRC)) -- -std=c11 -Iinclude -Isrc -Itests/unit $(PKG_CFLAGS)

check: format-check layers cppcheck tidy

BENCH_BIN := $(patsubst bench/%.c,$(BUILD)/bench/%,$(wildcard bench/*.c))
$(BUILD)/bench/%: $(BUILD)/bench/%.o $(BUILD)/libmeshdit.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

bench: $(BUILD)/meshdit $(BENCH_BIN)

goldens:
	python3 scripts/make_goldens.py

# the Python package against real servers and diffusers pipelines (tests/python): a venv from
# PyPI (tests/python/requirements.txt) in $(VENV), the package installed with `pip install ./python`
VENV ?= .venv
$(VENV)/.installed: tests/python/requirements.txt python/pyproject.toml $(wildcard python/meshdit/*.py)
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --force-reinstall --no-deps ./python
	touch $@

venv: $(VENV)/.installed

# FluxPipeline with diffusers' transformer and with meshdit's on 4 ranks: two PNGs in out/diffusers-demo
demo-python: $(BUILD)/meshdit venv
	MESHDIT_BIN=$(abspath $(BUILD)/meshdit) $(VENV)/bin/python scripts/diffusers-demo

test-python: $(BUILD)/meshdit venv
	MESHDIT_BIN=$(abspath $(BUILD)/meshdit) OPENBLAS_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q tests/python

# Several hosts on this machine (network namespaces, Open MPI over TCP): layouts across hosts
# against one rank, placement, a host whose link is cut. Needs root; skips with a reason if not.
test-cluster: $(BUILD)/meshdit
	tests/cluster/test_cluster.sh

clean:
	rm -rf $(BUILD) $(FUZZ_BUILD) build-asan build-ompi

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_BIN:$(BUILD)/tests/%=$(BUILD)/tests/unit/%.d)
