#!/usr/bin/env bash
# Regenerates the type stubs of the native module jax_moe_a2a._C (cc/python/stubs/_C/*.pyi) with
# nanobind's stubgen, from the INSTALLED module: build and install first (pip install
# --no-build-isolation .), then run this and commit the result. tests/test_stubs.py fails while
# they differ from the module. Run it on a build with every part compiled (CUDA, NVSHMEM,
# libfabric) so no submodule is missing; --partial accepts a build without some.
#
# The stubs live outside jax_moe_a2a/ on purpose: a directory jax_moe_a2a/_C/ in the source tree
# would import as an (empty) namespace package where the extension is not built. CMake installs
# them next to the extension (jax_moe_a2a/_C/__init__.pyi, ...), where the .so wins at import.
#
#   scripts/gen_stubs.sh [--partial]     (PYTHON=... picks the interpreter; default python)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
DEST="$REPO/cc/python/stubs/_C"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"  # not the repository: the installed package, with its compiled _C
if [[ "${1:-}" != "--partial" ]]; then
  "$PY" -c "
import sys
from jax_moe_a2a import _C
missing = [p for p in ('cuda', 'nvshmem', 'libfabric') if not getattr(_C, 'built_with_' + p)()]
if missing:
    sys.exit('gen_stubs.sh: this build lacks ' + ', '.join(missing) + ' (its submodules would vanish '
             'from the stubs); build with everything, or pass --partial')
"
fi
"$PY" -m nanobind.stubgen -q -m jax_moe_a2a._C -r -O "$TMP/out"
rm -rf "$DEST" && mkdir -p "$DEST" && cp "$TMP"/out/_C/*.pyi "$DEST/"
"$PY" -c "import nanobind; print(nanobind.__version__)" > "$DEST/../NANOBIND_VERSION"  # tests/test_stubs.py compares
echo "wrote $(ls "$DEST" | wc -l) stubs to ${DEST#"$REPO"/}"
