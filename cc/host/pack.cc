#include "host/pack.h"

#include <cstring>

#include "core/cpu_clones.h"
#include "core/quantize.h"
#include "host/host_comm.h"

namespace a2a::host {

RowPacker::RowPacker(const HostOptions& o, const void* x, ElemKind x_kind, const float* x_scale,
                     std::vector<uint8_t>& cache, std::vector<uint8_t>& filled)
    : o_(o), x_(x), x_kind_(x_kind), x_scale_(x_scale), cache_(cache), filled_(filled) {
  payload_ = o.shape.payload_bytes();
  scales_ = int64_t(o.shape.S) * 4;
  cache_.resize(int64_t(o.shape.T) * (payload_ + scales_));
  filled_.assign(o.shape.T, 0);
  scale_tmp_.resize(o.shape.S);
}

void RowPacker::pack(int t, float w, uint8_t* dst) {
  const MoeShape& s = o_.shape;
  const int64_t H = s.H;
  uint8_t* c = cache_.data() + int64_t(t) * (payload_ + scales_);
  if (!filled_[t]) {
    if (o_.wire == ElemKind::kF8E4M3) {
      if (x_kind_ == ElemKind::kF8E4M3) {  // pre-quantised input: copy bits and scales
        std::memcpy(c, static_cast<const uint8_t*>(x_) + t * H, H);
        std::memcpy(c + payload_, x_scale_ + int64_t(t) * s.S, scales_);
      } else {
        QuantizeParams p;  // one row: token t
        p.x = static_cast<const uint8_t*>(x_) + t * H * elem_bytes(x_kind_);
        p.kind = x_kind_;
        p.rows = 1;
        p.hidden = H;
        p.scale_block = s.scale_block;
        p.pow2_scale = o_.pow2_scale;
        p.q = c;
        p.scale = scale_tmp_.data();
        quantize_fp8(p);
        std::memcpy(c + payload_, scale_tmp_.data(), scales_);
      }
    } else if (x_kind_ == o_.wire) {
      std::memcpy(c, static_cast<const uint8_t*>(x_) + t * payload_, payload_);
    } else {
      for (int64_t h = 0; h < H; ++h) store_elem(c, h, o_.wire, load_elem(x_, t * H + h, x_kind_));
    }
    filled_[t] = 1;
  }
  std::memcpy(dst, c, payload_ + scales_);
  const int32_t tok = t;
  std::memcpy(dst + payload_ + scales_, &tok, 4);
  std::memcpy(dst + payload_ + scales_ + 4, &w, 4);
}

RowUnpacker::RowUnpacker(const HostOptions& o, void* x, float* scale)
    : payload_(o.shape.payload_bytes()), scales_(int64_t(o.shape.S) * 4),
      x_(static_cast<uint8_t*>(x)), scale_(scale) {}

float RowUnpacker::unpack(const uint8_t* row, int64_t pos, int32_t* tok) {
  std::memcpy(x_ + pos * payload_, row, payload_);
  if (scales_) std::memcpy(reinterpret_cast<uint8_t*>(scale_) + pos * scales_, row + payload_, scales_);
  float w;
  std::memcpy(tok, row + payload_ + scales_, 4);
  std::memcpy(&w, row + payload_ + scales_ + 4, 4);
  return w;
}

namespace {

// The element loops of the combine's reduction, one per kind so that each vectorises
// (A2A_CPU_CLONES: AVX2 where the machine has it; the same bits either way).
A2A_CPU_CLONES void accumulate_f32(float* __restrict acc, const float* __restrict r, int H, float w) {
  for (int h = 0; h < H; ++h) acc[h] += w * r[h];
}
A2A_CPU_CLONES void accumulate_bf16(float* __restrict acc, const uint16_t* __restrict r, int H, float w) {
  for (int h = 0; h < H; ++h) acc[h] += w * bits_f32(uint32_t(r[h]) << 16);
}
A2A_CPU_CLONES void accumulate_any(float* __restrict acc, const uint8_t* __restrict row, ElemKind kind, int H,
                                   float w) {
  for (int h = 0; h < H; ++h) acc[h] += w * load_elem(row, h, kind);
}
A2A_CPU_CLONES void store_bf16(uint16_t* __restrict out, const float* __restrict acc, int H) {
  for (int h = 0; h < H; ++h) out[h] = f32_to_bf16(acc[h]);
}
A2A_CPU_CLONES void store_any(void* out, int64_t off, ElemKind kind, const float* __restrict acc, int H) {
  for (int h = 0; h < H; ++h) store_elem(out, off + h, kind, acc[h]);
}

}  // namespace

void accumulate_row(float* acc, const uint8_t* row, ElemKind kind, int H, float w) {
  switch (kind) {
    case ElemKind::kF32: return accumulate_f32(acc, reinterpret_cast<const float*>(row), H, w);
    case ElemKind::kBF16: return accumulate_bf16(acc, reinterpret_cast<const uint16_t*>(row), H, w);
    default: return accumulate_any(acc, row, kind, H, w);
  }
}

A2A_CPU_CLONES void add_row(float* acc, const void* in, int64_t off, ElemKind kind, int H) {
  for (int h = 0; h < H; ++h) acc[h] += load_elem(in, off + h, kind);
}

void store_row(void* out, int64_t off, ElemKind kind, const float* acc, int H) {
  if (kind == ElemKind::kBF16) return store_bf16(static_cast<uint16_t*>(out) + off, acc, H);
  store_any(out, off, kind, acc, H);
}

}  // namespace a2a::host
