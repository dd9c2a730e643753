// One raw libfabric endpoint (no engine: its own fabric, domain, CQ, AV and one registered
// buffer; fi_writedata and busy polling in the calling thread), the part the raw baselines
// (raw_pingpong.h, raw_exchange.h) share. Opened single-threaded as fabtests do, with the
// engine's choice of provider info. Benchmark code: not part of the library.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transfer/wire.h"

struct fi_info;
struct fid_fabric;
struct fid_domain;
struct fid_cq;
struct fid_av;
struct fid_ep;
struct fid_mr;

namespace a2a::bench {

using transfer::Bytes;

// A peer's buffer as its blob describes it.
struct RawPeer {
  uint64_t addr = ~uint64_t(0);  // fi_addr_t
  uint64_t base = 0;             // the address writes are relative to (0 without FI_MR_VIRT_ADDR)
  uint64_t key = 0;
};

struct RawEndpoint {
  // provider / iface as for the engine (empty provider: $JAX_MOE_A2A_PROVIDER, default shm);
  // buffer_bytes: the registered buffer (the caller splits it into send and receive parts).
  RawEndpoint(const std::string& provider, const std::string& iface, uint64_t buffer_bytes);
  ~RawEndpoint();
  RawEndpoint(const RawEndpoint&) = delete;
  RawEndpoint& operator=(const RawEndpoint&) = delete;

  Bytes blob() const;                 // address + buffer base + key, for a peer's connect()
  RawPeer connect(const Bytes& peer);  // inserts the peer's address

  // fi_writedata of `size` bytes at buf[src_off] to the peer's buffer at `dst_off` with `imm`,
  // draining the CQ while the provider says FI_EAGAIN. Throws on an error.
  void write(const RawPeer& to, uint64_t src_off, uint64_t size, uint64_t dst_off, uint64_t imm);
  // Reads the CQ once: adds remote writes that landed here to `arrivals` and our own writes that
  // completed to `sent`. Throws on a completion error.
  void drain();

  uint64_t arrivals = 0, sent = 0;
  std::vector<uint8_t> buf;

 private:
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  fid_mr* mr_ = nullptr;
  void* desc_ = nullptr;
  Bytes name_;
};

}  // namespace a2a::bench
