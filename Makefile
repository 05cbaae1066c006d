# mtrace-live developer entry points. `make test` is the one CI runs.
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
BUILD := build
CFLAGS_WORKLOAD := -O1 -g -fno-omit-frame-pointer -Wall -Wextra -fno-builtin -U_FORTIFY_SOURCE -pthread
SETUP_STAMP := $(VENV)/.mtrace-live-setup

# fixtures is not part of test: the ELF fixtures are committed, and rebuilt
# only when their sources change.
.PHONY: fixtures all setup sdt-glibc glibc-malloc-tests exercisers bench fuzz soak test test-unit test-privileged lint typecheck vagrant-validate demo clean

all: setup exercisers

setup:
	bash scripts/setup.sh

sdt-glibc: setup
	bash scripts/sdt-glibc.sh

# glibc's own malloc tests, built in the SDT glibc's build tree (minutes,
# once): tests/privileged/test_glibc_malloc_tests.py runs them traced.
glibc-malloc-tests: sdt-glibc
	bash scripts/sdt-glibc.sh --malloc-tests

WORKLOADS := probe_exerciser kmem_exerciser mallopt_loop jmp_loop arena_contention arena_waits stdio_wait lock_wait_calls alloc_workload alloc_bench churn leader_exit stack_fan builtin_alloc hold_blocks allocator_entries probe_moves
# Built as distributions build their programs: -O2, no frame pointers, PIE,
# shared libraries (the unwinding by CFI, tests/privileged/test_cfi_stacks.py).
CFLAGS_DISTRO := -O2 -g -fomit-frame-pointer -Wall -Wextra
CFI_WORKLOADS := libcfi_deep.so libcfi_plugin.so cfi_stacks cxx_stacks lock_chains short_chain llvm_user
# The allocation workload linked against each allocator (its DT_NEEDED before
# the libc's), for tests/privileged/test_allocators.py.
LINKED_ALLOCATORS := jemalloc tcmalloc_minimal mimalloc
exercisers: $(addprefix $(BUILD)/,$(WORKLOADS) $(CFI_WORKLOADS) libbump_malloc.so) \
	$(addprefix $(BUILD)/alloc_workload-,$(LINKED_ALLOCATORS)) $(BUILD)/two_providers

# jemalloc's malloc beside the libc's own, called by dlsym: two providers in one process.
$(BUILD)/two_providers: tests/workloads/two_providers.c | $(BUILD)
	gcc $(CFLAGS_WORKLOAD) -o $@ $< $(firstword $(wildcard /usr/lib/$(shell gcc -print-multiarch)/libjemalloc.so.*))

$(BUILD)/alloc_workload-%: tests/workloads/alloc_workload.c | $(BUILD)
	gcc $(CFLAGS_WORKLOAD) -o $@ $< $(firstword $(wildcard /usr/lib/$(shell gcc -print-multiarch)/lib$*.so.*))

# An allocator mtrace-live does not know (tests/privileged/test_allocators.py).
$(BUILD)/libbump_malloc.so: tests/workloads/bump_malloc.c | $(BUILD)
	gcc $(CFLAGS_DISTRO) -fPIC -shared -o $@ $<

$(BUILD)/libcfi_%.so: tests/workloads/cfi/%.c | $(BUILD)
	gcc $(CFLAGS_DISTRO) -fPIC -shared -o $@ $<

$(BUILD)/cfi_stacks: tests/workloads/cfi/cfi_stacks.c $(BUILD)/libcfi_deep.so | $(BUILD)
	gcc $(CFLAGS_DISTRO) -fPIE -pie -o $@ $< -L$(BUILD) -lcfi_deep -Wl,-rpath,'$$ORIGIN' -pthread -ldl

$(BUILD)/short_chain: tests/workloads/cfi/short_chain.c | $(BUILD)
	gcc $(CFLAGS_DISTRO) -fPIE -pie -o $@ $<

$(BUILD)/llvm_user: tests/workloads/cfi/llvm_user.c | $(BUILD)
	gcc $(CFLAGS_DISTRO) -fPIE -pie -o $@ $< -ldl

$(BUILD)/lock_chains: tests/workloads/cfi/lock_chains.c | $(BUILD)
	gcc $(CFLAGS_DISTRO) -fPIE -pie -o $@ $< -pthread -ldl

$(BUILD)/cxx_stacks: tests/workloads/cfi/cxx_stacks.cc | $(BUILD)
	g++ $(filter-out -g,$(CFLAGS_DISTRO)) -fPIE -pie -o $@ $<

$(BUILD)/%: tests/workloads/%.c | $(BUILD)
	gcc $(CFLAGS_WORKLOAD) -o $@ $<

$(BUILD):
	mkdir -p $@

FIXTURES := tests/fixtures
fixtures:
	gcc -O2 -fPIC -shared -o $(FIXTURES)/elf/sdt_fixture.so $(FIXTURES)/sdt_fixture.c $(FIXTURES)/sdt_semaphore.c
	strip -o $(FIXTURES)/elf/sdt_fixture_stripped.so $(FIXTURES)/elf/sdt_fixture.so
	gcc -O2 -fPIC -shared -o $(FIXTURES)/elf/no_notes.so $(FIXTURES)/no_notes.c

# Everything: set-up, the SDT glibc, the exercisers, lint, and all tests,
# privileged ones included (they fail, never skip, when BPF cannot run).
test: sdt-glibc glibc-malloc-tests exercisers lint vagrant-validate
	$(BIN)/pytest tests

# Needs no root once the set-up has run (as root) once.
test-unit: $(SETUP_STAMP)
	$(BIN)/pytest -p no:cacheprovider tests/unit

$(SETUP_STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

test-privileged: sdt-glibc glibc-malloc-tests exercisers
	$(BIN)/pytest tests/privileged

# mypy cannot follow setuptools' editable import finder, so it reads the
# package through a link tree with the installed names.
typecheck: setup
	mkdir -p $(BUILD)/typecheck/mtrace_live
	for d in probes tracer exporters; do ln -sfn ../../../$$d $(BUILD)/typecheck/mtrace_live/$$d; done
	$(BIN)/mypy -p mtrace_live

lint: setup typecheck
	$(BIN)/ruff check probes tracer exporters tests bench
	$(BIN)/ruff format --check probes tracer exporters tests bench

# The Vagrantfile must stay valid. This machine has no VM provider, so the
# provider block is not checked; Debian's vagrant package is installed if absent.
vagrant-validate:
	@command -v vagrant >/dev/null || { echo "installing Debian's vagrant package to validate vagrant/Vagrantfile"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends vagrant >/tmp/mtrace-live-vagrant.log 2>&1; }
	cd vagrant && vagrant validate --ignore-provider

# The main job: the live view (on a terminal; plain event lines otherwise) of
# a multithreaded arena-contention workload under the SDT glibc, for 10 s;
# then the probe exerciser counted against its own ground truth.
demo: sdt-glibc exercisers
	$(BIN)/mtrace-live run --sdt-glibc -- $(BUILD)/arena_contention 10
	@echo
	@echo "The probe exerciser, counted, side by side with what it says it caused:"
	@$(BIN)/mtrace-live count --sdt-glibc --json -- $(BUILD)/probe_exerciser \
	  --out $(BUILD)/ground-truth.json >$(BUILD)/demo-counts.json
	@$(BIN)/python scripts/compare-ground-truth $(BUILD)/demo-counts.json $(BUILD)/ground-truth.json

# Every benchmark, side by side with bpftrace, bcc's trace and perf, in one
# run; writes docs/bench.json and docs/performance.md (root; about 45 minutes
# on 2 CPUs: 30.7 measured before section 9, which took 7.1, and section 8c 7). QUICK=1: one
# repetition of each, smaller workloads, no probe hit rates (section 7): 6 to 9 minutes.
# BENCH="--only usdt,kmem" runs some sections; BENCH=--rewrite only rewrites
# docs/performance.md from docs/bench.json.
bench: sdt-glibc exercisers
	QUICK=$(QUICK) $(BIN)/python bench/run.py $(BENCH)

# Hours of churn (tests/soak/soak.py, as root): serve system-wide and serve
# --pid beside bpftrace for SOAK_MINUTES (default 30) while the churn workload
# starts and ends processes by the thousand; checks counts, RSS, label caps,
# map use and leftovers, and (10 minutes or more) writes the soak section of
# docs/reliability.md and docs/soak.svg. First, the tests marked soak: the
# cases too slow for make test's 20 minutes (a 60-second run of the churn
# among them).
SOAK_MINUTES ?= 30
soak: sdt-glibc glibc-malloc-tests exercisers $(SETUP_STAMP)
	$(BIN)/pytest -m soak tests
	SOAK_MINUTES=$(SOAK_MINUTES) $(BIN)/python -m tests.soak.soak

# Every reader of untrusted input under atheris (coverage-guided), RUNS
# inputs each (default 250000), and the kmemtrace walker's C code natively
# under libFuzzer, ASan and UBSan, NATIVE_RUNS inputs (default 1000000);
# writes docs/fuzzing.md and fails on any finding. TARGETS=json,walker-native
# runs some. The first run installs atheris into .venv (the fuzz extra).
fuzz: $(SETUP_STAMP)
	@$(BIN)/python -c 'import atheris' 2>/dev/null || $(BIN)/pip install --quiet --disable-pip-version-check -e '.[fuzz]'
	RUNS=$(RUNS) NATIVE_RUNS=$(NATIVE_RUNS) TARGETS=$(TARGETS) $(BIN)/python tests/fuzz/fuzz.py

clean:
	rm -rf $(BUILD)
