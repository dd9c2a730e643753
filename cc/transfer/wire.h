// Little-endian byte writer/reader for the serialised addresses and memory descriptors.
// The reader checks every length: a truncated or forged blob raises TransferError, never overreads.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "transfer/errors.h"

namespace a2a::transfer {

using Bytes = std::vector<uint8_t>;

class ByteWriter {
 public:
  template <typename T>
  void put(T v) {
    static_assert(std::is_integral_v<T>, "integers only");
    for (size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<uint8_t>(uint64_t(v) >> (8 * i)));
  }
  void put_bytes(const void* p, size_t n) {
    put<uint32_t>(static_cast<uint32_t>(n));
    const auto* b = static_cast<const uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  void put_string(const std::string& s) { put_bytes(s.data(), s.size()); }
  Bytes take() { return std::move(out_); }

 private:
  Bytes out_;
};

class ByteReader {
 public:
  // `what` names the blob in error messages ("memory descriptor", "address").
  ByteReader(const Bytes& in, const char* what) : p_(in.data()), end_(in.data() + in.size()), what_(what) {}

  template <typename T>
  T get() {
    need(sizeof(T));
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= uint64_t(p_[i]) << (8 * i);
    p_ += sizeof(T);
    return static_cast<T>(v);
  }
  Bytes get_bytes(size_t max_len = 4096) {
    uint32_t n = get<uint32_t>();
    if (n > max_len) throw TransferError(format("%s: field of %u bytes is too long", what_, n));
    need(n);
    Bytes b(p_, p_ + n);
    p_ += n;
    return b;
  }
  std::string get_string(size_t max_len = 256) {
    Bytes b = get_bytes(max_len);
    return std::string(b.begin(), b.end());
  }
  void expect_end() const {
    if (p_ != end_) throw TransferError(format("%s: %zu trailing bytes", what_, size_t(end_ - p_)));
  }

 private:
  void need(size_t n) const {
    if (size_t(end_ - p_) < n) throw TransferError(format("%s: truncated (corrupt or not ours)", what_));
  }
  const uint8_t* p_;
  const uint8_t* end_;
  const char* what_;
};

}  // namespace a2a::transfer
