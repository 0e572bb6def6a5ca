#!/usr/bin/env bash
# Once per checkout, here (PyPI reachable): what the device image lacks, as CPython 3.12 x86-64 wheels into .whl/
# (ignored by git; a device call carries it with carry [".whl"]). The device has torch, triton, numpy, safetensors,
# tokenizers and an older transformers; the engine, the server, the HF oracle and fla-core's kernels need the rest.
#   bash bench/device_wheels.sh          then on the device, first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
platforms=()
for n in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_17 2_5; do platforms+=(--platform "manylinux_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# The versions this checkout's CPU environment runs, so the device runs the same code.
PACKAGES=(fla-core==0.6.0 einops==0.8.2 transformers==5.24.0
  starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 typer==0.29.2 shellingham==1.5.4
  annotated-doc==0.0.7 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0 openai==3.57.0 httpx==0.29.0 httpcore==1.0.9 httpx2==2.16.2 httpcore2==2.16.2
  truststore==0.10.5 idna==3.20 certifi==2026.10.19.post1 distro==1.9.0 jiter==0.19.0
  llguidance==1.9.1 xxhash==4.1.0 prometheus_client==0.26.0 pluggy==1.7.0 attrs==26.1.0 click==8.5.1 rich==15.0.0
  markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl "${PACKAGES[@]}"
du -sh .whl
