#include "transfer/fabric_engine.h"
#include "transfer/post_timeout.h"
#include "core/env.h"

#include <rdma/fi_errno.h>

#include <cstdlib>
#include <cstring>
#include <thread>

namespace a2a::transfer {
namespace {
constexpr size_t kMaxKeptErrors = 8;
}

std::unique_ptr<Engine> make_fabric_engine(const EngineOptions& opts) {
  return std::make_unique<FabricEngine>(opts);
}

FabricEngine::FabricEngine(const EngineOptions& options) : FabricEngine(options.resolved(), 0) {}

FabricEngine::FabricEngine(EngineOptions resolved, int)
    : Engine(resolved.rank, resolved.world_size, new_instance_id()), opts_(std::move(resolved)) {
  FabricOptions fo;
  fo.provider = opts_.provider;
  fo.iface = opts_.iface;
  fo.hmem = opts_.hmem;
  fo.num_domains = opts_.num_domains;
  fo.rx_cq_size = opts_.rx_cq_size;
  if (const char* t = env::get("JAX_MOE_A2A_FI_THREADING"); t && std::strcmp(t, "domain") == 0)
    fo.thread_safe = false;
  std::vector<InfoPtr> infos = select_infos(fo);
  provider_ = infos.front()->fabric_attr->prov_name;
  contexts_.reset(new uint8_t[world_size_]());
  for (int d = 0; d < opts_.num_domains; ++d) {
    domains_.push_back(std::make_unique<Domain>(infos[d].get(), d, opts_.rx_cq_size));
    domains_.back()->set_context_range(contexts_.get(), contexts_.get() + world_size_);
  }

  EngineAddress me;
  me.kind = EngineKind::kFabric;
  me.rank = rank_;
  me.world_size = world_size_;
  me.instance = instance_;
  me.provider = provider_;
  for (const auto& d : domains_) me.domains.push_back({d->address(), d->signal().remote});
  address_ = me.serialize();

  peers_.resize(world_size_);
  for (auto& p : peers_) p = std::make_unique<Peer>();
  add_peers({{rank_, address_}});  // we always know ourselves

  // Writes in flight (busy), or a transfer under way (held: hold_progress): the threads poll
  // without sleeping.
  auto busy = [this] { return pending() > 0; };
  auto held = [this] { return opts_.progress.hold && progress_held(); };
  if (domains_.size() == 1) {
    progress_threads_.push_back(
        std::make_unique<ProgressThread>(opts_.progress, [this] { return progress(); }, busy, held, &waiters_));
  } else {
    for (auto& d : domains_) {
      Domain* dom = d.get();
      progress_threads_.push_back(std::make_unique<ProgressThread>(
          opts_.progress, [this, dom] { return dom->poll(*this); }, busy, held, &waiters_));
    }
  }
}

FabricEngine::~FabricEngine() { close(); }

WriteTemplate FabricEngine::make_template(int rank, const EngineAddress& peer, int local_domain,
                                          int remote_domain) const {
  WriteTemplate t;
  t.rank = rank;
  t.self = rank == rank_;
  t.local_domain = local_domain;
  t.remote_domain = remote_domain;
  t.domain = domains_[t.local_domain].get();
  t.signal = peer.domains[t.remote_domain].signal;
  t.context = &contexts_[rank];
  t.msg.context = t.context;
  t.msg.iov_count = 1;
  t.msg.rma_iov_count = 1;
  return t;
}

void FabricEngine::add_peers(const std::vector<PeerAddress>& list) {
  check_open("add_peers");
  std::lock_guard<std::mutex> lock(peers_mu_);
  for (const PeerAddress& pa : list) {
    if (pa.rank < 0 || pa.rank >= world_size_)
      throw std::out_of_range(format("add_peers: rank %d outside world size %d", pa.rank, world_size_));
    EngineAddress a = EngineAddress::parse(pa.address);
    std::string who = format("rank %d", pa.rank);
    if (a.kind != EngineKind::kFabric)
      throw TransferError("add_peers: " + who + " gave the address of an in-process engine");
    if (a.rank != pa.rank)
      throw TransferError(format("add_peers: the address given for rank %d is rank %d's", pa.rank, a.rank));
    if (a.world_size != world_size_)
      throw TransferError(format("add_peers: %s has world size %d, this engine %d", who.c_str(),
                                 a.world_size, world_size_));
    if (a.provider != provider_)
      throw TransferError(format("add_peers: %s uses provider '%s', this engine '%s'", who.c_str(),
                                 a.provider.c_str(), provider_.c_str()));
    Peer& p = *peers_[pa.rank];
    if (p.known.load(std::memory_order_acquire)) {
      if (p.address == pa.address) continue;
      throw TransferError(format("add_peers: %s was already added with another address (instance "
                                 "%016llx, now %016llx)", who.c_str(),
                                 (unsigned long long)p.instance, (unsigned long long)a.instance));
    }
    if (pa.rank == rank_ && a.instance != instance_)
      throw TransferError("add_peers: the address given for our own rank is another engine's");
    const int theirs = static_cast<int>(a.domains.size());
    auto connect = [&](int local, int remote) {
      WriteTemplate t = make_template(pa.rank, a, local, remote);
      if (!t.self)
        t.msg.addr = t.addr =
            t.domain->insert_address(a.domains[remote].name, who + "'s domain " + std::to_string(remote));
      return t;
    };
    p.tpl = connect(pa.rank % num_domains(), rank_ % theirs);
    p.rails.clear();
    if (num_domains() > 1)  // every domain of ours reaches one of theirs (write_on); the default pair reused
      for (int d = 0; d < num_domains(); ++d)
        p.rails.push_back(d == p.tpl.local_domain && d % theirs == p.tpl.remote_domain ? p.tpl
                                                                                    : connect(d, d % theirs));
    p.instance = a.instance;
    p.num_domains = static_cast<int>(a.domains.size());
    p.address = pa.address;
    p.known.store(true, std::memory_order_release);
  }
}

uint64_t FabricEngine::peer_instance(int rank) const {
  if (rank < 0 || rank >= world_size_) return 0;
  const Peer& p = *peers_[rank];
  return p.known.load(std::memory_order_acquire) ? p.instance : 0;
}

int FabricEngine::peer_domains(int rank) const {
  return peer_instance(rank) ? peers_[rank]->num_domains : 0;
}

std::shared_ptr<Region> FabricEngine::register_memory(void* data, uint64_t size, MemoryKind kind,
                                                      int device) {
  check_open("register_memory");
  if (data == nullptr || size == 0)
    throw std::invalid_argument("register_memory: empty buffer (pointer and size must be non-zero)");
  std::vector<DomainMr> mrs;
  try {
    for (auto& d : domains_) mrs.push_back(d->register_memory(data, size, kind, device));
  } catch (...) {
    for (DomainMr& m : mrs) fi_close(&m.mr->fid);
    throw;
  }
  return std::make_shared<Region>(registry_, instance_, EngineKind::kFabric, rank_, data, size, kind,
                                  device, std::move(mrs));
}

std::shared_ptr<PeerGroup> FabricEngine::peer_group(const std::vector<int>& ranks) {
  std::vector<int> checked = check_group_ranks(ranks);
  std::vector<WriteTemplate> templates;
  for (int r : checked) templates.push_back(peers_[r]->tpl);
  return std::make_shared<FabricPeerGroup>(instance_, std::move(checked), std::move(templates));
}

void FabricEngine::post(const WriteTemplate& t, const Region* src, uint64_t src_offset,
                        uint64_t length, const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm,
                        const char* call) {
  struct Timed {  // post_ns_: every return and throw below
    std::atomic<uint64_t>& sum;
    Clock::time_point t0 = Clock::now();
    ~Timed() { sum.fetch_add(uint64_t(std::chrono::nanoseconds(Clock::now() - t0).count()), std::memory_order_relaxed); }
  } timed{post_ns_};
  if (length == 0) src = nullptr, dst = nullptr;  // only the immediate travels: signal regions
  if (t.self) {
    if (length) {
      if (src->memory_kind() != MemoryKind::kHost || dst->memory != MemoryKind::kHost)
        throw TransferError(format("%s to ourselves (rank %d): device memory is not supported "
                                   "for self writes", call, rank_));
      uint64_t addr = dst->address + dst_offset;
      bool copied = registry_->with_live(dst->keys[0].key, addr, length, [&] {
        std::memmove(reinterpret_cast<void*>(addr),
                     static_cast<const char*>(src->data()) + src_offset, length);
      });
      if (!copied)
        throw TransferError(format("%s to ourselves (rank %d): the destination region was "
                                   "deregistered", call, rank_));
    }
    counters_.add(imm);
    return;
  }
  WriteRequest req;
  req.fill(t, src, src_offset, length, dst ? &dst->keys[t.remote_domain] : nullptr, dst_offset, imm);
  uint64_t flags = FI_REMOTE_CQ_DATA;
  // Never inject from device memory: the provider would copy it to host memory on this thread with
  // cudaMemcpy (with a device-wide synchronisation where it cannot tell the buffers apart), which
  // waits for every running kernel, including one that spins until this write lands.
  if (t.domain->inject_size() > 0 && length <= t.domain->inject_size() &&
      (!src || src->memory_kind() == MemoryKind::kHost))
    flags |= FI_INJECT;

  outstanding_.fetch_add(1, std::memory_order_acq_rel);  // before posting: completions can't underflow
  ssize_t rc = t.domain->try_write(req.msg, flags);
  if (rc == 0) return;
  Timed blocked{post_blocked_ns_};
  Clock::time_point deadline{};
  bool have_deadline = false;
  const double op_timeout_s = PostTimeout::current_s();  // the caller's op timeout, if it set one
  const bool op_first = op_timeout_s >= 0 && op_timeout_s < opts_.post_timeout_s;
  while (rc == -FI_EAGAIN) {
    // The queue is full: complete something, then retry. Never forever.
    if (!have_deadline) {
      deadline = deadline_after(op_first ? op_timeout_s : opts_.post_timeout_s);
      have_deadline = true;
    } else if (Clock::now() > deadline) {
      break;
    }
    if (progress() == 0) std::this_thread::yield();
    rc = t.domain->try_write(req.msg, flags);
  }
  if (rc == 0) return;
  outstanding_.fetch_sub(1, std::memory_order_acq_rel);
  std::string what = format("%s: fi_writemsg of %llu bytes to rank %d (domain %d -> its domain %d, "
                            "provider %s)", call, (unsigned long long)length, t.rank, t.local_domain,
                            t.remote_domain, provider_.c_str());
  if (rc == -FI_EAGAIN && op_first)  // a peer that takes no writes within the op's timeout is missing
    throw TimeoutError(format("%s: the transmit queue stayed full (-FI_EAGAIN) for the op's timeout of %.1f s; "
                              "rank %d takes no writes (is its process alive?)",
                              what.c_str(), op_timeout_s, t.rank),
                       0, 1, {t.rank});
  if (rc == -FI_EAGAIN)
    throw TransferError(format("%s: the transmit queue stayed full (-FI_EAGAIN) for %.1f s "
                               "(JAX_MOE_A2A_POST_TIMEOUT_S); is the peer alive and progressing?",
                               what.c_str(), opts_.post_timeout_s));
  throw TransferError(fi_error_text(what, rc));
}

void FabricEngine::write(int peer, const Region& src, uint64_t src_offset, uint64_t length,
                         const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm) {
  check_open("write");
  check_source(src, src_offset, length, "write");
  check_target(peer, dst, dst_offset, length, "write");
  post(peers_[peer]->tpl, &src, src_offset, length, dst, dst_offset, imm, "write");
}

void FabricEngine::write_on(int rail, int peer, const Region& src, uint64_t src_offset, uint64_t length,
                            const RemoteRegion* dst, uint64_t dst_offset, uint32_t imm) {
  check_open("write_on");
  if (rail < 0) throw std::invalid_argument(format("write_on: rail %d < 0", rail));
  check_source(src, src_offset, length, "write_on");
  check_target(peer, dst, dst_offset, length, "write_on");
  post(rail_template(*peers_[peer], rail), &src, src_offset, length, dst, dst_offset, imm, "write_on");
}

void FabricEngine::signal_on(int rail, const PeerGroup& group, uint32_t imm) {
  check_open("signal_on");
  check_group(group, "signal_on");
  if (rail < 0) throw std::invalid_argument(format("signal_on: rail %d < 0", rail));
  for (int r : group.ranks())
    if (r != rank_) post(rail_template(*peers_[r], rail), nullptr, 0, 0, nullptr, 0, imm, "signal_on");
}

void FabricEngine::scatter(const PeerGroup& group, const Region& src,
                           const std::vector<ScatterEntry>& entries, uint32_t imm) {
  check_open("scatter");
  check_group(group, "scatter");
  const auto& g = static_cast<const FabricPeerGroup&>(group);
  for (const ScatterEntry& e : entries) {
    if (e.peer >= group.size())
      throw std::out_of_range(format("scatter: entry for group member %u of a group of %zu", e.peer,
                                     group.size()));
    check_source(src, e.src_offset, e.length, "scatter");
    check_target(group.ranks()[e.peer], e.dst, e.dst_offset, e.length, "scatter");
  }
  for (const ScatterEntry& e : entries)
    post(g.peer(e.peer), &src, e.src_offset, e.length, e.dst, e.dst_offset, imm, "scatter");
}

void FabricEngine::signal(const PeerGroup& group, uint32_t imm) {
  check_open("signal");
  check_group(group, "signal");
  const auto& g = static_cast<const FabricPeerGroup&>(group);
  for (size_t i = 0; i < g.size(); ++i) post(g.peer(i), nullptr, 0, 0, nullptr, 0, imm, "signal");
}

int FabricEngine::progress() {
  int events = 0;
  for (auto& d : domains_) events += d->poll(*this);
  return events;
}

bool FabricEngine::await(Predicate ready, Clock::time_point deadline) {
  WaiterScope scope(waiters_);
  Backoff backoff(opts_.progress);
  for (;;) {
    if (ready()) return true;
    if (progress() > 0) continue;
    if (ready()) return true;
    if (Clock::now() > deadline) return false;
    backoff.pause();
  }
}

void FabricEngine::flush(double timeout_s) {
  check_open("flush");
  auto ready = [&] { return pending() == 0; };
  bool done = await(ready, deadline_after(timeout_s));
  std::vector<std::string> errors;
  uint64_t count = 0;
  {
    std::lock_guard<std::mutex> lock(errors_mu_);
    errors.swap(errors_);
    count = error_count_;
    error_count_ = 0;
    has_errors_.store(false);
  }
  if (count) {
    std::string text = format("flush on rank %d: %llu write(s) failed", rank_, (unsigned long long)count);
    for (const auto& e : errors) text += "\n  " + e;
    if (count > errors.size()) text += format("\n  ... and %llu more", (unsigned long long)(count - errors.size()));
    throw TransferError(text);
  }
  if (!done) {
    uint64_t left = pending();
    throw TimeoutError(format("flush on rank %d: %llu write(s) still in flight after %.3f s", rank_,
                              (unsigned long long)left, timeout_s),
                       0, left);
  }
}

void FabricEngine::record_error(std::string text) {
  std::lock_guard<std::mutex> lock(errors_mu_);
  ++error_count_;
  if (errors_.size() < kMaxKeptErrors) errors_.push_back(std::move(text));
  has_errors_.store(true);
}

std::string FabricEngine::error_summary() const {
  if (!has_errors_.load()) return {};
  std::lock_guard<std::mutex> lock(errors_mu_);
  if (errors_.empty()) return {};
  return format("%llu completion error(s) pending, first: %s", (unsigned long long)error_count_,
                errors_.front().c_str());
}

void FabricEngine::on_arrivals(const uint32_t* imms, size_t n) { counters_.add_batch(imms, n); }

void FabricEngine::on_sent(size_t n) {
  // Never below zero: more completions than posted writes would be a provider (or our) bug;
  // say so at the next flush instead of waiting forever for 2^64 writes.
  uint64_t have = outstanding_.load(std::memory_order_acquire);
  while (!outstanding_.compare_exchange_weak(have, have >= n ? have - n : 0,
                                             std::memory_order_acq_rel)) {
  }
  if (have < n)
    record_error(format("%llu write completion(s) more than writes posted",
                        (unsigned long long)(n - have)));
}

void FabricEngine::on_send_error(void* context, const std::string& text, bool completed) {
  if (completed) on_sent(1);
  int rank = -1;
  auto* c = static_cast<uint8_t*>(context);
  if (c >= contexts_.get() && c < contexts_.get() + world_size_) rank = int(c - contexts_.get());
  record_error(rank >= 0 ? format("write to rank %d: %s", rank, text.c_str()) : text);
}

void FabricEngine::on_recv_error(const std::string& text) { record_error(text); }

void FabricEngine::on_unexpected(uint64_t flags) {
  record_error(format("unexpected completion (flags 0x%llx): neither our write nor a remote write "
                      "with CQ data", (unsigned long long)flags));
}

void FabricEngine::close() {
  std::lock_guard<std::mutex> lock(close_mu_);
  if (closed_.exchange(true)) return;
  for (auto& t : progress_threads_) t->stop();
  // Let posted writes finish (best effort, bounded): closing an endpoint drops them.
  auto deadline = deadline_after(1.0);
  while (pending() > 0 && Clock::now() < deadline)
    if (progress() == 0) std::this_thread::yield();
  registry_->close_all();                                     // memory registrations first
  for (auto it = domains_.rbegin(); it != domains_.rend(); ++it) (*it)->close();  // then ep .. fabric
}

}  // namespace a2a::transfer
