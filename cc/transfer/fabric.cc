#include "transfer/fabric.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>

#include <unistd.h>

#include "transfer/address.h"
#include "transfer/errors.h"

namespace a2a::transfer {
namespace {

constexpr uint64_t kMrModes =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;

InfoPtr make_hints(const FabricOptions& opts, bool with_provider, bool thread_safe) {
  InfoPtr hints(fi_allocinfo());
  if (!hints) throw TransferError("fi_allocinfo: out of memory");
  hints->caps = FI_RMA | (opts.hmem ? FI_HMEM : 0);
  hints->mode = 0;  // we support no mode bits (FI_CONTEXT, FI_RX_CQ_DATA, ...)
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode = kMrModes | (opts.hmem ? FI_MR_HMEM : 0);
  hints->domain_attr->threading = thread_safe ? FI_THREAD_SAFE : FI_THREAD_DOMAIN;
  hints->domain_attr->resource_mgmt = FI_RM_ENABLED;
  if (with_provider) hints->fabric_attr->prov_name = strdup(opts.provider.c_str());
  return hints;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

// Providers that offer RDM + RMA + remote CQ data here, for the "unknown provider" message.
std::string available_providers(const FabricOptions& opts) {
  InfoPtr hints = make_hints(opts, /*with_provider=*/false, /*thread_safe=*/false);
  fi_info* list = nullptr;
  if (fi_getinfo(kFabricApiVersion, nullptr, nullptr, 0, hints.get(), &list) != 0 || !list)
    return "none";
  std::set<std::string> names;
  for (fi_info* i = list; i; i = i->next)
    if (i->domain_attr->cq_data_size >= 4) names.insert(i->fabric_attr->prov_name);
  fi_freeinfo(list);
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "'" : ", '") + n + "'";
  return out.empty() ? "none" : out;
}

}  // namespace

std::vector<InfoPtr> select_infos(const FabricOptions& opts) {
  if (opts.num_domains < 1 || opts.num_domains > 64)
    throw TransferError(format("num_domains=%d: expected 1..64", opts.num_domains));
  if (opts.provider.empty()) throw TransferError("provider name is empty");

  fi_info* raw = nullptr;
  bool thread_safe = opts.thread_safe;
  InfoPtr hints = make_hints(opts, true, thread_safe);
  int rc = fi_getinfo(kFabricApiVersion, nullptr, nullptr, 0, hints.get(), &raw);
  if (rc == -FI_ENODATA && thread_safe) {  // provider without FI_THREAD_SAFE: we lock ourselves
    thread_safe = false;
    hints = make_hints(opts, true, thread_safe);
    rc = fi_getinfo(kFabricApiVersion, nullptr, nullptr, 0, hints.get(), &raw);
  }
  if (rc != 0 || !raw) {
    throw TransferError(format(
        "fi_getinfo(provider='%s', FI_EP_RDM, FI_RMA%s, API %u.%u): %s (%d). Providers with RDM "
        "endpoints, RMA%s and remote CQ data here: %s",
        opts.provider.c_str(), opts.hmem ? " | FI_HMEM" : "", FI_MAJOR(kFabricApiVersion),
        FI_MINOR(kFabricApiVersion), fi_strerror(-rc), rc, opts.hmem ? ", FI_HMEM" : "",
        available_providers(opts).c_str()));
  }
  InfoPtr list(raw);

  std::vector<std::string> ifaces = split(opts.iface, ',');
  std::vector<fi_info*> candidates;
  std::set<std::string> seen_domains, all_domains;
  std::string no_cq_data;
  for (fi_info* i = list.get(); i; i = i->next) {
    std::string dname = i->domain_attr->name ? i->domain_attr->name : "";
    all_domains.insert(dname);
    if (i->domain_attr->cq_data_size < 4) {
      no_cq_data = dname;
      continue;
    }
    if (!ifaces.empty() && std::find(ifaces.begin(), ifaces.end(), dname) == ifaces.end()) continue;
    // One entry per domain (the first: IPv4 before IPv6 for tcp), all on the first one's fabric,
    // so that domain d of every rank reaches domain d of every other rank.
    if (!candidates.empty() &&
        std::strcmp(i->fabric_attr->name, candidates.front()->fabric_attr->name) != 0)
      continue;
    if (!seen_domains.insert(dname).second) continue;
    candidates.push_back(i);
  }
  if (candidates.empty()) {
    std::string doms;
    for (const auto& d : all_domains) doms += (doms.empty() ? "" : ", ") + d;
    if (!no_cq_data.empty() && ifaces.empty())
      throw TransferError(format("provider '%s': domain %s offers no remote CQ data (cq_data_size < 4)",
                                 opts.provider.c_str(), no_cq_data.c_str()));
    throw TransferError(format("provider '%s': no domain named %s (interface option / "
                               "JAX_MOE_A2A_IFACE); its domains here: %s",
                               opts.provider.c_str(), opts.iface.c_str(), doms.c_str()));
  }
  std::vector<InfoPtr> out;
  for (int d = 0; d < opts.num_domains; ++d) {
    InfoPtr copy(fi_dupinfo(candidates[d % candidates.size()]));
    if (!copy) throw TransferError("fi_dupinfo: out of memory");
    // Record the threading level we got, so Domain knows whether to serialise.
    copy->domain_attr->threading = thread_safe ? FI_THREAD_SAFE : FI_THREAD_DOMAIN;
    out.push_back(std::move(copy));
  }
  return out;
}

Domain::Domain(const fi_info* info, int index, size_t rx_cq_size)
    : index_(index), serialized_(info->domain_attr->threading != FI_THREAD_SAFE) {
  provider_ = info->fabric_attr->prov_name ? info->fabric_attr->prov_name : "";
  name_ = info->domain_attr->name ? info->domain_attr->name : "";
  mr_mode_ = info->domain_attr->mr_mode;
  inject_size_ = info->tx_attr ? info->tx_attr->inject_size : 0;
  has_hmem_ = (info->caps & FI_HMEM) != 0;
  std::string where = format("domain %d (%s, %s)", index, provider_.c_str(), name_.c_str());
  try {
    fi_check(fi_fabric(info->fabric_attr, &fabric_, nullptr), ("fi_fabric for " + where).c_str());
    fi_check(fi_domain(fabric_, const_cast<fi_info*>(info), &domain_, nullptr),
             ("fi_domain for " + where).c_str());

    // One CQ for local write completions and remote writes with CQ data: entries whose context
    // is one of ours (set_context_range) are our writes; we post no receives.
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = rx_cq_size + std::max<size_t>(info->tx_attr ? info->tx_attr->size : 0, 1024);
    fi_check(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), ("fi_cq_open for " + where).c_str());

    fi_av_attr av_attr{};
    av_attr.type = info->domain_attr->av_type;
    fi_check(fi_av_open(domain_, &av_attr, &av_, nullptr), ("fi_av_open for " + where).c_str());

    fi_check(fi_endpoint(domain_, const_cast<fi_info*>(info), &ep_, nullptr),
             ("fi_endpoint for " + where).c_str());
    fi_check(fi_ep_bind(ep_, &av_->fid, 0), ("fi_ep_bind(av) for " + where).c_str());
    fi_check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), ("fi_ep_bind(cq) for " + where).c_str());
    if (provider_ == "shm") {
      // shm names its shared-memory region after the process id and a per-process endpoint
      // count unless told otherwise, and a region left in /dev/shm by a process that was killed
      // (no cleanup) then collides with a later process given the same pid: fi_enable fails
      // (EBUSY), or libfabric 1.17 maps the stale file and faults. A name with a random part
      // never collides.
      const std::string name = format("jax_moe_a2a-%d-%016llx-%d", int(getpid()),
                                      (unsigned long long)new_instance_id(), index);
      fi_check(fi_setname(&ep_->fid, const_cast<char*>(name.c_str()), name.size() + 1),
               ("fi_setname for " + where).c_str());
    }
    fi_check(fi_enable(ep_), ("fi_enable for " + where).c_str());

    size_t len = 0;
    int rc = fi_getname(&ep_->fid, nullptr, &len);
    if (rc != -FI_ETOOSMALL && rc != 0) fi_check(rc, ("fi_getname for " + where).c_str());
    address_.resize(len);
    fi_check(fi_getname(&ep_->fid, address_.data(), &len), ("fi_getname for " + where).c_str());
    address_.resize(len);

    signal_buf_.reset(new uint8_t[64]());
    signal_ = register_memory(signal_buf_.get(), 64, MemoryKind::kHost, 0);
  } catch (...) {
    close();
    throw;
  }
}

Domain::~Domain() { close(); }

void Domain::close() {
  // Order: memory registrations, endpoint, AV, CQs, domain, fabric.
  auto shut = [](fid* f) {
    if (f) fi_close(f);
  };
  if (signal_.mr) shut(&signal_.mr->fid);
  signal_ = DomainMr{};
  if (ep_) shut(&ep_->fid);
  if (av_) shut(&av_->fid);
  if (cq_) shut(&cq_->fid);
  if (domain_) shut(&domain_->fid);
  if (fabric_) shut(&fabric_->fid);
  ep_ = nullptr;
  av_ = nullptr;
  cq_ = nullptr;
  domain_ = nullptr;
  fabric_ = nullptr;
}

fi_addr_t Domain::insert_address(const Bytes& name, const std::string& who) {
  fi_addr_t addr = FI_ADDR_NOTAVAIL;
  std::lock_guard<std::mutex> lock(post_mu_);
  int n = fi_av_insert(av_, name.data(), 1, &addr, 0, nullptr);
  if (n != 1)
    throw TransferError(fi_error_text(format("fi_av_insert(%s) on domain %d", who.c_str(), index_),
                                      n < 0 ? n : -FI_EINVAL));
  return addr;
}

DomainMr Domain::register_memory(void* data, uint64_t size, MemoryKind kind, int device) {
  if (kind == MemoryKind::kCuda && !has_hmem_)
    throw TransferError(format(
        "register device memory on domain %d (%s): the provider does not offer FI_HMEM here; "
        "use host memory%s",
        index_, provider_.c_str(), " (or open the engine with hmem=True where FI_HMEM exists)"));
  if ((mr_mode_ & FI_MR_ALLOCATED) && (data == nullptr || size == 0))
    throw TransferError("register memory: FI_MR_ALLOCATED providers need a non-empty allocated buffer");
  iovec iov{data, static_cast<size_t>(size)};
  fi_mr_attr attr{};
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
  attr.requested_key = (mr_mode_ & FI_MR_PROV_KEY) ? 0 : next_key_.fetch_add(1);
  attr.iface = kind == MemoryKind::kCuda ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
  if (kind == MemoryKind::kCuda) attr.device.cuda = device;

  DomainMr out;
  std::string what = format("fi_mr_regattr(%p, %llu bytes, %s) on domain %d (%s)", data,
                            (unsigned long long)size, kind == MemoryKind::kCuda ? "cuda" : "host",
                            index_, provider_.c_str());
  if (kind == MemoryKind::kCuda)
    what += " (device memory: needs a libfabric built with CUDA support and a visible GPU)";
  // FI_HMEM_DEVICE_ONLY: cudaMalloc'd memory is for the device only. It lets shm copy GPU to GPU
  // through CUDA IPC instead of staging through its host bounce buffers.
  const uint64_t mr_flags = kind == MemoryKind::kCuda ? FI_HMEM_DEVICE_ONLY : 0;
  fi_check(fi_mr_regattr(domain_, &attr, mr_flags, &out.mr), what.c_str());
  if (mr_mode_ & FI_MR_ENDPOINT) {
    int rc = fi_mr_bind(out.mr, &ep_->fid, 0);
    if (rc == 0) rc = fi_mr_enable(out.mr);
    if (rc) {
      fi_close(&out.mr->fid);
      fi_check(rc, ("fi_mr_bind/enable after " + what).c_str());
    }
  }
  out.desc = fi_mr_desc(out.mr);
  out.remote.key = fi_mr_key(out.mr);
  if (out.remote.key == FI_KEY_NOTAVAIL) {
    fi_close(&out.mr->fid);
    throw TransferError(what + ": key not available (FI_MR_RAW providers are not supported)");
  }
  out.remote.base = (mr_mode_ & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(data) : 0;
  return out;
}

ssize_t Domain::try_write(const fi_msg_rma& msg, uint64_t flags) {
  std::lock_guard<std::mutex> lock(post_mu_);
  return fi_writemsg(ep_, &msg, flags);
}

void Domain::read_cq_error(CompletionSink& sink) {
  fi_cq_err_entry err{};
  ssize_t rc = fi_cq_readerr(cq_, &err, 0);
  if (rc < 0) {
    if (rc == -FI_EAGAIN) return;
    sink.on_recv_error(fi_error_text(format("fi_cq_readerr on domain %d", index_), rc));
    return;
  }
  bool tx = ours(err.op_context);  // a failed write of ours, else a remote one
  const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, nullptr, 0);
  std::string text = format("%s completion error on domain %d (%s): %s (%d); provider: %s",
                            tx ? "write" : "remote write", index_, provider_.c_str(),
                            fi_strerror(err.err), err.err, detail ? detail : "?");
  tx ? sink.on_send_error(err.op_context, text, true) : sink.on_recv_error(text);
}

int Domain::poll(CompletionSink& sink) {
  std::mutex& mu = serialized_ ? post_mu_ : poll_mu_;
  std::unique_lock<std::mutex> lock(mu, std::try_to_lock);
  if (!lock.owns_lock()) return 0;
  constexpr int kBatch = 64;
  fi_cq_data_entry e[kBatch];
  ssize_t n = fi_cq_read(cq_, e, kBatch);
  if (n > 0) {
    uint32_t imms[kBatch];
    size_t arrivals = 0, sent = 0;
    for (ssize_t i = 0; i < n; ++i) {
      if (ours(e[i].op_context)) ++sent;
      else if (e[i].flags & FI_REMOTE_CQ_DATA) imms[arrivals++] = static_cast<uint32_t>(e[i].data);
      else sink.on_unexpected(e[i].flags);
    }
    if (arrivals) sink.on_arrivals(imms, arrivals);
    if (sent) sink.on_sent(sent);
    return static_cast<int>(n);
  }
  if (n == -FI_EAGAIN) return 0;
  if (n == -FI_EAVAIL) {
    read_cq_error(sink);
    return 1;
  }
  sink.on_recv_error(fi_error_text(format("fi_cq_read on domain %d", index_), n));
  return 0;
}

}  // namespace a2a::transfer
