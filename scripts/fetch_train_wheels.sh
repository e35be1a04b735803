#!/usr/bin/env bash
# Fetch the wheels scripts/retrain_drafter.sh installs on the H200 (no network there) into
# .train_whl (git-ignored; carry it: the device tool's `carry: [".train_whl"]`):
# transformers and dflash at this machine's versions (pure Python) and regex built for the
# device's Python 3.12 (manylinux x86_64).
#
#   bash scripts/fetch_train_wheels.sh [DIR]      (default .train_whl; ~12 MB)
set -euo pipefail
DIR=${1:-.train_whl}
mkdir -p "$DIR"
ver() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
python -m pip download -q --no-deps -d "$DIR" "transformers==$(ver transformers)" "dflash==$(ver dflash)"
python -m pip download -q --no-deps -d "$DIR" --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 "regex==$(ver regex)"
ls -la "$DIR"
