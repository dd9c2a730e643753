// Byte-size rounding shared by every buffer layout (cuda, nvshmem, the route-exchange protocol).
#pragma once

#include <cstdint>

namespace a2a {

// b rounded up to a multiple of 16 (the unit of the kernels' vector copies).
constexpr int64_t pad16(int64_t b) { return (b + 15) / 16 * 16; }

}  // namespace a2a
