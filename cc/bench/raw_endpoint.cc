#include "bench/raw_endpoint.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "core/env.h"
#include "transfer/errors.h"
#include "transfer/fabric.h"

namespace a2a::bench {

using namespace a2a::transfer;

RawEndpoint::RawEndpoint(const std::string& provider, const std::string& iface, uint64_t buffer_bytes) {
  FabricOptions fo;  // the engine's choice of info, but opened single-threaded as fabtests do
  fo.provider = provider.empty() ? env::get_or("JAX_MOE_A2A_PROVIDER", "shm") : provider;
  fo.iface = iface;
  fo.thread_safe = false;
  std::vector<InfoPtr> infos = select_infos(fo);
  info_ = infos.front().release();
  fi_check(fi_fabric(info_->fabric_attr, &fabric_, nullptr), "raw fi_fabric");
  fi_check(fi_domain(fabric_, info_, &domain_, nullptr), "raw fi_domain");
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size = 1024;
  cq_attr.wait_obj = FI_WAIT_NONE;
  fi_check(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), "raw fi_cq_open");
  fi_av_attr av_attr{};
  fi_check(fi_av_open(domain_, &av_attr, &av_, nullptr), "raw fi_av_open");
  fi_check(fi_endpoint(domain_, info_, &ep_, nullptr), "raw fi_endpoint");
  fi_check(fi_ep_bind(ep_, &av_->fid, 0), "raw fi_ep_bind(av)");
  fi_check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), "raw fi_ep_bind(cq)");
  fi_check(fi_enable(ep_), "raw fi_enable");
  buf.assign(buffer_bytes, 1);
  fi_check(fi_mr_reg(domain_, buf.data(), buf.size(), FI_WRITE | FI_REMOTE_WRITE, 0, 7, 0, &mr_, nullptr),
           "raw fi_mr_reg");
  if (info_->domain_attr->mr_mode & FI_MR_ENDPOINT) {
    fi_check(fi_mr_bind(mr_, &ep_->fid, 0), "raw fi_mr_bind");
    fi_check(fi_mr_enable(mr_), "raw fi_mr_enable");
  }
  desc_ = fi_mr_desc(mr_);
  size_t len = 256;
  name_.resize(len);
  fi_check(fi_getname(&ep_->fid, name_.data(), &len), "raw fi_getname");
  name_.resize(len);
}

RawEndpoint::~RawEndpoint() {
  if (mr_) fi_close(&mr_->fid);
  if (ep_) fi_close(&ep_->fid);
  if (av_) fi_close(&av_->fid);
  if (cq_) fi_close(&cq_->fid);
  if (domain_) fi_close(&domain_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) fi_freeinfo(info_);
}

Bytes RawEndpoint::blob() const {
  ByteWriter w;
  w.put_bytes(name_.data(), name_.size());
  bool virt = info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR;
  w.put<uint64_t>(virt ? reinterpret_cast<uint64_t>(buf.data()) : 0);
  w.put<uint64_t>(fi_mr_key(mr_));
  return w.take();
}

RawPeer RawEndpoint::connect(const Bytes& peer) {
  ByteReader r(peer, "raw endpoint blob");
  Bytes name = r.get_bytes();
  RawPeer p;
  p.base = r.get<uint64_t>();
  p.key = r.get<uint64_t>();
  fi_addr_t a = FI_ADDR_UNSPEC;
  if (fi_av_insert(av_, name.data(), 1, &a, 0, nullptr) != 1)
    throw TransferError("raw endpoint: fi_av_insert failed");
  p.addr = a;
  return p;
}

void RawEndpoint::write(const RawPeer& to, uint64_t src_off, uint64_t size, uint64_t dst_off, uint64_t imm) {
  ssize_t rc;
  while ((rc = fi_writedata(ep_, buf.data() + src_off, size, desc_, imm, to.addr, to.base + dst_off, to.key,
                            nullptr)) == -FI_EAGAIN)
    drain();
  fi_check(rc, "raw fi_writedata");
}

void RawEndpoint::drain() {
  fi_cq_data_entry e[16];
  ssize_t n = fi_cq_read(cq_, e, 16);
  if (n > 0) {
    for (ssize_t i = 0; i < n; ++i) {
      if (e[i].flags & FI_REMOTE_CQ_DATA)
        ++arrivals;
      else
        ++sent;
    }
  } else if (n == -FI_EAVAIL) {
    fi_cq_err_entry err{};
    fi_cq_readerr(cq_, &err, 0);
    throw TransferError(format("raw endpoint: completion error %s", fi_strerror(err.err)));
  }
}

}  // namespace a2a::bench
