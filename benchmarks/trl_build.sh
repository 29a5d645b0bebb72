#!/usr/bin/env bash
# TRL 1.16, the peer of `python bench.py --suite trl`, in a venv of its own. Never a nanospec
# dependency: the venv sees the project's packages through a .pth file (same torch, transformers,
# datasets, accelerate: TRL 1.16 is compatible with our pins) and adds only trl itself.
#
#   bash benchmarks/trl_build.sh            # fills $NANOSPEC_TRL (default ~/.cache/nanospec/trl)
set -euo pipefail
VERSION=${TRL_VERSION:-1.16.0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
DEST=${NANOSPEC_TRL:-${NANOSPEC_CACHE:-$HOME/.cache/nanospec}/trl}
"$PY" -m venv "$DEST"
"$PY" -c "import site; print(site.getsitepackages()[0])" \
    > "$("$DEST/bin/python" -c "import site; print(site.getsitepackages()[0])")/nanospec_base.pth"
"$DEST/bin/pip" install -q --no-deps "trl==$VERSION"
"$DEST/bin/python" -c "import trl, torch; print('trl', trl.__version__, 'torch', torch.__version__, '->', '$DEST')"
