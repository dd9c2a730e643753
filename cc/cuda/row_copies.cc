#include "cuda/row_copies.h"

#include "gpu/check.h"

namespace a2a::cuda {
using namespace ::a2a::gpu;  // the shared device library (cc/gpu)

namespace {

void check(cudaError_t rc, const char* what) { check_cuda(rc, "jax_moe_a2a cuda (inter-node row copies)", what); }

}  // namespace

RowCopies::RowCopies(int device, std::vector<Slot> slots) : device_(device), slots_(std::move(slots)) {
  try {
    check(cudaStreamCreateWithFlags(&to_host_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cudaStreamCreateWithFlags(&to_gpu_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cudaMalloc(&scratch_gpu_, 64), "cudaMalloc");
    check(cudaHostAlloc(&scratch_host_, 64, cudaHostAllocDefault), "cudaHostAlloc");
    tickets_.assign(slots_.size(), {});
    for (size_t z = 0; z < slots_.size(); ++z) {
      events_.push_back({});
      for (auto& evs : events_.back())
        for (cudaEvent_t& ev : evs) ev = nullptr;
      for (auto& evs : events_.back())
        for (cudaEvent_t& ev : evs) check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    }
  } catch (...) {
    release();
    throw;
  }
}

RowCopies::~RowCopies() { release(); }

void RowCopies::release() {
  // Copies still in flight finish before their buffers can go (they never wait for a kernel).
  if (to_host_) cudaStreamSynchronize(to_host_);
  if (to_gpu_) cudaStreamSynchronize(to_gpu_);
  for (auto& slot : events_)
    for (auto& evs : slot)
      for (cudaEvent_t ev : evs)
        if (ev) cudaEventDestroy(ev);
  events_.clear();
  if (scratch_gpu_) cudaFree(scratch_gpu_);
  if (scratch_host_) cudaFreeHost(scratch_host_);
  scratch_gpu_ = scratch_host_ = nullptr;
  if (to_host_) cudaStreamDestroy(to_host_);
  if (to_gpu_) cudaStreamDestroy(to_gpu_);
  to_host_ = to_gpu_ = nullptr;
}

void RowCopies::on_thread() {
  thread_local int current = -1;
  if (current == device_) return;
  check(cudaSetDevice(device_), "cudaSetDevice");
  current = device_;
}

void RowCopies::prepare() {
  on_thread();
  check(cudaMemcpyAsync(scratch_gpu_, scratch_host_, 64, cudaMemcpyHostToDevice, to_gpu_), "cudaMemcpyAsync");
  check(cudaMemcpyAsync(scratch_host_, scratch_gpu_, 64, cudaMemcpyDeviceToHost, to_host_), "cudaMemcpyAsync");
  for (auto& slot : events_)
    for (int i = 0; i < proxy::kRowBuffers; ++i)
      for (cudaEvent_t ev : slot[i])
        check(cudaEventRecord(ev, proxy::to_registered(static_cast<proxy::RowBuffer>(i)) ? to_host_ : to_gpu_),
              "cudaEventRecord");
  check(cudaStreamSynchronize(to_gpu_), "cudaStreamSynchronize");
  check(cudaStreamSynchronize(to_host_), "cudaStreamSynchronize");
  for (auto& slot : events_)
    for (auto& evs : slot)
      for (cudaEvent_t ev : evs) check(cudaEventQuery(ev), "cudaEventQuery");
}

uint64_t RowCopies::start(int z, proxy::RowBuffer b, const std::vector<protocol::ByteRange>& ranges) {
  on_thread();
  const int i = static_cast<int>(b);
  const Slot& s = slots_.at(z);
  const bool out = proxy::to_registered(b);
  cudaStream_t stream = out ? to_host_ : to_gpu_;
  proxy::check_ranges(s, b, ranges, "jax_moe_a2a cuda");
  for (const protocol::ByteRange& r : ranges) {
    uint8_t* gpu = s.packer[i] + r.off;
    uint8_t* host = s.registered[i] + r.off;
    check(out ? cudaMemcpyAsync(host, gpu, r.len, cudaMemcpyDeviceToHost, stream)
              : cudaMemcpyAsync(gpu, host, r.len, cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync");
  }
  const uint64_t ticket = ++tickets_[z][i];
  check(cudaEventRecord(events_[z][i][ticket % proxy::kCopyDepth], stream), "cudaEventRecord");
  return ticket;
}

bool RowCopies::done(int z, proxy::RowBuffer b, uint64_t ticket) {
  const cudaError_t rc = cudaEventQuery(events_.at(z)[static_cast<int>(b)][ticket % proxy::kCopyDepth]);
  if (rc == cudaErrorNotReady) return false;
  check(rc, "cudaEventQuery");
  return true;
}

}  // namespace a2a::cuda
