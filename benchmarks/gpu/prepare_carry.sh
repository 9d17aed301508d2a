#!/usr/bin/env bash
# Fill .carry/ (ignored by git) with what the H200 image lacks for benchmarks/gpu/device_check.sh:
# wheels for Python 3.12 (msgspec, gguf) and the embedded model's GGUF cut in two parts, since
# one device call carries at most 64 MiB: the first call carries .carry/one, the second .carry/two
# (a warm machine keeps the first) and runs the check. See benchmarks/gpu/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
rm -rf .carry && mkdir -p .carry/one .carry/two
PIP="${PYTHON:-.venv/bin/python} -m pip"
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .carry/two "msgspec==0.23.0" "gguf==0.19.0"
gguf=$(${PYTHON:-.venv/bin/python} -c "from tripod.loader.embedded import embedded_model_path; print(embedded_model_path())")
split -n 2 -d "$gguf" .carry/gguf.part
mv .carry/gguf.part00 .carry/one/ && mv .carry/gguf.part01 .carry/two/
du -sh .carry/one .carry/two
