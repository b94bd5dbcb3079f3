#!/usr/bin/env bash
# Fails, naming the files, when a tracked file still holds merge-conflict markers (lines that
# start with "<<<<<<< " or ">>>>>>> "): a merge committed half-resolved. Run by CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
if found=$(git grep -lE '^(<<<<<<<|>>>>>>>) ' -- . 2>/dev/null); then
  echo "merge-conflict markers in: $found" >&2
  exit 1
fi
echo "no merge-conflict markers"
