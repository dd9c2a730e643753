// Exceptions of the TransferEngine: every failure names the call, the peer and the provider's text.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace a2a::transfer {

// Any engine failure (libfabric call failed, bad descriptor, unknown peer, closed engine...).
class TransferError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wait ran out of time. `arrived` of `expected` arrivals were seen; `missing` lists the ranks that
// did not arrive when the wait knew which ranks it waited for (wait_ranks, barrier_ranked).
class TimeoutError : public TransferError {
 public:
  TimeoutError(const std::string& what, uint64_t arrived_n, uint64_t expected_n,
               std::vector<int> missing_ranks = {})
      : TransferError(what),
        arrived(arrived_n),
        expected(expected_n),
        missing(std::move(missing_ranks)) {}
  uint64_t arrived;
  uint64_t expected;
  std::vector<int> missing;
};

// printf-style formatting into a std::string.
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// "<call>: <fi_strerror text> (<-rc>)"; `what` says which call and which peer.
std::string fi_error_text(const std::string& what, long rc);

// Throws TransferError(fi_error_text(what, rc)) when rc < 0.
inline void fi_check(long rc, const char* what) {
  if (rc < 0) throw TransferError(fi_error_text(what, rc));
}

// "0, 3, 5" for messages.
std::string join_ranks(const std::vector<int>& ranks);

}  // namespace a2a::transfer
