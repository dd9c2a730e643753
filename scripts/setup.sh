# Sourced by scripts/bench.sh and scripts/test.sh: system packages, a virtualenv, jax, the build.
# Idempotent: a second run skips what is there and rebuilds the extension.
# Env: JAX_MOE_A2A_NO_VENV=1   use the current Python as is (e.g. a GPU image with jax installed);
#      JAX_MOE_A2A_EXTRAS      pip extras (default "bench,test");
#      JAX_MOE_A2A_NO_APT=1    never run apt-get (nor sudo): print the packages to install instead;
#      JAX_MOE_A2A_SETUP_DRY_RUN=1  print the apt-get and pip commands instead of running them
#                              (the virtualenv is still made; nothing is installed or built).
set -euo pipefail

_dry() { [ "${JAX_MOE_A2A_SETUP_DRY_RUN:-0}" = 1 ]; }
_run() { if _dry; then echo "setup: [dry run] $*" >&2; else "$@"; fi; }
_root_cmd() {
  if [ "$(id -u)" = 0 ]; then _run "$@"
  elif command -v sudo >/dev/null; then _run sudo "$@"
  else return 1; fi
}

# CUDA major version for jax's CUDA wheels (jax[cuda12] / jax[cuda13]), or nothing when no GPU is
# visible. The toolkit's (nvcc) major version when nvcc exists, so that jax's CUDA libraries and
# the NVSHMEM wheel the build links match the kernels' toolkit; otherwise the driver's (the
# "CUDA Version" nvidia-smi prints: the newest CUDA the driver runs). Prints "<major> <why>".
_jax_cuda_major() {
  command -v nvidia-smi >/dev/null || return 0
  local gpus driver toolkit major why
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  [ "${gpus:-0}" -gt 0 ] || return 0
  driver=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n1 || true)
  if command -v nvcc >/dev/null; then
    toolkit=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p' | head -n1 || true)
  fi
  if [ -n "${toolkit:-}" ]; then
    major=$toolkit; why="nvcc's CUDA ${toolkit}"
    if [ -n "$driver" ] && [ "$driver" -lt "$toolkit" ]; then
      major=$driver; why="the driver's CUDA ${driver} (older than nvcc's ${toolkit})"
    fi
  elif [ -n "$driver" ]; then
    major=$driver; why="the driver's CUDA ${driver} (nvidia-smi; no nvcc)"
  else
    echo "none nvidia-smi lists ${gpus} GPU(s) but no CUDA version"; return 0
  fi
  if [ "$major" -gt 13 ]; then why="$why; newest jax CUDA wheels are for CUDA 13"; major=13; fi
  if [ "$major" -lt 12 ]; then echo "none ${why}: jax has CUDA wheels for CUDA 12 and 13 only"; return 0; fi
  echo "$major ${gpus} GPU(s), ${why}"
}

# --- 1. system packages ------------------------------------------------------------------------
echo "setup [1/5] system packages (Open MPI, libfabric, a C++ compiler)"
need_apt=()
command -v mpirun >/dev/null || need_apt+=(openmpi-bin libopenmpi-dev)
pkg-config --exists libfabric 2>/dev/null || need_apt+=(libfabric-dev libfabric-bin)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v g++ >/dev/null || need_apt+=(g++)
if [ -z "${VIRTUAL_ENV:-}" ] && [ "${JAX_MOE_A2A_NO_VENV:-0}" != 1 ] && ! python3 -c "import venv, ensurepip" 2>/dev/null; then
  need_apt+=(python3-venv python3-dev)
fi
if [ ${#need_apt[@]} -eq 0 ]; then
  echo "setup: system packages present"
elif [ "${JAX_MOE_A2A_NO_APT:-0}" = 1 ] || ! command -v apt-get >/dev/null; then
  echo "setup: missing system packages: ${need_apt[*]}"
  echo "setup: not installing them (JAX_MOE_A2A_NO_APT=1 or no apt-get); on Debian/Ubuntu:"
  echo "         sudo apt-get install -y ${need_apt[*]}"
  echo "setup: continuing without them (no mpirun: no multi-process tests; no libfabric: no host backend)"
else
  via=$([ "$(id -u)" = 0 ] && echo "as root" || echo "through sudo")
  echo "setup: apt-get will install (${via}): ${need_apt[*]}"
  echo "setup:   (JAX_MOE_A2A_NO_APT=1 skips this and prints the list instead)"
  { _root_cmd apt-get update -qq && _root_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null; } \
    || echo "setup: could not install ${need_apt[*]} (no root or sudo?); continuing without them"
fi

# --- 2. virtualenv -----------------------------------------------------------------------------
if [ -z "${VIRTUAL_ENV:-}" ] && [ "${JAX_MOE_A2A_NO_VENV:-0}" != 1 ]; then
  # --system-site-packages: reuse a jax (e.g. with the CUDA plugin) that the machine already has
  if [ -x .venv/bin/python ]; then
    echo "setup [2/5] virtualenv .venv (exists; activate it with: source .venv/bin/activate)"
  else
    echo "setup [2/5] virtualenv .venv (new; activate it later with: source .venv/bin/activate)"
    python3 -m venv --system-site-packages .venv
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
else
  echo "setup [2/5] virtualenv: none, using $(command -v python) (JAX_MOE_A2A_NO_VENV=1 or a venv is active)"
fi

# --- 3. jax --------------------------------------------------------------------------------------
_run python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
read -r cuda_major cuda_why <<<"$(_jax_cuda_major) " || true
if python -c "import jax" 2>/dev/null; then
  echo "setup [3/5] jax $(python -c 'import jax; print(jax.__version__)') is installed: kept as is"
  if [ -n "$cuda_major" ] && [ "$cuda_major" != none ] \
     && ! python -c "import importlib.util as u, sys; sys.exit(not any(u.find_spec(m) for m in ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13')))" 2>/dev/null; then
    echo "setup: WARNING: this machine has ${cuda_why}, but the installed jax has no CUDA plugin:"
    echo "setup:          everything will run on the CPU. To use the GPUs: pip install \"jax[cuda${cuda_major}]\""
  fi
elif [ -n "$cuda_major" ] && [ "$cuda_major" != none ]; then
  echo "setup [3/5] jax: installing jax[cuda${cuda_major}] (${cuda_why})"
  _run python -m pip install -q "jax[cuda${cuda_major}]>=0.7.1"
else
  echo "setup [3/5] jax: installing jax for CPU (${cuda_why:-nvidia-smi sees no GPU})"
  _run python -m pip install -q "jax>=0.7.1"
fi

# --- 4. build tools -------------------------------------------------------------------------------
echo "setup [4/5] build tools (scikit-build-core, nanobind, cmake, ninja)"
_run python -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja
# NVSHMEM headers and libraries for the nvshmem backend: only where nvcc exists (CMake builds the
# backend when it finds both), from the wheel matching the toolkit's CUDA major version.
if command -v nvcc >/dev/null; then
  nvcc_major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  case "$nvcc_major" in
    12|13) echo "setup: nvidia-nvshmem-cu${nvcc_major} for the nvshmem backend (nvcc's CUDA ${nvcc_major})"
           _run python -m pip install -q "nvidia-nvshmem-cu${nvcc_major}>=3.4" \
             || echo "setup: could not install nvidia-nvshmem-cu${nvcc_major}; the nvshmem backend will not be built" ;;
    *) echo "setup: CUDA ${nvcc_major:-?} has no nvidia-nvshmem wheel; the nvshmem backend will not be built" ;;
  esac
  # CUTLASS / CuTe headers for the grouped expert GEMMs (cc/gemm): the nvidia-cutlass wheel, headers
  # only (--no-deps: its Python generator's dependencies are not needed to compile against it).
  echo "setup: nvidia-cutlass headers for the grouped-GEMM kernels"
  _run python -m pip install -q --no-deps "nvidia-cutlass==4.2.0.0" \
    || echo "setup: could not install nvidia-cutlass; the grouped-GEMM kernels will not be built"
fi

# --- 5. the build ---------------------------------------------------------------------------------
# Build against the jaxlib that runs it (the FFI headers must match): no build isolation. pip -v
# shows the CMake configure lines and ninja's [n/N] progress; the full log goes to build/.
mkdir -p build
build_log=build/setup-build.log
if command -v nvcc >/dev/null; then
  echo "setup [5/5] building jax_moe_a2a with the CUDA kernels (nvcc found; several minutes on few cores; log: ${build_log})"
else
  echo "setup [5/5] building jax_moe_a2a (no nvcc: CPU parts only; log: ${build_log})"
fi
_build_filter() {
  # CMake's status lines and ninja's progress, shortened ("[12/40] cc/cuda/dispatch/send.cu"),
  # compiler errors, scikit-build-core's stages; `t` ends a line's processing once one matched.
  sed -u -n -e 's/^ *\(-- \(CUDA\|grouped GEMMs\|nvshmem\|libfabric\|XLA FFI\|The CXX\|The CUDA\|Build files\).*\)$/setup:   \1/p' -e t \
            -e 's/^ *\(\[[0-9]*\/[0-9]*\]\) [A-Za-z]* [A-Za-z+]* object .*\.dir\/\(.*\)\.o$/setup:   \1 \2/p' -e t \
            -e 's/^ *\(\[[0-9]*\/[0-9]*\]\) Linking .* \(.*\)$/setup:   \1 link \2/p' -e t \
            -e 's/^\(.*\(error:\|Error:\|CMake Error\|FAILED:\|ninja: build stopped\).*\)$/setup:   \1/p' -e t \
            -e 's/^ *\(\*\*\* .*\)$/setup:   \1/p' -e t \
            -e 's/^\(Successfully installed .*\)$/setup:   \1/p'
}
if _dry; then
  _run python -m pip install -v --no-build-isolation ".[${JAX_MOE_A2A_EXTRAS:-bench,test}]"
elif ! python -m pip install -v --no-build-isolation ".[${JAX_MOE_A2A_EXTRAS:-bench,test}]" 2>&1 \
     | tee "$build_log" | _build_filter; then
  echo "setup: the build failed; the last lines of ${build_log}:" >&2
  tail -n 40 "$build_log" >&2
  return 1 2>/dev/null || exit 1
fi

if _dry; then
  echo "setup: [dry run] done"
else
  # check from outside the source tree: there jax_moe_a2a/ has no _C and would shadow the install
  (cd "${TMPDIR:-/tmp}" && python -c "import jax_moe_a2a._C as c; print('setup: jax_moe_a2a built; cuda kernels:', c.built_with_cuda(), '; nvshmem backend:', c.built_with_nvshmem(), '; libfabric engine:', c.built_with_libfabric())")
  # the platform jax will run on here: a GPU machine whose jax has no CUDA plugin runs on CPUs
  (cd "${TMPDIR:-/tmp}" && python - "${cuda_major:-}" <<'EOF'
import sys
import jax
d = jax.devices()
print(f"setup: jax {jax.__version__} runs on {d[0].platform.upper()}: {len(d)} {d[0].device_kind} device(s)")
if sys.argv[1] not in ("", "none") and d[0].platform == "cpu":
    print("setup: WARNING: nvidia-smi sees a GPU but jax runs on the CPU (no CUDA plugin?)")
EOF
  )
fi
