# meshdit — GNU make build. `make` builds build/meshdit and build/libmeshdit.a; `make test` runs
# every test; `make check` runs the format check, cppcheck and clang-tidy; `make demo` runs the
# main job on the built-in tiny model. Switches: WERROR=1, DEBUG=1, SANITIZE=address,undefined.

CC       ?= gcc
MPI_PKG  ?= mpich
BUILD    ?= build
PKGS     := $(MPI_PKG) openblas libcjson
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)

WARN     := -Wall -Wextra -Wpedantic -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wvla
OPT      := -O3 -march=x86-64-v3 -mtune=generic
ifeq ($(DEBUG),1)
OPT      := -O0 -g3
endif
CFLAGS   ?=
CFLAGS   += -std=c11 $(WARN) $(OPT) -g -MMD -MP -Iinclude -Isrc $(PKG_CFLAGS)
ifeq ($(WERROR),1)
CFLAGS   += -Werror
endif
LDLIBS   += $(PKG_LIBS) -lm
ifneq ($(SANITIZE),)
CFLAGS   += -fsanitize=$(SANITIZE) -fno-omit-frame-pointer
LDFLAGS  += -fsanitize=$(SANITIZE)
endif

LIB_SRC  := $(filter-out src/cli/%,$(wildcard src/*/*.c src/*/*/*.c))
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o)
CLI_OBJ  := $(BUILD)/src/cli/main.o
TEST_SRC := $(wildcard tests/unit/test_*.c)
TEST_BIN := $(TEST_SRC:tests/unit/%.c=$(BUILD)/tests/%)
MPI_TEST_BIN := $(patsubst tests/mpi/%.c,$(BUILD)/tests/mpi/%,$(wildcard tests/mpi/test_*.c))
ALL_SRC  := $(wildcard include/*.h src/*/*.[ch] src/*/*/*.[ch] tests/unit/*.[ch] tests/mpi/*.c bench/*.c)

.PHONY: all test check format format-check cppcheck tidy demo clean goldens bench

all: $(BUILD)/meshdit $(TEST_BIN) $(MPI_TEST_BIN)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libmeshdit.a: $(LIB_OBJ)
	$(AR) rcs $@ $^

$(BUILD)/meshdit: $(CLI_OBJ) $(BUILD)/libmeshdit.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/tests/unit/%.o $(BUILD)/libmeshdit.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/tests/mpi/%: $(BUILD)/tests/mpi/%.o $(BUILD)/libmeshdit.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/tests/mpi/%.o: tests/mpi/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/unit -c $< -o $@

test: all
	@BUILD=$(BUILD) bash tests/run.sh

demo: all
	@bash scripts/demo

format:
	clang-format -i $(ALL_SRC)

format-check:
	clang-format --dry-run -Werror $(ALL_SRC)

cppcheck:
	cppcheck --quiet --error-exitcode=1 --std=c11 --enable=warning,performance,portability \
	  --inline-suppr --suppress=missingIncludeSystem -Iinclude -Isrc -Itests/unit src tests/unit tests/mpi

tidy:
	clang-tidy --quiet $(filter %.c,$(ALL_SRC)) -- -std=c11 -Iinclude -Isrc -Itests/unit $(PKG_CFLAGS)

check: format-check cppcheck tidy

BENCH_BIN := $(patsubst bench/%.c,$(BUILD)/bench/%,$(wildcard bench/*.c))
$(BUILD)/bench/%: $(BUILD)/bench/%.o $(BUILD)/libmeshdit.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

bench: $(BUILD)/meshdit $(BENCH_BIN)

goldens:
	python3 scripts/make_goldens.py

clean:
	rm -rf $(BUILD)

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_BIN:$(BUILD)/tests/%=$(BUILD)/tests/unit/%.d)
