// A standalone probe of our own fp8 block-scaled grouped GEMM (cc/gemm/fp8_wgmma.cuh): checks it
// against a plain CUDA-core reference on fresh random inputs with the output poisoned, then times it
// next to the HBM floor measured in the same process (a device copy of the weights' bytes / 2), in
// both promotion orders (overlapped with the next k-block's WGMMAs, and serial), and the swap-AB
// kernel (fp8_wgmma_swap.cuh: tokens as the WGMMA's N) at each token-tile height.
// No Python, no JAX: it builds on a CPU machine with nvcc and runs on the GPU machine in seconds,
// which is how the kernel is developed (the library's own tests and benchmarks/gemm.py judge it
// afterwards).
//
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DA2A_GEMM_ABLATIONS -Icc -I<cutlass>/include \
//     benchmarks/gemm_probe.cu cc/gemm/gemm_fp8_wgmma.cu cc/gemm/swiglu.cu -o gemm_probe
//   (A2A_GEMM_ABLATIONS, in both files alike: the swap-AB kernel's ablations and per-tile trace,
//   the `ablate` and `swap` modes; the library is built without them)
//   ./gemm_probe            # every check, then the timings
//   ./gemm_probe check      # the checks only
//   ./gemm_probe time [S]   # the timings only; of the cases whose name contains S (e.g. under ncu)
//   ./gemm_probe ablate [S] # the swap-AB kernel without each part of its work (-DA2A_GEMM_ABLATIONS)
//   ./gemm_probe swap [S]   # the swap-AB kernel at the library's decode tiles, whole and without its math
//   ./gemm_probe pdl [S]    # the library's decode tiles with and without programmatic dependent launch
//   ./gemm_probe fused [S]  # the decode gate+up GEMM with and without the swap-AB kernel's SwiGLU epilogue
//   ./gemm_probe balance [S]  # the library's decode tiles with the tiles spread evenly, and round-robin
//   ./gemm_probe trim [S]     # the library's decode tiles with each tile's WGMMA N trimmed to its tokens, and not
//   ./gemm_probe prefetch [S] # the library's decode tiles with 0, 8, 16 weight k-blocks prefetched before the PDL wait
//   ./gemm_probe pairgap      # decode L = 8: the fused SwiGLU pair's time taken apart (each kernel alone, h copied,
//                             # no PDL) and the fused kernel's per-tile traces after a down GEMM and after itself
//   ./gemm_probe swiglugap    # decode L = 8: the unfused MLP as the library runs it (gate+up, SwiGLU kernel, down) and
//                             # the down GEMM's trace after the SwiGLU kernel
//   A2A_PROBE_SUSTAIN=1 (time_case: the kernel back to back for the whole case, the copy timed once),
//   A2A_PROBE_BATCH (launches per timed sample, default 10: short bursts stay at the boost clock),
//   A2A_PROBE_RANDOM=1 (the timings' inputs random, as the checks'; default: constant bytes, scales 0),
//   A2A_PROBE_SIGMA (the e4m3 inputs' normal sigma, default 1.5) and A2A_PROBE_SIZES ("123,113,...": a case's group
//   sizes when it has that many groups) change the inputs
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include "core/fp8.h"
#include "gemm/fp8_wgmma.h"
#include "gemm/grouped_gemm.h"  // launch_swiglu (cc/gemm/swiglu.cu)
#include "gemm/kernels.h"  // swap_of: the library's token tile

namespace {

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                             \
    }                                                                                           \
  } while (0)

// Reference: y[r, n] = sum_kb (sum_{k in kb} x[r,k] w[l,n,k]) * xs[r,kb] * ws[l,n/128,kb] in f32, and
// the same over absolute values (the error bound's scale). One thread per output, rows r with
// r % row_step == 0 only; group of each row from the row_group table (-1: no group).
__global__ void reference(const uint8_t* x, const float* xs, const uint8_t* w, const float* ws, const int* row_group,
                          int64_t rows, int n, int k, int row_step, float* ref, float* refabs) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nrows = (rows + row_step - 1) / row_step;
  if (idx >= nrows * n) return;
  const int64_t r = (idx / n) * row_step;
  const int c = static_cast<int>(idx % n);
  const int l = row_group[r];
  if (l < 0) return;
  const int kb = k / 128;
  const uint8_t* xr = x + r * k;
  const uint8_t* wr = w + (static_cast<int64_t>(l) * n + c) * k;
  float acc = 0.f, acca = 0.f;
  for (int b = 0; b < kb; ++b) {
    float p = 0.f, pa = 0.f;
    for (int i = 0; i < 128; i += 16) {  // 16 bytes per load (rows are 16-byte aligned: K % 128 == 0)
      const uint4 xv4 = *reinterpret_cast<const uint4*>(xr + b * 128 + i);
      const uint4 wv4 = *reinterpret_cast<const uint4*>(wr + b * 128 + i);
      const uint8_t* xb = reinterpret_cast<const uint8_t*>(&xv4);
      const uint8_t* wb = reinterpret_cast<const uint8_t*>(&wv4);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        __nv_fp8_e4m3 xv, wv;
        xv.__x = xb[j];
        wv.__x = wb[j];
        const float t = static_cast<float>(xv) * static_cast<float>(wv);
        p += t;
        pa += fabsf(t);
      }
    }
    const float sc = xs[r * kb + b] * ws[(static_cast<int64_t>(l) * (n / 128) + c / 128) * kb + b];
    acc += p * sc;
    acca += pa * fabsf(sc);
  }
  ref[idx] = acc;
  refabs[idx] = acca;
}

struct Case {
  std::string name;
  int L;
  int64_t rows;  // R (ragged) or C (expert_major)
  int n, k;
  bool expert_major, y_f32;
  std::vector<int> sizes;  // group_sizes
};

// Random inputs made on the device (the host's generator took minutes for the ~5 G values of the
// checks): element i of a buffer from splitmix64(seed + i), so a buffer is a function of its seed.
__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ float unit(uint64_t bits) {  // uniform in (0, 1]
  return (static_cast<float>(bits >> 40) + 1.f) * (1.f / 16777216.f);
}

// e4m3 codes of normal(0, 1.5) values (Box-Muller), rounded to nearest and saturated as
// __nv_fp8_e4m3 does: finite, never NaN.
__global__ void fill_e4m3(uint8_t* out, size_t n, uint64_t seed, float sigma) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed + i);
    const float u1 = unit(h), u2 = unit(h << 24);
    const float v = sigma * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    out[i] = __nv_fp8_e4m3(v).__x;
  }
}

__global__ void fill_uniform(float* out, size_t n, uint64_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = lo + (hi - lo) * unit(splitmix64(seed + i));
}

uint64_t seed64(std::mt19937& g) { return (static_cast<uint64_t>(g()) << 32) | g(); }

// The e4m3 inputs: normal with this sigma (A2A_PROBE_SIGMA, default 1.5: values mostly within
// +-5). A block-quantised tensor spans the whole e4m3 range (its amax maps to 448): sigma ~100
// gives such bytes, to see whether the kernels' times depend on the values (power, clocks).
float probe_sigma() {
  static const float s = [] {
    const char* e = std::getenv("A2A_PROBE_SIGMA");
    return e != nullptr && *e ? std::strtof(e, nullptr) : 1.5f;
  }();
  return s;
}

void random_e4m3(uint8_t* d, size_t n, std::mt19937& g) {
  if (n) fill_e4m3<<<1024, 256>>>(d, n, seed64(g), probe_sigma());
  CK(cudaGetLastError());
}

void random_uniform(float* d, size_t n, float lo, float hi, std::mt19937& g) {
  if (n) fill_uniform<<<256, 256>>>(d, n, seed64(g), lo, hi);
  CK(cudaGetLastError());
}

// R rows routed uniformly at random over L groups. A2A_PROBE_SIZES="123,113,..." with L entries
// replaces the draw (made all the same, so the other cases keep theirs): a model's or a
// benchmark's own group sizes in the probe.
std::vector<int> uniform_sizes(int L, int64_t R, std::mt19937& g) {
  std::vector<int> s(L, 0);
  std::uniform_int_distribution<int> d(0, L - 1);
  for (int64_t i = 0; i < R; ++i) s[d(g)]++;
  if (const char* e = std::getenv("A2A_PROBE_SIZES"); e != nullptr && *e) {
    std::vector<int> given;
    for (const char* p = e; *p;) {
      char* end = nullptr;
      given.push_back(static_cast<int>(std::strtol(p, &end, 10)));
      p = *end == ',' ? end + 1 : end;
      if (end == p && *p) break;
    }
    if (static_cast<int>(given.size()) == L) return given;
  }
  return s;
}

struct Buffers {
  uint8_t *x = nullptr, *w = nullptr;
  float *xs = nullptr, *ws = nullptr;
  int* gs = nullptr;
  void* y = nullptr;
  int64_t total_rows = 0;
};

// An A2A_PROBE_* switch: on when set to "1" (each caller keeps the answer in a static).
bool env_flag(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr && *e == '1';
}

// A2A_PROBE_BATCH: launches (or runs of a sequence) per timed sample, default 10. A few launches
// run at the boost clock; hundreds back to back (as benchmarks/gemm.py's timing loop, or a model)
// can reach the board's power limit and a lower clock: the same kernel then takes longer.
int probe_batch() {
  static const int n = [] {
    const char* e = std::getenv("A2A_PROBE_BATCH");
    const int v = e != nullptr ? std::atoi(e) : 0;
    return v > 0 ? v : 10;
  }();
  return n;
}

// A2A_PROBE_SUSTAIN=1: time_case times the weights' copy once, not between every batch of kernels,
// so the kernel runs back to back for the whole case (iters x batch launches): the sustained power
// draw of a model's steps, not short bursts between copies that draw less.
bool probe_sustain() {
  static const bool on = env_flag("A2A_PROBE_SUSTAIN");
  return on;
}

// A2A_PROBE_RANDOM=1: the timings' inputs random too (as the checks'), not constant bytes.
bool probe_random() {
  static const bool on = env_flag("A2A_PROBE_RANDOM");
  return on;
}

Buffers make_buffers(const Case& c, std::mt19937& g, bool fill) {
  fill = fill || probe_random();
  Buffers b;
  b.total_rows = c.expert_major ? c.rows * c.L : c.rows;
  const size_t xb = static_cast<size_t>(b.total_rows) * c.k, wb = static_cast<size_t>(c.L) * c.n * c.k;
  const size_t xsn = static_cast<size_t>(b.total_rows) * (c.k / 128), wsn = static_cast<size_t>(c.L) * (c.n / 128) * (c.k / 128);
  CK(cudaMalloc(&b.x, std::max<size_t>(xb, 1)));
  CK(cudaMalloc(&b.w, wb));
  CK(cudaMalloc(&b.xs, std::max<size_t>(xsn, 1) * 4));
  CK(cudaMalloc(&b.ws, wsn * 4));
  CK(cudaMalloc(&b.gs, c.L * 4));
  CK(cudaMalloc(&b.y, std::max<size_t>(static_cast<size_t>(b.total_rows) * c.n * (c.y_f32 ? 4 : 2), 1)));
  if (fill) {
    random_e4m3(b.x, xb, g);
    random_e4m3(b.w, wb, g);
    random_uniform(b.xs, xsn, 0.25f, 2.f, g);
    random_uniform(b.ws, wsn, 0.0005f, 0.002f, g);
    CK(cudaDeviceSynchronize());
  } else {  // timing only: any finite bytes
    CK(cudaMemset(b.x, 0x38, std::max<size_t>(xb, 1)));
    CK(cudaMemset(b.w, 0x38, wb));
    CK(cudaMemset(b.xs, 0, std::max<size_t>(xsn, 1) * 4));
    CK(cudaMemset(b.ws, 0, wsn * 4));
  }
  CK(cudaMemcpy(b.gs, c.sizes.data(), c.L * 4, cudaMemcpyHostToDevice));
  return b;
}

void free_buffers(Buffers& b) {
  cudaFree(b.x); cudaFree(b.w); cudaFree(b.xs); cudaFree(b.ws); cudaFree(b.gs); cudaFree(b.y);
}

a2a::gemm::wgmma::Fp8LaunchParams params_of(const Case& c, const Buffers& b) {
  a2a::gemm::wgmma::Fp8LaunchParams p;
  p.x = b.x; p.x_scale = b.xs; p.w = b.w; p.w_scale = b.ws; p.group_sizes = b.gs; p.y = b.y;
  p.y_f32 = c.y_f32; p.expert_major = c.expert_major; p.rows = b.total_rows;
  p.per_group_rows = c.expert_major ? c.rows : 0; p.num_groups = c.L; p.n = c.n; p.k = c.k;
  return p;
}

// Each row's group as the kernel must see it (cutlass_grouped.cuh's prepare_groups rule).
std::vector<int> row_groups(const Case& c, int64_t total_rows) {
  std::vector<int> g(total_rows, -1);
  int64_t off = 0;
  for (int l = 0; l < c.L; ++l) {
    int64_t s = std::max(c.sizes[l], 0);
    if (c.expert_major) {
      s = std::min<int64_t>(s, c.rows);
      for (int64_t i = 0; i < s; ++i) g[l * c.rows + i] = l;
    } else {
      const int64_t r0 = std::min(off, c.rows), m = std::min(s, c.rows - r0);
      for (int64_t i = 0; i < m; ++i) g[r0 + i] = l;
      off += s;
    }
  }
  return g;
}

// The reference (kernel `reference`) of rows r % row_step == 0, copied to the host: ref and its
// absolute-value sums, [ceil(rows / row_step), c.n] each.
struct HostReference {
  std::vector<float> ref, abs;
};
HostReference run_reference(const Case& c, const Buffers& b, const std::vector<int>& groups, int row_step) {
  const int64_t nrows = (b.total_rows + row_step - 1) / row_step, outs = nrows * c.n;
  int* dgroups = nullptr;
  float *ref = nullptr, *refabs = nullptr;
  CK(cudaMalloc(&dgroups, std::max<size_t>(groups.size(), 1) * 4));
  CK(cudaMemcpy(dgroups, groups.data(), groups.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&ref, std::max<int64_t>(outs, 1) * 4));
  CK(cudaMalloc(&refabs, std::max<int64_t>(outs, 1) * 4));
  CK(cudaMemset(ref, 0, std::max<int64_t>(outs, 1) * 4));
  CK(cudaMemset(refabs, 0, std::max<int64_t>(outs, 1) * 4));
  if (outs > 0)
    reference<<<static_cast<unsigned>((outs + 255) / 256), 256>>>(b.x, b.xs, b.w, b.ws, dgroups, b.total_rows, c.n,
                                                                  c.k, row_step, ref, refabs);
  CK(cudaDeviceSynchronize());
  HostReference out{std::vector<float>(outs), std::vector<float>(outs)};
  CK(cudaMemcpy(out.ref.data(), ref, outs * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(out.abs.data(), refabs, outs * 4, cudaMemcpyDeviceToHost));
  cudaFree(dgroups);
  cudaFree(ref);
  cudaFree(refabs);
  return out;
}

// The swap-AB token tile the library picks for L experts over `rows` rows (gemm/kernels.h swap_of).
int library_tile(int L, int64_t rows = 1024) {
  a2a::gemm::detail::Tuning t;
  a2a::gemm::detail::swap_of(rows, L, t);
  return t.swap_tokens;
}

// The decode cases of the library's MLP (gate+up, down; 1,024 rows over L experts) whose name
// contains `only`, each with the library's token tile: fn(case, token tile).
template <class Fn>
void for_each_decode_gemm(std::initializer_list<int> Ls, const std::string& only, std::mt19937& gen, Fn fn) {
  for (int L : Ls) {
    const int tok = library_tile(L);
    for (const auto& [name, n, k] : {std::tuple<const char*, int, int>{"-gate+up", 4096, 7168}, {"-down", 7168, 2048}}) {
      Case c{"decode-L" + std::to_string(L) + name, L, 1024, n, k, false, false, uniform_sizes(L, 1024, gen)};
      if (c.name.find(only) == std::string::npos) continue;
      fn(c, tok);
    }
  }
}

// Fp8LaunchParams::ablate 0..3 (fp8_wgmma_swap.cuh, Ablate)
const char* const kAblations[] = {"", " no-math", " no-x", " no-promote"};

// A variant's label: the promotion order, and swapN for the swap-AB kernel with N-token tiles.
std::string label(bool serial, int swap, int cluster = 1) {
  if (swap) return "swap" + std::to_string(swap) + (cluster > 1 ? " x2" : "");
  return serial ? "serial" : "overlap";
}

bool check(const Case& c, std::mt19937& gen, int row_step, bool serial, int swap = 0, int cluster = 1) {
  Buffers b = make_buffers(c, gen, true);
  const auto groups = row_groups(c, b.total_rows);
  const size_t ybytes = static_cast<size_t>(b.total_rows) * c.n * (c.y_f32 ? 4 : 2);
  CK(cudaMemset(b.y, 0xFF, std::max<size_t>(ybytes, 1)));  // NaN in bf16 and f32
  auto p = params_of(c, b);
  p.serial_promotion = serial;
  p.swap_tokens = swap;
  p.swap_cluster = cluster;
  if (const char* why = a2a::gemm::wgmma::fp8_unsupported_reason(p)) {
    std::printf("%-22s UNSUPPORTED: %s\n", c.name.c_str(), why);
    free_buffers(b);
    return false;
  }
  CK(a2a::gemm::wgmma::launch_fp8_grouped(p, 0));
  CK(cudaDeviceSynchronize());
  const int64_t nrows = (b.total_rows + row_step - 1) / row_step;
  const HostReference rf = run_reference(c, b, groups, row_step);
  const std::vector<float>& href = rf.ref;
  const std::vector<float>& habs = rf.abs;
  std::vector<uint8_t> hy(ybytes);
  CK(cudaMemcpy(hy.data(), b.y, ybytes, cudaMemcpyDeviceToHost));
  int64_t bad = 0, untouched_wrong = 0, checked = 0;
  double worst = 0.0;
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t r = i * row_step;
    for (int cc = 0; cc < c.n; ++cc) {
      const size_t at = static_cast<size_t>(r) * c.n + cc;
      float v;
      if (c.y_f32) {
        std::memcpy(&v, &hy[at * 4], 4);
      } else {
        __nv_bfloat16 h;
        std::memcpy(&h, &hy[at * 2], 2);
        v = __bfloat162float(h);
      }
      if (groups[r] < 0) {  // rows outside every group: zeros, written by the kernel over the poison
        if (!(v == 0.0f && !std::signbit(v))) ++untouched_wrong;
        continue;
      }
      ++checked;
      const float rv = href[i * c.n + cc], ra = habs[i * c.n + cc];
      const double tol = ra * std::ldexp(1.0, -10) + (c.y_f32 ? 0.0 : std::fabs(rv) * std::ldexp(1.0, -8)) + 1e-30;
      const double err = std::fabs(static_cast<double>(v) - rv);
      if (!(err <= tol)) {
        if (bad < 5)
          std::printf("   mismatch row %lld col %d: got %g want %g (abs-sum %g)\n", static_cast<long long>(r), cc, v, rv, ra);
        ++bad;
      }
      if (ra > 0) worst = std::max(worst, err / ra);
    }
  }
  const bool ok = bad == 0 && untouched_wrong == 0;
  std::printf("%-22s %-11s %s  checked %lld, bad %lld, rows outside groups not zero %lld, max err / abs-sum %.2e\n",
              c.name.c_str(), label(serial, swap, cluster).c_str(), ok ? "PASS" : "FAIL", static_cast<long long>(checked), static_cast<long long>(bad),
              static_cast<long long>(untouched_wrong), worst);
  free_buffers(b);
  return ok;
}

// The fused SwiGLU's outputs (h e4m3 [rows, n / 2], its scales [rows, n / 256]) for a gate+up case;
// at least one byte each, as make_buffers' (a case with no rows).
size_t swiglu_h_bytes(const Case& c, const Buffers& b) {
  return std::max<size_t>(static_cast<size_t>(b.total_rows) * (c.n / 2), 1);
}
size_t swiglu_scale_bytes(const Case& c, const Buffers& b) {
  return std::max<size_t>(static_cast<size_t>(b.total_rows) * (c.n / 256), 1) * 4;
}
void attach_swiglu(const Case& c, const Buffers& b, a2a::gemm::wgmma::Fp8LaunchParams& p, uint8_t*& h, float*& hs) {
  CK(cudaMalloc(&h, swiglu_h_bytes(c, b)));
  CK(cudaMalloc(&hs, swiglu_scale_bytes(c, b)));
  p.swiglu_fp8 = true;
  p.h = h;
  p.h_scale = hs;
}

// The gate+up GEMM with the fused SwiGLU epilogue (swiglu_fp8): c.n = 2F. Against the reference
// gate and up (f32 sums), rounded to bf16, h = silu(g) * u in f32, and the library's quantiser on
// the host (core/fp8.h): each dequantised h within 8 % of the reference (e4m3's half step is 1/16;
// the rest: gate and up rounded to bf16 from sums in another order) plus 2^-6 of its block's
// scale, each scale within 2.5 % (gate and up are each rounded to bf16, 2^-8 relative apiece, and
// may both move v the same way: a block's amax, so its scale, up to ~1.6 % off); rows outside
// every group get h = 0 and the all-zero block's scale over the poison.
bool check_swiglu(const Case& c, std::mt19937& gen, bool serial, int swap = 0) {
  Buffers b = make_buffers(c, gen, true);
  const int f = c.n / 2, nb = f / 128;
  const auto groups = row_groups(c, b.total_rows);
  auto p = params_of(c, b);
  p.serial_promotion = serial;
  p.swap_tokens = swap;
  uint8_t* h = nullptr;
  float* hs = nullptr;
  attach_swiglu(c, b, p, h, hs);
  CK(cudaMemset(h, 0x7F, swiglu_h_bytes(c, b)));  // e4m3 NaN
  CK(cudaMemset(hs, 0xFF, swiglu_scale_bytes(c, b)));
  if (const char* why = a2a::gemm::wgmma::fp8_unsupported_reason(p)) {
    std::printf("%-22s UNSUPPORTED: %s\n", c.name.c_str(), why);
    cudaFree(h);
    cudaFree(hs);
    free_buffers(b);
    return false;
  }
  CK(a2a::gemm::wgmma::launch_fp8_grouped(p, 0));
  CK(cudaDeviceSynchronize());
  const HostReference rf = run_reference(c, b, groups, 1);
  const std::vector<float>& href = rf.ref;
  const std::vector<float>& habs = rf.abs;
  std::vector<float> hsc(static_cast<size_t>(b.total_rows) * nb);
  std::vector<uint8_t> hh(static_cast<size_t>(b.total_rows) * f);
  CK(cudaMemcpy(hh.data(), h, hh.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hsc.data(), hs, hsc.size() * 4, cudaMemcpyDeviceToHost));
  auto bf16 = [](float v) { return __bfloat162float(__float2bfloat16_rn(v)); };
  int64_t bad = 0, bad_scale = 0, checked = 0, untouched_wrong = 0;
  for (int64_t r = 0; r < b.total_rows; ++r) {
    if (groups[r] < 0) {  // rows outside every group: h = 0 and the all-zero block's scale, by the kernel
      for (int i = 0; i < f; ++i) untouched_wrong += hh[r * f + i] != 0;
      const float zero_scale = a2a::fp8_block_scale(0.0f, false);
      for (int blk = 0; blk < nb; ++blk) untouched_wrong += std::memcmp(&hsc[r * nb + blk], &zero_scale, 4) != 0;
      continue;
    }
    for (int blk = 0; blk < nb; ++blk) {
      float v[128], e[128], amax = 0.f;
      for (int i = 0; i < 128; ++i) {
        const int col = blk * 128 + i;
        const float g = bf16(href[r * c.n + col]), u = bf16(href[r * c.n + f + col]);
        const float sg = g / (1.0f + std::exp(-g));
        v[i] = sg * u;
        // what gate's and up's sums in another order may move h by: each within the GEMM check's
        // 2^-10 of its terms' absolute sum plus one bf16 step, through silu (slope below 1.1)
        const float eg = habs[r * c.n + col] * 0x1p-10f + std::fabs(g) * 0x1p-8f;
        const float eu = habs[r * c.n + f + col] * 0x1p-10f + std::fabs(u) * 0x1p-8f;
        e[i] = 1.1f * std::fabs(u) * eg + std::fabs(sg) * eu;
        amax = std::max(amax, a2a::fp8_amax_term(v[i]));
      }
      const float want_s = a2a::fp8_block_scale(amax, false), got_s = hsc[r * nb + blk];
      if (!(std::fabs(got_s - want_s) <= 0.025f * want_s)) {
        if (bad_scale < 3) std::printf("   scale row %lld block %d: got %g want %g\n", static_cast<long long>(r), blk, got_s, want_s);
        ++bad_scale;
      }
      for (int i = 0; i < 128; ++i) {
        ++checked;
        const float got = a2a::e4m3fn_to_f32(hh[r * f + blk * 128 + i]) * got_s;
        if (!(std::fabs(got - v[i]) <= 0.08f * std::fabs(v[i]) + want_s * 0.015625f + e[i])) {
          if (bad < 3) std::printf("   h row %lld col %d: got %g want %g\n", static_cast<long long>(r), blk * 128 + i, got, v[i]);
          ++bad;
        }
      }
    }
  }
  const bool ok = bad == 0 && bad_scale == 0 && untouched_wrong == 0;
  std::printf("%-22s %-7s %s  swiglu: checked %lld, bad h %lld, bad scales %lld, outside groups not zero %lld\n",
              c.name.c_str(), label(serial, swap).c_str(), ok ? "PASS" : "FAIL", static_cast<long long>(checked),
              static_cast<long long>(bad), static_cast<long long>(bad_scale), static_cast<long long>(untouched_wrong));
  cudaFree(h);
  cudaFree(hs);
  free_buffers(b);
  return ok;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void time_case(const Case& c, std::mt19937& gen, int iters, bool serial, bool swiglu = false, int swap = 0, int cluster = 1,
               int ablate = 0, bool pdl = true, bool balance = true, bool trim = true, int prefetch = -1) {
  Buffers b = make_buffers(c, gen, false);
  auto p = params_of(c, b);
  p.pdl = pdl;
  if (prefetch >= 0) p.prefetch_kblocks = prefetch;
  p.balance_tiles = balance;
  p.trim_tokens = trim;
  p.serial_promotion = serial;
  p.swap_tokens = swap;
  p.swap_cluster = cluster;
  p.ablate = ablate;
  if (const char* why = a2a::gemm::wgmma::fp8_unsupported_reason(p)) {
    std::printf("%-22s %s: refused: %s\n", c.name.c_str(), label(serial, swap, cluster).c_str(), why);
    free_buffers(b);
    return;
  }
  uint8_t* h = nullptr;
  float* hs = nullptr;
  if (swiglu) attach_swiglu(c, b, p, h, hs);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<float> tk, tc;
  const size_t wbytes = static_cast<size_t>(c.L) * c.n * c.k;
  void* dst = nullptr;
  CK(cudaMalloc(&dst, wbytes));
  for (int i = 0; i < 3; ++i) CK(a2a::gemm::wgmma::launch_fp8_grouped(p, 0));
  // kBatch launches between two events: one launch's host cost (its two TMA descriptors encoded,
  // the launch itself, ~10 us) hides behind the previous kernel, as in a stream that has work
  // queued (the library's case); a single launch after an idle stream measured that cost too.
  const int kBatch = probe_batch();
  for (int i = 0; i < iters; ++i) {
    float ms;
    CK(cudaEventRecord(e0));
    for (int j = 0; j < kBatch; ++j) CK(a2a::gemm::wgmma::launch_fp8_grouped(p, 0));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms, e0, e1));
    tk.push_back(ms * 1000.f / kBatch);
    if (i > 0 && probe_sustain()) continue;
    CK(cudaEventRecord(e0));
    for (int j = 0; j < kBatch; ++j) CK(cudaMemcpyAsync(dst, b.w, wbytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms, e0, e1));
    tc.push_back(ms * 1000.f / 2.f / kBatch);
  }
  int64_t rows = 0;
  for (int s : c.sizes) rows += std::max(s, 0);
  if (!c.expert_major) rows = std::min<int64_t>(rows, c.rows);
  const double flop = 2.0 * rows * c.n * c.k;
  const float k50 = median(tk), c50 = median(tc);
  const std::string pf = prefetch >= 0 ? " prefetch " + std::to_string(prefetch) : "";
  std::printf("%-22s %-11s%s%s%s%s%s%s kernel p50 %9.1f us (min %9.1f)  weights' HBM time %8.1f us  x HBM %.2f  %7.0f TFLOP/s\n",
              c.name.c_str(), label(serial, swap, cluster).c_str(), swiglu ? "+swiglu" : "", kAblations[ablate], pdl ? "" : " no-pdl", balance ? "" : " unbalanced", trim ? "" : " untrimmed", pf.c_str(), k50, *std::min_element(tk.begin(), tk.end()), c50, k50 / c50, flop / (k50 * 1e-6) / 1e12);
  cudaFree(dst);
  cudaFree(h);
  cudaFree(hs);
  free_buffers(b);
}

// A per-tile trace (Fp8Args::trace: [CTA][tile][start, end] global-timer ns, zero where none) as
// printed by the trace modes: the span, the first tiles' starts, the CTAs' ends, and each round's
// (a CTA's i-th tile's) durations.
void report_trace(const std::string& tag, const std::vector<unsigned long long>& h, int sms, int per) {
  const size_t n = h.size();
  const int kPer = per;
  unsigned long long t0 = ~0ull, t1 = 0;
  for (size_t i = 0; i < n; i += 2)
    if (h[i]) t0 = std::min(t0, h[i]), t1 = std::max(t1, h[i + 1]);
  std::vector<float> ends, firsts;
  std::vector<std::vector<float>> dur(kPer), starts(kPer);
  for (int cta = 0; cta < sms; ++cta) {
    float last = -1.f;
    for (int i = 0; i < kPer; ++i) {
      const unsigned long long s0 = h[(static_cast<size_t>(cta) * kPer + i) * 2], s1 = h[(static_cast<size_t>(cta) * kPer + i) * 2 + 1];
      if (!s0) break;
      dur[i].push_back((s1 - s0) * 1e-3f);
      starts[i].push_back((s0 - t0) * 1e-3f);
      if (i == 0) firsts.push_back((s0 - t0) * 1e-3f);
      last = (s1 - t0) * 1e-3f;
    }
    if (last >= 0.f) ends.push_back(last);
  }
  std::sort(ends.begin(), ends.end());
  std::sort(firsts.begin(), firsts.end());
  auto q = [](const std::vector<float>& v, double f) { return v.empty() ? 0.f : v[static_cast<size_t>(f * (v.size() - 1))]; };
  std::printf("%s trace: span %.1f us; first tile starts p50 %.1f max %.1f; CTA ends min %.1f p10 %.1f p50 %.1f p90 %.1f max %.1f (%zu CTAs)\n",
              tag.c_str(), (t1 - t0) * 1e-3, q(firsts, .5), q(firsts, 1), q(ends, 0), q(ends, .1), q(ends, .5), q(ends, .9), q(ends, 1),
              ends.size());
  for (int i = 0; i < kPer && !dur[i].empty(); ++i) {
    std::sort(dur[i].begin(), dur[i].end());
    std::sort(starts[i].begin(), starts[i].end());
    std::printf("    round %d: %3zu tiles, start min %.1f p50 %.1f max %.1f, duration min %.1f p50 %.1f max %.1f us\n", i, dur[i].size(),
                q(starts[i], 0), q(starts[i], .5), q(starts[i], 1), q(dur[i], 0), q(dur[i], .5), q(dur[i], 1));
  }
}

// Variants of a launch sequence timed alternately: 3 warm-up runs each, then `iters` rounds in
// which each variant runs probe_batch() times between two events; prints each one's p50 and min per run, in us.
using Variants = std::vector<std::pair<std::string, std::function<void()>>>;
void time_alternated(const std::string& prefix, const Variants& vs, int iters) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<std::vector<float>> t(vs.size());
  for (const auto& v : vs)
    for (int i = 0; i < 3; ++i) v.second();
  for (int i = 0; i < iters; ++i)
    for (size_t j = 0; j < vs.size(); ++j) {
      float ms;
      CK(cudaEventRecord(e0));
      const int batch = probe_batch();
      for (int b = 0; b < batch; ++b) vs[j].second();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t[j].push_back(ms * 1000.f / batch);  // one run, in us
    }
  for (size_t j = 0; j < vs.size(); ++j)
    std::printf("%s %-30s p50 %7.1f us (min %7.1f)\n", prefix.c_str(), vs[j].first.c_str(), median(t[j]),
                *std::min_element(t[j].begin(), t[j].end()));
  CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
}

// The per-tile trace (Fp8Args::trace, the first `per` tiles of each CTA) of kernel p launched after
// `before`, the pair run twice untraced first; printed by report_trace under `label`. Needs
// -DA2A_GEMM_ABLATIONS.
void trace_after(const std::string& label, const std::function<void()>& before, a2a::gemm::wgmma::Fp8LaunchParams p,
                 int per = 4) {
#ifdef A2A_GEMM_ABLATIONS
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t n = static_cast<size_t>(sms) * per * 2;
  unsigned long long* tr = nullptr;
  CK(cudaMalloc(&tr, n * 8));
  CK(cudaMemset(tr, 0, n * 8));
  for (int i = 0; i < 3; ++i) {
    before();
    if (i == 2) p.trace = tr, p.trace_per_cta = per;
    CK(a2a::gemm::wgmma::launch_fp8_grouped(p, 0));
  }
  CK(cudaDeviceSynchronize());
  std::vector<unsigned long long> h(n);
  CK(cudaMemcpy(h.data(), tr, n * 8, cudaMemcpyDeviceToHost));
  report_trace(label, h, sms, per);
  cudaFree(tr);
#else
  (void)before, (void)p, (void)per;
  std::printf("%s trace: compile with -DA2A_GEMM_ABLATIONS\n", label.c_str());
#endif
}

// One launch with the per-tile trace (Fp8Args::trace): when each CTA's tiles started and ended, in
// us from the first start: the kernel's span, the spread of the CTAs' last ends (the tail), and
// the tile durations by their round (the i-th tile of a CTA).
void trace_case(const Case& c, std::mt19937& gen, int swap, int ablate, bool swiglu = false, bool balance = true, bool trim = true) {
#ifndef A2A_GEMM_ABLATIONS
  std::printf("%-22s trace: compile with -DA2A_GEMM_ABLATIONS\n", c.name.c_str());
  (void)gen, (void)swap, (void)ablate, (void)swiglu, (void)balance, (void)trim;
#else
  Buffers b = make_buffers(c, gen, false);
  auto p = params_of(c, b);
  p.serial_promotion = true;
  p.swap_tokens = swap;
  p.ablate = ablate;
  p.balance_tiles = balance;
  p.trim_tokens = trim;
  uint8_t* hq = nullptr;
  float* hs = nullptr;
  if (swiglu) attach_swiglu(c, b, p, hq, hs);
  char tag[128];
  std::snprintf(tag, sizeof tag, "%-22s swap%d%s%s%s%s", c.name.c_str(), swap, swiglu ? "+swiglu" : "", kAblations[ablate],
                balance ? "" : " unbalanced", trim ? "" : " untrimmed");
  trace_after(tag, [&] { CK(a2a::gemm::wgmma::launch_fp8_grouped(p, 0)); }, p, 64);
  cudaFree(hq);
  cudaFree(hs);
  free_buffers(b);
#endif
}

// The fp8 MLP's two swap-AB kernels at decode: gate+up case g (n = 2F, k = H) and down case d (n = H,
// k = F) over the same groups; the pair runs the gate+up GEMM with its SwiGLU epilogue into h, then
// the down GEMM over h into y.
struct PairRun {
  Case g, d;
  Buffers bg, bd;
  uint8_t* h = nullptr;
  float* hs = nullptr;
};

PairRun make_pair(const std::string& name, int L, int64_t rows, int hidden, int ffn, const std::vector<int>& sizes, std::mt19937& gen) {
  PairRun r{{name, L, rows, 2 * ffn, hidden, false, false, sizes}, {name, L, rows, hidden, ffn, false, false, sizes}};
  r.bg = make_buffers(r.g, gen, false);
  r.bd = make_buffers(r.d, gen, false);
  CK(cudaMalloc(&r.h, static_cast<size_t>(rows) * ffn));
  CK(cudaMalloc(&r.hs, static_cast<size_t>(rows) * (ffn / 128) * 4));
  return r;
}

void free_pair(PairRun& r) {
  free_buffers(r.bg);
  free_buffers(r.bd);
  cudaFree(r.h);
  cudaFree(r.hs);
}

// Where the fused pair's time goes at decode L = 8 (in the jitted MLP it cost ~25 us above its
// kernels alone): the pair, the pair with down reading a copy of h, each kernel alone and after
// itself, the plain gate+up then down, and the pair with either kernel launched without PDL,
// alternated; then the per-tile traces of the fused kernel and of the down GEMM after each of
// the others (with and without PDL).
void pair_gap(std::mt19937& gen, int iters) {
  const int L = 8, tok = library_tile(L);
  PairRun r = make_pair("decode-L8", L, 1024, 7168, 2048, uniform_sizes(L, 1024, gen), gen);
  const size_t hb = static_cast<size_t>(r.bd.total_rows) * 2048, hsb = static_cast<size_t>(r.bd.total_rows) * 16 * 4;
  uint8_t* h_sep = nullptr;
  float* hs_sep = nullptr;
  CK(cudaMalloc(&h_sep, hb));
  CK(cudaMalloc(&hs_sep, hsb));
  using P = a2a::gemm::wgmma::Fp8LaunchParams;
  P pf = params_of(r.g, r.bg), pg = params_of(r.g, r.bg), pd = params_of(r.d, r.bd);
  pf.swap_tokens = pg.swap_tokens = pd.swap_tokens = tok;
  pf.swiglu_fp8 = true;
  pf.h = r.h;
  pf.h_scale = r.hs;
  pd.x = r.h;
  pd.x_scale = r.hs;
  P pd_sep = pd, pf_nopdl = pf, pd_nopdl = pd;
  pd_sep.x = h_sep;
  pd_sep.x_scale = hs_sep;
  pf_nopdl.pdl = pd_nopdl.pdl = false;
  CK(a2a::gemm::wgmma::launch_fp8_grouped(pf, 0));
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(h_sep, r.h, hb, cudaMemcpyDeviceToDevice));
  CK(cudaMemcpy(hs_sep, r.hs, hsb, cudaMemcpyDeviceToDevice));
  auto two = [](const P& a, const P& b) {
    return [a, b] {
      CK(a2a::gemm::wgmma::launch_fp8_grouped(a, 0));
      CK(a2a::gemm::wgmma::launch_fp8_grouped(b, 0));
    };
  };
  auto one = [](const P& a) { return [a] { CK(a2a::gemm::wgmma::launch_fp8_grouped(a, 0)); }; };
  Variants vs = {
      {"fused -> down", two(pf, pd)},
      {"fused -> down on a copy of h", two(pf, pd_sep)},
      {"fused alone", one(pf)},
      {"down alone", one(pd)},
      {"fused -> fused", two(pf, pf)},
      {"down -> down", two(pd, pd)},
      {"gate+up -> down", two(pg, pd)},
      {"fused -> down, no PDL", two(pf_nopdl, pd_nopdl)},
      {"fused -> down without PDL", two(pf, pd_nopdl)},
      {"fused without PDL -> down", two(pf_nopdl, pd)},
  };
  time_alternated("decode-L8", vs, iters);
  // the traced kernel (second) after the first, both launched as given
  const std::tuple<const char*, P, P> traced[] = {
      {"fused after down", pd, pf},         {"fused without PDL after down", pd, pf_nopdl}, {"fused after fused", pf, pf},
      {"down after fused", pf, pd},         {"down without PDL after fused", pf, pd_nopdl}, {"down after gate+up", pg, pd},
      {"down after down", pd, pd},
  };
  for (const auto& [name, first, second] : traced)
    trace_after(std::string("decode-L8 ") + name, one(first), second);
  cudaFree(h_sep);
  cudaFree(hs_sep);
  free_pair(r);
}

// The library's unfused fp8 MLP at decode L = 8 as it runs (gate+up GEMM with bf16 gu, the SwiGLU
// kernel, the down GEMM), next to gate+up -> down and the SwiGLU kernel alone, alternated; then the
// down GEMM's per-tile trace after the SwiGLU kernel.
void swiglu_gap(std::mt19937& gen, int iters) {
  const int L = 8, tok = library_tile(L);
  PairRun r = make_pair("decode-L8", L, 1024, 7168, 2048, uniform_sizes(L, 1024, gen), gen);
  using P = a2a::gemm::wgmma::Fp8LaunchParams;
  P pg = params_of(r.g, r.bg), pd = params_of(r.d, r.bd);
  pg.swap_tokens = pd.swap_tokens = tok;
  pd.x = r.h;
  pd.x_scale = r.hs;
  a2a::gemm::SwigluParams sp;
  sp.gu = r.bg.y;
  sp.gu_bf16 = true;
  sp.rows = r.bg.total_rows;
  sp.f = 2048;
  sp.h = r.h;
  sp.h_scale = r.hs;
  auto gemm = [](const P& a) { CK(a2a::gemm::wgmma::launch_fp8_grouped(a, 0)); };
  auto swiglu = [&] { CK(a2a::gemm::launch_swiglu(sp, 0)); };
  Variants vs = {
      {"gate+up -> swiglu -> down", [&] { gemm(pg); swiglu(); gemm(pd); }},
      {"gate+up -> down", [&] { gemm(pg); gemm(pd); }},
      {"swiglu alone", swiglu},
  };
  time_alternated("decode-L8", vs, iters);
  trace_after("decode-L8 down after swiglu", [&] { gemm(pg); swiglu(); }, pd);
  free_pair(r);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "all";
  const std::string only = argc > 2 ? argv[2] : "";  // time: the cases whose name contains it
  std::mt19937 gen(12345);
  int dev = 0;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  bool ok = true;
  if (what == "all" || what == "check") {
    std::vector<Case> cs = {
        {"ragged-small-bf16", 4, 300, 256, 512, false, false, {100, 0, 150, 37}},
        {"ragged-past-R-f32", 3, 200, 128, 384, false, true, {150, 120, 50}},
        {"ragged-one-row", 2, 5, 128, 128, false, false, {0, 1}},
        {"ragged-all-empty", 3, 64, 256, 256, false, true, {0, 0, 0}},
        {"expert-major-f32", 4, 96, 384, 256, true, true, {96, 0, 33, 200}},
        {"expert-major-bf16", 3, 200, 256, 640, true, false, {130, 64, 65}},
        {"one-hot-L8", 8, 1024, 4096, 7168, false, false, {0, 0, 0, 0, 0, 1024, 0, 0}},
    };
    {  // more than one 32-lane chunk of the group table (its carry), zeros and negative sizes
      std::vector<int> s100(100), s40(40);
      std::uniform_int_distribution<int> d(-3, 30);
      for (auto& v : s100) v = d(gen);
      for (auto& v : s40) v = d(gen) * 2;
      s100[0] = 0, s100[31] = -5, s100[32] = 140, s100[63] = 0, s100[99] = 7;
      cs.push_back({"ragged-L100-negatives", 100, 1200, 256, 256, false, false, s100});
      cs.push_back({"expert-major-L40", 40, 50, 256, 384, true, true, s40});
    }
    cs.push_back({"decode-L8-gateup-bf16", 8, 1024, 4096, 7168, false, false, uniform_sizes(8, 1024, gen)});
    cs.push_back({"decode-L8-down-f32", 8, 1024, 7168, 2048, false, true, uniform_sizes(8, 1024, gen)});
    cs.push_back({"decode-L32-gateup", 32, 1024, 4096, 7168, false, false, uniform_sizes(32, 1024, gen)});
    for (bool serial : {false, true}) {
      for (const auto& c : cs) ok = check(c, gen, 1, serial) && ok;
    }
    // the swap-AB kernel (tokens as N): every token-tile height, alone and in CTA pairs (N / 128
    // even: the pairs' cases; odd N / 128 is refused, checked in the library's tests)
    for (int swap : {32, 64, 128, 160})
      for (int cluster : {1, 2})
        for (const auto& c : cs) {
          if (cluster == 2 && (c.n / 128) % 2) continue;
          ok = check(c, gen, 1, true, swap, cluster) && ok;
        }
    Case pre{"prefill-L32-sampled", 32, 32768, 4096, 7168, false, false, uniform_sizes(32, 32768, gen)};
    ok = check(pre, gen, 61, false) && ok;
    // the fused SwiGLU epilogue: gate+up w [L, 2F, K]
    std::vector<Case> sw = {
        {"swiglu-small", 3, 300, 512, 384, false, false, {100, 0, 190}},
        {"swiglu-expert-major", 3, 96, 256, 256, true, false, {96, 1, 65}},
        {"swiglu-decode-L8", 8, 1024, 4096, 7168, false, false, uniform_sizes(8, 1024, gen)},
    };
    for (bool serial : {false, true})
      for (const auto& c : sw) ok = check_swiglu(c, gen, serial) && ok;
    for (int swap : {32, 64, 128, 160})  // the swap-AB kernel's SwiGLU epilogue
      for (const auto& c : sw) ok = check_swiglu(c, gen, true, swap) && ok;
    auto sizes_of = [&](const std::string& name) {  // a GEMM case's group sizes, for a SwiGLU case
      for (const auto& c : cs)
        if (c.name == name) return c.sizes;
      std::printf("no case %s\n", name.c_str());
      std::exit(1);
    };
    ok = check_swiglu({"swiglu-L100-negatives", 100, 1200, 256, 256, false, false, sizes_of("ragged-L100-negatives")}, gen, true, 32) && ok;
    ok = check_swiglu({"swiglu-expert-major-L40", 40, 50, 512, 384, true, false, sizes_of("expert-major-L40")}, gen, true, 64) && ok;
    ok = check_swiglu({"swiglu-one-hot-L8", 8, 1024, 4096, 7168, false, false, sizes_of("one-hot-L8")}, gen, true, 160) && ok;
  }
  if (what == "prefill") {
    // Issue 31, prefill: the row-major kernel's 128 x 128 tile (both math warpgroups read the whole
    // weight tile from shared memory: ~160 B a cycle at the tensor peak against the SM's 128, so at
    // most ~80 % of it) against the swap-AB kernel's 128 weight rows x kTok tokens (at kTok 160 ~147 B
    // a cycle), alone and in CTA pairs (x multicast); its sampled check at this shape first.
    Case pre{"prefill-L32-sampled", 32, 32768, 4096, 7168, false, false, uniform_sizes(32, 32768, gen)};
    ok = check(pre, gen, 61, true, 160, 1) && ok;
    const Case gu{"prefill-L32-gate+up", 32, 32768, 4096, 7168, false, false, uniform_sizes(32, 32768, gen)};
    const Case dn{"prefill-L32-down", 32, 32768, 7168, 2048, false, false, uniform_sizes(32, 32768, gen)};
    for (const Case& c : {gu, dn}) {  // every variant once, then the row-major and swap160 again
      if (c.name.find(only) == std::string::npos) continue;
      time_case(c, gen, 10, false);
      for (int swap : {128, 160})
        for (int cluster : {1, 2}) time_case(c, gen, 10, true, false, swap, cluster);
      if (c.name.find("gate+up") != std::string::npos) time_case(c, gen, 10, true, true, 160);  // + its SwiGLU
      time_case(c, gen, 10, false);
      time_case(c, gen, 10, true, false, 160, 1);
    }
  }
  if (what == "pairgap") pair_gap(gen, 20);
  if (what == "swiglugap") swiglu_gap(gen, 20);
  if (what == "fused") {
    // The gate+up GEMM at the library's decode tiles: plain (bf16 gu), and with the SwiGLU epilogue
    // (h e4m3 + scales; the unfused path adds the SwiGLU kernel's read of gu), alternated twice.
    for (int L : {8, 32, 256}) {
      const int tok = library_tile(L);
      Case c{"decode-L" + std::to_string(L) + "-gate+up", L, 1024, 4096, 7168, false, false, uniform_sizes(L, 1024, gen)};
      if (c.name.find(only) == std::string::npos) continue;
      for (int round = 0; round < 2; ++round)
        for (bool swiglu : {false, true}) time_case(c, gen, 30, true, swiglu, tok);
      if (L == 8)  // the token tile below the library's, and each tile's time (trace)
        for (bool swiglu : {false, true}) {
          time_case(c, gen, 30, true, swiglu, 128);
          trace_case(c, gen, tok, 0, swiglu);
        }
    }
  }
  if (what == "swap") {  // the swap-AB kernel at the library's token tile, decode shapes, and without its math
    for_each_decode_gemm({8, 32}, only, gen, [&](const Case& c, int tok) {
      time_case(c, gen, 30, true, false, tok, 1, 0);
      time_case(c, gen, 30, true, false, tok, 1, 1);
    });
    Case c2{"decode-L8-down-f32", 8, 1024, 7168, 2048, false, true, uniform_sizes(8, 1024, gen)};
    Case c3{"expert-major-f32", 4, 96, 384, 256, true, true, {96, 0, 33, 200}};
    for (const Case& c : {c2, c3}) ok = check(c, gen, 1, true, 160) && ok;
  }
  if (what == "balance") {
    // The library's decode tiles with the tiles spread evenly over the fewest CTAs that need no
    // more rounds (Fp8LaunchParams::balance_tiles) and round-robin over every CTA, alternated twice;
    // then each one's per-tile trace.
    for_each_decode_gemm({8, 32}, only, gen, [&](const Case& c, int tok) {
      for (int round = 0; round < 2; ++round)
        for (bool balance : {true, false}) time_case(c, gen, 30, true, false, tok, 1, 0, true, balance);
      if (c.L == 8)
        for (bool balance : {true, false}) trace_case(c, gen, tok, 0, false, balance);
    });
  }
  if (what == "trim") {
    // The library's decode tiles with each tile's WGMMAs over its tokens rounded up to 8
    // (Fp8LaunchParams::trim_tokens) and over the whole token tile, alternated twice; at L = 8 also
    // the gate+up GEMM with its SwiGLU epilogue and the per-tile traces.
    for_each_decode_gemm({8, 32, 256}, only, gen, [&](const Case& c, int tok) {
      for (int round = 0; round < 2; ++round)
        for (bool trim : {true, false}) time_case(c, gen, 30, true, false, tok, 1, 0, true, true, trim);
      if (c.L != 8) return;
      const bool gate_up = c.name.find("gate+up") != std::string::npos;
      if (gate_up)
        for (int round = 0; round < 2; ++round)
          for (bool trim : {true, false}) time_case(c, gen, 30, true, true, tok, 1, 0, true, true, trim);
      for (bool trim : {true, false}) trace_case(c, gen, tok, 0, false, true, trim);
    });
  }
  if (what == "prefetch") {
    // The library's decode tiles, launched back to back with programmatic dependent launch, each
    // CTA prefetching 0, 8 or 16 k-blocks of its first weight tile into L2 before it waits for the
    // previous kernel (Fp8LaunchParams::prefetch_kblocks), alternated twice; the fused gate+up too.
    for_each_decode_gemm({8, 32}, only, gen, [&](const Case& c, int tok) {
      for (int round = 0; round < 2; ++round)
        for (int pf : {0, 8, 16}) time_case(c, gen, 30, true, false, tok, 1, 0, true, true, true, pf);
      if (c.L == 8 && c.name.find("gate+up") != std::string::npos)
        for (int round = 0; round < 2; ++round)
          for (int pf : {0, 8}) time_case(c, gen, 30, true, true, tok, 1, 0, true, true, true, pf);
    });
  }
  if (what == "pdl") {
    // The library's decode tiles launched with and without programmatic dependent launch (10
    // launches back to back per sample, as in time_case: the next launch's prologue overlaps the
    // previous kernel's tail), alternated twice.
    for_each_decode_gemm({8, 32}, only, gen, [&](const Case& c, int tok) {
      for (int round = 0; round < 2; ++round)
        for (bool pdl : {true, false}) time_case(c, gen, 30, true, false, tok, 1, 0, pdl);
    });
  }
  if (what == "ablate") {
    // The swap-AB kernel at the library's token tile for each decode shape (gemm/kernels.h
    // swap_of), whole and without each part of its work (fp8_wgmma_swap.cuh, Ablate): which part
    // bounds it. Needs -DA2A_GEMM_ABLATIONS.
    for_each_decode_gemm({8, 32, 256}, only, gen, [&](const Case& c, int tok) {
      for (int ab = 0; ab < 4; ++ab) time_case(c, gen, 30, true, false, tok, 1, ab);
      if (c.L <= 32) trace_case(c, gen, tok, 0);
    });
  }
  if (what == "all" || what == "time") {
    std::vector<std::pair<Case, int>> ts;
    for (int L : {8, 32, 256}) {
      ts.push_back({{"decode-L" + std::to_string(L) + "-gate+up", L, 1024, 4096, 7168, false, false, uniform_sizes(L, 1024, gen)}, 30});
      ts.push_back({{"decode-L" + std::to_string(L) + "-down", L, 1024, 7168, 2048, false, false, uniform_sizes(L, 1024, gen)}, 30});
    }
    ts.push_back({{"prefill-L32-gate+up", 32, 32768, 4096, 7168, false, false, uniform_sizes(32, 32768, gen)}, 10});
    ts.push_back({{"prefill-L32-down", 32, 32768, 7168, 2048, false, false, uniform_sizes(32, 32768, gen)}, 10});
    for (const auto& [c, iters] : ts) {
      if (c.name.find(only) == std::string::npos) continue;
      time_case(c, gen, iters, false);
      time_case(c, gen, iters, true);
      if (c.name.find("prefill") == std::string::npos)  // the swap-AB kernel: decode
        for (int swap : {32, 64, 128, 160})
          for (int cluster : {1, 2}) time_case(c, gen, iters, true, false, swap, cluster);
      if (c.name.find("gate+up") != std::string::npos) time_case(c, gen, iters, false, true);  // fused SwiGLU
    }
  }
  std::printf("%s\n", ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}
