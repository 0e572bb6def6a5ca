#!/usr/bin/env bash
# Once, here, with network: what bench/serving.py needs on the device and the device image lacks, into .whl/ (ignored
# by git, carried by the device call): SGLang's load client cut from the official sglang wheel (sglang/benchmark/ and
# the wheel's metadata and licence, bytes unchanged; the whole wheel is 39 MB) and the three compiled packages the
# client imports (msgspec, orjson, pybase64) as CPython 3.12 x86-64 wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG=${SGLANG_VERSION:-0.5.23}
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "sglang==$SGLANG"
"$PY" bench/serving.py --cut-client "$tmp"/sglang-"$SGLANG"-*.whl --to .whl/sglang-"$SGLANG"-client.zip
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl msgspec==0.23.0 orjson==3.13.0 pybase64==1.5.1
ls -l .whl/sglang-"$SGLANG"-client.zip .whl/msgspec-* .whl/orjson-* .whl/pybase64-*
