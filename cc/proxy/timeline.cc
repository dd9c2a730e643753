#include "proxy/timeline.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <stdexcept>

namespace a2a::proxy {

namespace {
constexpr const char* kNames[] = {"d_send_ok", "d_counts_out", "d_priv_post", "d_priv_posted", "d_counts_in",
                                  "d_over_out", "d_rows_in", "d_landed", "d_consumed", "c_send_ok",
                                  "c_comb_post", "c_comb_posted", "c_comb_in", "c_landed", "c_consumed"};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(Mark::kCount), "one name per Mark");
std::atomic<int> g_instances{0};  // the process's timelines, for distinct file names
}  // namespace

const char* mark_name(Mark m) { return m < Mark::kCount ? kNames[static_cast<int>(m)] : "?"; }

Timeline::Timeline(std::string prefix) : prefix_(std::move(prefix)) {
  if (on()) marks_.reserve(4096);
}

std::string Timeline::write(int rank, int num_ranks) {
  if (!on() || written_) return {};
  written_ = true;
  const std::string path = prefix_ + ".r" + std::to_string(rank) + ".p" + std::to_string(::getpid()) + "." +
                           std::to_string(g_instances.fetch_add(1)) + ".tsv";
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("JAX_MOE_A2A_PROXY_TIMELINE: cannot write " + path);
  std::fprintf(f, "# jax_moe_a2a proxy timeline rank %d ranks %d dropped %llu\n", rank, num_ranks,
               static_cast<unsigned long long>(dropped_));
  for (const Entry& e : marks_)
    std::fprintf(f, "%lld\t%s\t%d\t%u\t%d\n", static_cast<long long>(e.t_ns), mark_name(e.mark), e.slot, e.epoch,
                 e.peer);
  const bool ok = std::fclose(f) == 0;
  if (!ok) throw std::runtime_error("JAX_MOE_A2A_PROXY_TIMELINE: writing " + path + " failed");
  return path;
}

}  // namespace a2a::proxy
