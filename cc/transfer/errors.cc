#include "transfer/errors.h"

#include <rdma/fi_errno.h>

#include <cstdarg>
#include <cstdio>

namespace a2a::transfer {

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list copy;
  va_copy(copy, args);
  int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(out.data(), out.size() + 1, fmt, args);
  va_end(args);
  return out;
}

std::string fi_error_text(const std::string& what, long rc) {
  int err = static_cast<int>(rc < 0 ? -rc : rc);
  return format("%s: %s (%ld)", what.c_str(), fi_strerror(err), rc);
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
  }
  return out;
}

}  // namespace a2a::transfer
