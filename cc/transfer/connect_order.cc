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
  // Rail by rail (write_on's pairings: each is a connection of its own under ofi_rxm), epoch = rail.
  for (int rail = 0; rail < engine.num_domains(); ++rail) {
    if (!higher.empty()) engine.signal_on(rail, *engine.peer_group(higher), pack_imm(kConnectTag, rail, me));
    if (!lower.empty()) engine.wait_ranks(kConnectTag, rail, lower, timeout_s);
  }
  engine.flush(timeout_s);
}

}  // namespace a2a::transfer
