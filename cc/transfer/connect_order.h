// Opening an engine's connections in a fixed order (collective).
#pragma once

#include "transfer/engine.h"

namespace a2a::transfer {

// Immediate-value tag reserved for connect_in_order (pack_imm(kConnectTag, rail, rank)).
constexpr uint32_t kConnectTag = kImmMaxTag;

// Makes the first write between every pair of known peers go one way: each rank signals every
// higher rank, then waits for a signal from every lower rank, so a rank never writes first to a
// lower rank. Connection-oriented providers (tcp;ofi_rxm, verbs;ofi_rxm) connect on the first
// write to a peer; with both sides of a pair connecting at the same moment, libfabric 1.17's rxm
// over tcp once left a rank's transmit queue full for 30 s (-FI_EAGAIN on a 38-byte write, 4
// processes on 2 cores). Collective over every known peer; cheap for connectionless providers.
// With several domains (rails) every rail is opened so, rail after rail. Throws TimeoutError naming
// the lower ranks that never signalled.
void connect_in_order(Engine& engine, double timeout_s);

}  // namespace a2a::transfer
