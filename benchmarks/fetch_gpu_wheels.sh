#!/usr/bin/env bash
# Fill .whl/ with the wheels the GPU machine lacks (it has Python 3.12, torch, pyyaml, tqdm, but no Hydra and no
# registry to fetch from): hydra-core, omegaconf, and antlr4-python3-runtime, which PyPI ships as an sdist only,
# so it is built here into a pure-Python wheel; the serve extra and the openai client with their dependencies; xgrammar
# (structured outputs) and what it imports beyond torch and triton (transformers and its own dependencies, numpy
# excepted: torch's). Run once from anywhere; gpu_check.sh installs what it finds there.
# .whl/ stays out of git through .git/info/exclude (a local rule, not .gitignore); name it in the run's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
exclude="$(git rev-parse --git-path info/exclude)"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl hydra-core==1.3.2 omegaconf==2.3.0
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl fastapi uvicorn prometheus-client openai httpx
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl xgrammar==0.2.9 apache-tvm-ffi transformers huggingface-hub hf-xet regex tokenizers \
    safetensors typer shellingham rich markdown-it-py mdurl pygments fsspec filelock

# No wheel on PyPI: build one (pure Python, so any interpreter here builds the same py3-none-any wheel).
if ! ls .whl/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
    python3 -m pip wheel --quiet --no-deps --no-cache-dir -w .whl antlr4-python3-runtime==4.9.3
fi
ls -l .whl
