#!/usr/bin/env bash
# Build Arctic Inference's suffix-decoding core (SuffixDecodingCache, Oliaro et al. 2024) on CPU, as the
# optional peer of `python bench.py --suite suffix`. Never a nanospec dependency: this only fills
# $NANOSPEC_ARCTIC (default ~/.cache/nanospec/arctic), which the bench puts on sys.path when present.
#
#   bash benchmarks/arctic_build.sh            # needs: pip registry access, cmake >= 3.18, a C++20 compiler
#
# Only csrc/suffix_decoding (C++ + nanobind) and the two Python files that wrap it are built/copied;
# the rest of the package (vLLM plugin, CUDA ops) is not. Nothing in the project's venv changes:
# nanobind goes into a scratch --target directory.
set -euo pipefail
VERSION=${ARCTIC_VERSION:-0.3.0}
PY=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
DEST=${NANOSPEC_ARCTIC:-${NANOSPEC_CACHE:-$HOME/.cache/nanospec}/arctic}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# 1. the source distribution (--no-build-isolation: pip only reads its metadata, builds nothing)
"$PY" -m pip download "arctic-inference==$VERSION" --no-deps --no-binary :all: --no-build-isolation -d "$WORK" -q
tar xzf "$WORK/arctic_inference-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/arctic_inference-$VERSION"

# 2. nanobind at the version Arctic's pyproject pins, into a scratch directory
"$PY" -m pip install -q --no-deps --target "$WORK/nb" nanobind==2.9.2

# 3. the extension (_C: SuffixTree, Draft); CMakeLists asks `python -m nanobind --cmake_dir`
PYTHONPATH="$WORK/nb" cmake -S "$SRC/csrc/suffix_decoding" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$PY" $(command -v ninja >/dev/null && echo -G Ninja)
cmake --build "$WORK/build" -j "${JOBS:-1}"

# 4. install: arctic_inference/suffix_decoding/{__init__,cache}.py + _C*.so under $DEST
mkdir -p "$DEST/arctic_inference/suffix_decoding"
: > "$DEST/arctic_inference/__init__.py"          # the package's own __init__ is not needed
cp "$SRC"/arctic_inference/suffix_decoding/{__init__,cache}.py "$DEST/arctic_inference/suffix_decoding/"
cp "$WORK"/build/_C*.so "$DEST/arctic_inference/suffix_decoding/"
echo "$VERSION" > "$DEST/VERSION"
PYTHONPATH="$DEST" "$PY" -c "
from arctic_inference.suffix_decoding import SuffixDecodingCache
c = SuffixDecodingCache(max_tree_depth=64)
c.start_request('r', [1, 2, 3, 1, 2])
assert c.speculate('r', [1, 2], max_spec_tokens=4).token_ids[:1] == [3]
print('arctic suffix decoding $VERSION ->', '$DEST')"
