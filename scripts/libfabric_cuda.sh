#!/usr/bin/env bash
# Builds libfabric with CUDA support (FI_HMEM_CUDA) into a relocatable folder, for the cuda
# backend's inter-node path with its rows in GPU memory (JAX_MOE_A2A_STAGING, docs/protocol.md)
# on machines whose libfabric has no CUDA (Debian's has none). EFA and verbs installs from the
# vendor (AWS EFA installer, MOFED) usually have it already: check with
#   python -c "from jax_moe_a2a import transfer; print(transfer.FabricEngine(hmem=True).device_memory)"
# and look at proxy_stats()[rank]["row_path"] after init.
#
#   scripts/libfabric_cuda.sh SRC DEST
# SRC: a libfabric source tree (a release tarball unpacked, or a git checkout of a v1.2x tag);
# DEST: the folder to fill (lib/ with libfabric.so.1 and a relocatable pkg-config file, include/,
# bin/fi_info). Needs autotools (autoconf automake libtool), a C compiler, the CUDA toolkit
# (CUDA_HOME, default /usr/local/cuda) and nvml.h (CUDA's include/ or NVML_INCLUDE; the PyPI wheel
# nvidia-nvml-dev-cu12 has one). libfabric dlopens CUDA at run time (--enable-cuda-dlopen) under
# the unversioned names libcudart.so, libcuda.so and libnvidia-ml.so: where only the versioned
# files exist, link them into DEST/lib (which goes on LD_LIBRARY_PATH). Then build this package
# with PKG_CONFIG_PATH=DEST/lib/pkgconfig and run with LD_LIBRARY_PATH=DEST/lib.
set -euo pipefail
src=$(cd "${1:?usage: libfabric_cuda.sh SRC DEST}" && pwd); dest=${2:?usage: libfabric_cuda.sh SRC DEST}
mkdir -p "$dest"; dest=$(cd "$dest" && pwd)
cuda=${CUDA_HOME:-/usr/local/cuda}
nvml=${NVML_INCLUDE:-$cuda/include}
[ -f "$nvml/nvml.h" ] || { echo "libfabric_cuda.sh: no nvml.h in $nvml (set NVML_INCLUDE)" >&2; exit 1; }
build=$(mktemp -d); trap 'rm -rf "$build"' EXIT
cp -a "$src/." "$build/"; cd "$build"
[ -x configure ] || ./autogen.sh
# Only what the package uses: shm, tcp + rxm (the providers of its tests); vendor providers
# (efa, verbs, psm3, cxi, ...) come from the vendor's own libfabric.
./configure --prefix="$build/inst" --with-cuda="$cuda" --enable-cuda-dlopen --disable-static \
  --enable-shm --enable-tcp --enable-rxm --enable-verbs=no --enable-efa=no --enable-psm2=no \
  --enable-psm3=no --enable-usnic=no --enable-opx=no --enable-ucx=no --enable-cxi=no --enable-sockets=no \
  CPPFLAGS="-I$nvml -I$cuda/include" > configure.log
make -j"$(nproc)" > make.log && make install > install.log
rm -rf "$dest"/{lib,include,bin}; mkdir -p "$dest"/lib/pkgconfig "$dest"/bin
cp -a inst/include "$dest/"
cp -L inst/lib/libfabric.so.1 "$dest/lib/"; ln -s libfabric.so.1 "$dest/lib/libfabric.so"
cp inst/bin/fi_info "$dest/bin/"
sed -e 's|^prefix=.*|prefix=${pcfiledir}/../..|' -e 's|^exec_prefix=.*|exec_prefix=${prefix}|' \
  -e 's|^libdir=.*|libdir=${prefix}/lib|' -e 's|^includedir=.*|includedir=${prefix}/include|' \
  inst/lib/pkgconfig/libfabric.pc > "$dest/lib/pkgconfig/libfabric.pc"
echo "libfabric $(grep ^Version inst/lib/pkgconfig/libfabric.pc | cut -d' ' -f2) with CUDA in $dest"
