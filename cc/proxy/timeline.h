// The proxy's step timeline (JAX_MOE_A2A_PROXY_TIMELINE=<prefix>): one timestamp per protocol step
// the proxy takes, so a benchmark can split a transfer into what the proxy waited for (our packer,
// a peer's COUNTS, a peer's rows, the landing) instead of one "unexplained" rest.
//
// Off (the default) it records nothing and costs one branch per step. On, each proxy keeps up to
// kCapacity marks in memory (CLOCK_MONOTONIC ns: std::chrono::steady_clock, the clock the processes
// of one machine share; benchmarks/proxy.py's skew uses the same) and writes them when it stops, to
// "<prefix>.r<rank>.p<pid>.<n>.tsv" (n: the process's proxies in start order), one mark a line:
//   t_ns <TAB> mark <TAB> slot <TAB> epoch <TAB> peer (-1: not about one peer)
// after a header line "# jax_moe_a2a proxy timeline rank <rank> ranks <N> dropped <marks past capacity>".
// benchmarks/benchlib/proxy_timeline.py reads and summarises the files.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace a2a::proxy {

// One step of a slot's dispatch or combine pipeline (Proxy::step_dispatch / step_combine).
enum class Mark : uint8_t {
  kDSendOk,      // d_send_ok raised: the remote peers freed the slot (the FREE_D of epoch e - 1 in)
  kDCountsOut,   // our packer's d_counts seen, our COUNTS posted: the dispatch's transfer starts
  kDPrivPost,    // about to post our PRIV write to `peer` (its rows are packed)
  kDPrivPosted,  // that post returned
  kDCountsIn,    // every remote peer's COUNTS arrived
  kDOverOut,     // our OVER writes posted, the combine offsets and overflow bases published
  kDRowsIn,      // every remote peer's PRIV and OVER rows arrived
  kDLanded,      // d_landed raised (after the landing copy or fence, if any)
  kDConsumed,    // our dispatch_recv's d_consumed seen, FREE_D posted
  kCSendOk,      // c_send_ok raised
  kCCombPost,    // our packer's c_packed seen (and copied, with staging): about to post COMB
  kCCombPosted,  // the COMB posts returned
  kCCombIn,      // every remote peer's COMB rows arrived
  kCLanded,      // c_landed raised
  kCConsumed,    // our combine_recv's c_consumed seen, FREE_C posted
  kCount
};

const char* mark_name(Mark m);

class Timeline {
 public:
  static constexpr size_t kCapacity = 1 << 18;  // 6 MB of marks: ~20,000 dispatch + combine steps
  // prefix empty: off.
  explicit Timeline(std::string prefix = {});
  bool on() const { return !prefix_.empty(); }
  void mark(Mark m, int slot, uint32_t epoch, int peer = -1) {
    if (!on()) return;
    if (marks_.size() >= kCapacity) {
      ++dropped_;
      return;
    }
    marks_.push_back({std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch()).count(), m, static_cast<int16_t>(slot),
                      static_cast<int16_t>(peer), epoch});
  }
  // Writes the file (once; later calls do nothing). Returns its path ("" when off or done before).
  // Throws std::runtime_error when the file cannot be written.
  std::string write(int rank, int num_ranks);

 private:
  struct Entry {
    int64_t t_ns;
    Mark mark;
    int16_t slot, peer;
    uint32_t epoch;
  };
  std::string prefix_;
  std::vector<Entry> marks_;
  uint64_t dropped_ = 0;
  bool written_ = false;
};

}  // namespace a2a::proxy
