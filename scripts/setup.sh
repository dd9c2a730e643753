# Sourced by scripts/bench.sh and scripts/test.sh: system packages, a virtualenv, the build.
# Env: JAX_MOE_A2A_NO_VENV=1 uses the current Python as is (e.g. a GPU image with jax installed);
#      JAX_MOE_A2A_EXTRAS (default "bench,test") selects the pip extras.
set -euo pipefail

_root_cmd() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

need_apt=()
command -v mpirun >/dev/null || need_apt+=(openmpi-bin libopenmpi-dev)
pkg-config --exists libfabric 2>/dev/null || need_apt+=(libfabric-dev libfabric-bin)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v g++ >/dev/null || need_apt+=(g++)
if [ -z "${VIRTUAL_ENV:-}" ] && [ "${JAX_MOE_A2A_NO_VENV:-0}" != 1 ] && ! python3 -c "import venv, ensurepip" 2>/dev/null; then
  need_apt+=(python3-venv python3-dev)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null; then
    echo "setup: installing system packages: ${need_apt[*]}"
    _root_cmd apt-get update -qq && _root_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null \
      || echo "setup: could not install ${need_apt[*]} (no root?); continuing without them"
  else
    echo "setup: please install: ${need_apt[*]} (Open MPI and libfabric development packages)"
  fi
fi

if [ -z "${VIRTUAL_ENV:-}" ] && [ "${JAX_MOE_A2A_NO_VENV:-0}" != 1 ]; then
  # --system-site-packages: reuse a jax (e.g. with the CUDA plugin) that the machine already has
  [ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi

python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import jax" 2>/dev/null || python -m pip install -q "jax>=0.6"
python -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja
# NVSHMEM headers and libraries for the nvshmem backend: only where nvcc exists (CMake builds the
# backend when it finds both), from the wheel matching the toolkit's CUDA major version.
if command -v nvcc >/dev/null; then
  cuda_major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  case "$cuda_major" in
    12|13) python -m pip install -q "nvidia-nvshmem-cu${cuda_major}>=3.4" \
             || echo "setup: could not install nvidia-nvshmem-cu${cuda_major}; the nvshmem backend will not be built" ;;
    *) echo "setup: CUDA ${cuda_major:-?} has no nvidia-nvshmem wheel; the nvshmem backend will not be built" ;;
  esac
fi
# Build against the jaxlib that runs it (the FFI headers must match): no build isolation.
python -m pip install -q --no-build-isolation ".[${JAX_MOE_A2A_EXTRAS:-bench,test}]"
# check from outside the source tree: there jax_moe_a2a/ has no _C and would shadow the install
(cd "${TMPDIR:-/tmp}" && python -c "import jax_moe_a2a._C as c; print('setup: jax_moe_a2a built; cuda kernels:', c.built_with_cuda(), '; nvshmem backend:', c.built_with_nvshmem(), '; libfabric engine:', c.built_with_libfabric())")
