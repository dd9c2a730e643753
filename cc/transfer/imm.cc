#include "transfer/imm.h"

#include <stdexcept>
#include <string>

namespace a2a::transfer {

uint32_t pack_imm(uint32_t tag, uint32_t epoch, uint32_t rank) {
  if (tag > kImmMaxTag || epoch > kImmMaxEpoch || rank > kImmMaxRank)
    throw std::invalid_argument("pack_imm(tag=" + std::to_string(tag) + ", epoch=" +
                                std::to_string(epoch) + ", rank=" + std::to_string(rank) +
                                "): fields are limited to 8, 8 and 16 bits");
  return (tag << (kImmEpochBits + kImmRankBits)) | (epoch << kImmRankBits) | rank;
}

}  // namespace a2a::transfer
