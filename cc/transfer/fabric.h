// libfabric setup: choosing provider/domain infos, and one Domain = fabric + domain + AV + CQs +
// one RDM endpoint, with memory registration that honours the provider's mr_mode.
#pragma once

#include <rdma/fabric.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transfer/memory.h"
#include "transfer/wire.h"

struct fid_av;
struct fid_cq;
struct fid_domain;
struct fid_ep;
struct fid_fabric;
struct fi_msg_rma;

namespace a2a::transfer {

// fi_getinfo is asked for this API version (the Debian/AWS builds we target are >= 1.17).
#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(1, 17))
constexpr uint32_t kFabricApiVersion = FI_VERSION(1, 17);
#else
constexpr uint32_t kFabricApiVersion = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
#endif

struct FabricOptions {
  std::string provider = "shm";  // "efa", "verbs;ofi_rxm", "tcp;ofi_rxm", "shm", ...
  std::string iface;             // comma-separated domain names ("lo", "eth0", "rdmap0s6-rdm"); "" = any
  bool hmem = false;             // ask for FI_HMEM (device memory registration)
  int num_domains = 1;
  size_t rx_cq_size = 16384;
  bool thread_safe = true;  // FI_THREAD_SAFE; false or unavailable: FI_THREAD_DOMAIN + our locks
                            // ($JAX_MOE_A2A_FI_THREADING=domain forces the latter)
};

struct InfoDeleter {
  void operator()(fi_info* i) const { fi_freeinfo(i); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// One info per domain index d (entries repeat when there are fewer NICs than domains). Throws a
// TransferError naming the provider and the providers that are available when none matches.
std::vector<InfoPtr> select_infos(const FabricOptions& opts);

// What the poller hands to the engine.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  virtual void on_arrivals(const uint32_t* imms, size_t n) = 0;  // remote writes with CQ data
  virtual void on_sent(size_t n) = 0;                            // local write completions
  // A failed write (completed == true: it counts as completed) or a failed CQ read.
  virtual void on_send_error(void* context, const std::string& text, bool completed) = 0;
  // A completion that is neither our write nor a remote write with CQ data (flags given).
  virtual void on_unexpected(uint64_t flags) = 0;
  virtual void on_recv_error(const std::string& text) = 0;
};

class Domain {
 public:
  // Opens everything; FI_THREAD_DOMAIN infos (see select_infos) serialise posting and polling.
  Domain(const fi_info* info, int index, size_t rx_cq_size);
  ~Domain();
  Domain(const Domain&) = delete;
  Domain& operator=(const Domain&) = delete;

  int index() const { return index_; }
  const std::string& provider() const { return provider_; }
  const std::string& name() const { return name_; }
  const Bytes& address() const { return address_; }  // fi_getname
  size_t inject_size() const { return inject_size_; }
  uint64_t mr_mode() const { return mr_mode_; }
  bool has_hmem() const { return has_hmem_; }
  const DomainMr& signal() const { return signal_; }
  void* signal_buffer() const { return signal_buf_.get(); }

  // Inserts a peer's fi_getname bytes into the AV; `who` names the peer in errors.
  fi_addr_t insert_address(const Bytes& name, const std::string& who);

  // Registers [data, data+size) for local and remote writes (fi_mr_regattr; device memory through
  // FI_HMEM when kind is kCuda). Keys are provider keys or ours (unique in this domain).
  DomainMr register_memory(void* data, uint64_t size, MemoryKind kind, int device);

  // One fi_writemsg attempt under the post lock; returns its rc (0, -FI_EAGAIN, error).
  ssize_t try_write(const fi_msg_rma& msg, uint64_t flags);

  // Completions whose context lies in [begin, end) are our writes; all others are remote.
  void set_context_range(const void* begin, const void* end) {
    ctx_begin_ = static_cast<const char*>(begin);
    ctx_end_ = static_cast<const char*>(end);
  }

  // Reads the CQ once (one batch). Returns the number of completions handled; 0 if another
  // thread is polling this domain right now.
  int poll(CompletionSink& sink);

  // Closes the signal MR, endpoint, AV, CQs, domain and fabric (regions must be closed first).
  void close();

 private:
  void read_cq_error(CompletionSink& sink);

  int index_;
  std::string provider_, name_;
  uint64_t mr_mode_ = 0;
  size_t inject_size_ = 0;
  bool has_hmem_ = false;
  bool ours(const void* ctx) const {
    auto* c = static_cast<const char*>(ctx);
    return c >= ctx_begin_ && c < ctx_end_;
  }

  bool serialized_;
  const char* ctx_begin_ = nullptr;
  const char* ctx_end_ = nullptr;  // FI_THREAD_DOMAIN: posting and polling share one lock
  std::atomic<uint64_t> next_key_{1};
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_av* av_ = nullptr;
  fid_cq* cq_ = nullptr;  // one CQ for both directions: one provider progress call per poll
  fid_ep* ep_ = nullptr;
  Bytes address_;
  std::unique_ptr<uint8_t[]> signal_buf_;
  DomainMr signal_;
  std::mutex post_mu_, poll_mu_;
};

}  // namespace a2a::transfer
