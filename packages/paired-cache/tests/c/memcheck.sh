#!/usr/bin/env bash
# Builds the C core with its test driver and runs it under valgrind memcheck.
# Zero errors and zero leaks are required: valgrind's exit code fails the run.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
csrc="$here/../../csrc"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
gcc -std=c11 -Wall -Wextra -Wpedantic -Werror -g -O1 -pthread -I"$csrc" \
    "$csrc/pc_cache.c" "$csrc/pc_update.c" "$csrc/pc_parallel.c" "$csrc/pc_rows.c" "$csrc/pc_select.c" \
    "$here/test_core.c" \
    -lm -o "$build/test_core"
valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=all \
    --show-leak-kinds=all --track-origins=yes "$@" "$build/test_core"
