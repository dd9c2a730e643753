// A suggested layout of the 32-bit immediate value: tag (8 bits) | epoch (8 bits) | rank (16 bits).
// The engine itself counts arbitrary 32-bit values; only wait_ranks/barrier_ranked use this layout.
#pragma once

#include <cstdint>

namespace a2a::transfer {

constexpr uint32_t kImmTagBits = 8, kImmEpochBits = 8, kImmRankBits = 16;
constexpr uint32_t kImmMaxTag = (1u << kImmTagBits) - 1;
constexpr uint32_t kImmMaxEpoch = (1u << kImmEpochBits) - 1;
constexpr uint32_t kImmMaxRank = (1u << kImmRankBits) - 1;

struct ImmFields {
  uint32_t tag, epoch, rank;
};

// Throws std::invalid_argument when a field does not fit its bits.
uint32_t pack_imm(uint32_t tag, uint32_t epoch, uint32_t rank);

constexpr ImmFields unpack_imm(uint32_t imm) {
  return {imm >> (kImmEpochBits + kImmRankBits), (imm >> kImmRankBits) & kImmMaxEpoch,
          imm & kImmMaxRank};
}

}  // namespace a2a::transfer
