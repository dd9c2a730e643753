#include "transfer/connect_order.h"

#include <vector>

#include "transfer/imm.h"

namespace a2a::transfer {

void connect_in_order(Engine& engine, double timeout_s) {
  const int me = engine.rank();
  std::vector<int> lower, higher;
  for (int r : engine.peers()) {
    if (r < me) lower.push_back(r);
    if (r > me) higher.push_back(r);
  }
  if (!higher.empty()) engine.signal(*engine.peer_group(higher), pack_imm(kConnectTag, 0, me));
  if (!lower.empty()) engine.wait_ranks(kConnectTag, 0, lower, timeout_s);
  engine.flush(timeout_s);
}

}  // namespace a2a::transfer
