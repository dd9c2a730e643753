// Peer groups: a fixed list of peer ranks, built once, with a prepared write request per peer.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_rma.h>

#include <cstdint>
#include <vector>

#include "transfer/memory.h"

namespace a2a::transfer {

class Domain;

// A write request to one peer with everything but the buffers pre-filled: the endpoint's domain,
// the peer's fi_addr, the completion context, and the peer's signal region (zero-byte target).
struct WriteTemplate {
  int rank = -1;
  bool self = false;       // writes to ourselves are memcpy + counter, no provider round trip
  Domain* domain = nullptr;  // our domain for this peer (rank % num_domains)
  int local_domain = 0;
  int remote_domain = 0;  // the peer's domain we target (our rank % its num_domains)
  fi_addr_t addr = FI_ADDR_UNSPEC;
  void* context = nullptr;  // reported with completion errors (names the peer)
  RemoteKey signal;
  fi_msg_rma msg{};  // addr, context, counts and flags-independent fields pre-filled
};

// The buffers of one write, filled from a template; pointers refer into this struct.
struct WriteRequest {
  fi_msg_rma msg;
  iovec iov;
  fi_rma_iov rma;
  void* desc;
  // src == nullptr: a zero-byte write from/to the signal regions (delivers only the immediate).
  void fill(const WriteTemplate& t, const Region* src, uint64_t src_offset, uint64_t length,
            const RemoteKey* dst, uint64_t dst_offset, uint32_t imm);
};

class PeerGroup {
 public:
  PeerGroup(uint64_t engine_instance, std::vector<int> ranks)
      : engine_instance_(engine_instance), ranks_(std::move(ranks)) {}
  virtual ~PeerGroup() = default;
  const std::vector<int>& ranks() const { return ranks_; }
  size_t size() const { return ranks_.size(); }
  uint64_t engine_instance() const { return engine_instance_; }

 private:
  uint64_t engine_instance_;
  std::vector<int> ranks_;
};

class FabricPeerGroup : public PeerGroup {
 public:
  FabricPeerGroup(uint64_t engine_instance, std::vector<int> ranks, std::vector<WriteTemplate> t)
      : PeerGroup(engine_instance, std::move(ranks)), templates_(std::move(t)) {}
  const WriteTemplate& peer(size_t i) const { return templates_[i]; }

 private:
  std::vector<WriteTemplate> templates_;
};

}  // namespace a2a::transfer
