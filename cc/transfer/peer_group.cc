#include "transfer/peer_group.h"

#include "transfer/fabric.h"

namespace a2a::transfer {

void WriteRequest::fill(const WriteTemplate& t, const Region* src, uint64_t src_offset,
                        uint64_t length, const RemoteKey* dst, uint64_t dst_offset, uint32_t imm) {
  msg = t.msg;
  if (src) {
    iov.iov_base = static_cast<char*>(src->data()) + src_offset;
    desc = src->mr(t.local_domain).desc;
  } else {
    iov.iov_base = t.domain->signal_buffer();
    desc = t.domain->signal().desc;
  }
  iov.iov_len = length;
  const RemoteKey& target = dst ? *dst : t.signal;
  rma.addr = target.base + (dst ? dst_offset : 0);
  rma.len = length;
  rma.key = target.key;
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.rma_iov = &rma;
  msg.rma_iov_count = 1;
  msg.data = imm;
}

}  // namespace a2a::transfer
