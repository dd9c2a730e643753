#include "bench/raw_pingpong.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "transfer/counters.h"
#include "transfer/errors.h"
#include "transfer/fabric.h"
#include "core/env.h"

namespace a2a::bench {

using namespace a2a::transfer;

struct RawPingPong::Impl {
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_cq* cq = nullptr;
  fid_av* av = nullptr;
  fid_ep* ep = nullptr;
  fid_mr* mr = nullptr;
  void* desc = nullptr;
  std::vector<uint8_t> buf;
  uint64_t max_size = 0;
  Bytes name;
  fi_addr_t peer = FI_ADDR_UNSPEC;
  uint64_t peer_base = 0, peer_key = 0;
  int arrivals = 0;

  ~Impl() {
    if (mr) fi_close(&mr->fid);
    if (ep) fi_close(&ep->fid);
    if (av) fi_close(&av->fid);
    if (cq) fi_close(&cq->fid);
    if (domain) fi_close(&domain->fid);
    if (fabric) fi_close(&fabric->fid);
    if (info) fi_freeinfo(info);
  }

  void drain() {
    fi_cq_data_entry e[16];
    ssize_t n = fi_cq_read(cq, e, 16);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i)
        if (e[i].flags & FI_REMOTE_CQ_DATA) ++arrivals;
    } else if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      fi_cq_readerr(cq, &err, 0);
      throw TransferError(format("raw ping-pong: completion error %s", fi_strerror(err.err)));
    }
  }
};

RawPingPong::RawPingPong(const std::string& provider, const std::string& iface, uint64_t max_size)
    : impl_(new Impl) {
  Impl& m = *impl_;
  FabricOptions fo;  // the engine's choice of info, but opened single-threaded as fabtests do
  fo.provider = provider.empty() ? env::get_or("JAX_MOE_A2A_PROVIDER", "shm") : provider;
  fo.iface = iface;
  fo.thread_safe = false;
  std::vector<InfoPtr> infos = select_infos(fo);
  m.info = infos.front().release();
  fi_check(fi_fabric(m.info->fabric_attr, &m.fabric, nullptr), "raw fi_fabric");
  fi_check(fi_domain(m.fabric, m.info, &m.domain, nullptr), "raw fi_domain");
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size = 1024;
  cq_attr.wait_obj = FI_WAIT_NONE;
  fi_check(fi_cq_open(m.domain, &cq_attr, &m.cq, nullptr), "raw fi_cq_open");
  fi_av_attr av_attr{};
  fi_check(fi_av_open(m.domain, &av_attr, &m.av, nullptr), "raw fi_av_open");
  fi_check(fi_endpoint(m.domain, m.info, &m.ep, nullptr), "raw fi_endpoint");
  fi_check(fi_ep_bind(m.ep, &m.av->fid, 0), "raw fi_ep_bind(av)");
  fi_check(fi_ep_bind(m.ep, &m.cq->fid, FI_TRANSMIT | FI_RECV), "raw fi_ep_bind(cq)");
  fi_check(fi_enable(m.ep), "raw fi_enable");
  m.max_size = max_size;
  m.buf.assign(2 * max_size, 1);
  fi_check(fi_mr_reg(m.domain, m.buf.data(), m.buf.size(), FI_WRITE | FI_REMOTE_WRITE, 0, 7, 0,
                     &m.mr, nullptr),
           "raw fi_mr_reg");
  if (m.info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
    fi_check(fi_mr_bind(m.mr, &m.ep->fid, 0), "raw fi_mr_bind");
    fi_check(fi_mr_enable(m.mr), "raw fi_mr_enable");
  }
  m.desc = fi_mr_desc(m.mr);
  size_t len = 256;
  m.name.resize(len);
  fi_check(fi_getname(&m.ep->fid, m.name.data(), &len), "raw fi_getname");
  m.name.resize(len);
}

RawPingPong::~RawPingPong() = default;

Bytes RawPingPong::blob() const {
  ByteWriter w;
  w.put_bytes(impl_->name.data(), impl_->name.size());
  bool virt = impl_->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR;
  w.put<uint64_t>(virt ? reinterpret_cast<uint64_t>(impl_->buf.data()) : 0);
  w.put<uint64_t>(fi_mr_key(impl_->mr));
  return w.take();
}

void RawPingPong::connect(const Bytes& peer) {
  ByteReader r(peer, "raw ping-pong blob");
  Bytes name = r.get_bytes();
  impl_->peer_base = r.get<uint64_t>();
  impl_->peer_key = r.get<uint64_t>();
  if (fi_av_insert(impl_->av, name.data(), 1, &impl_->peer, 0, nullptr) != 1)
    throw TransferError("raw ping-pong: fi_av_insert failed");
}

double RawPingPong::run(uint64_t size, int iters, bool initiator, double timeout_s) {
  Impl& m = *impl_;
  if (size > m.max_size) throw std::invalid_argument("raw ping-pong: size > max_size");
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(timeout_s));
  auto wait_one = [&] {
    while (m.arrivals == 0) {
      m.drain();
      if (m.arrivals == 0 && Clock::now() > deadline)
        throw TimeoutError("raw ping-pong: the peer did not answer", 0, 1);
    }
    --m.arrivals;
  };
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    if (!initiator) wait_one();
    ssize_t rc;
    while ((rc = fi_writedata(m.ep, m.buf.data(), size, m.desc, uint64_t(i), m.peer,
                              m.peer_base + m.max_size, m.peer_key, nullptr)) == -FI_EAGAIN)
      m.drain();
    fi_check(rc, "raw fi_writedata");
    if (initiator) wait_one();
  }
  double t = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int k = 0; k < 100; ++k) m.drain();  // collect the last write completions
  return t;
}

}  // namespace a2a::bench
