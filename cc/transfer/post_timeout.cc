#include "transfer/post_timeout.h"

namespace a2a::transfer {
namespace {
thread_local const PostTimeout* innermost = nullptr;
}  // namespace

PostTimeout::PostTimeout(double timeout_s) : timeout_s_(timeout_s), outer_(innermost) { innermost = this; }

PostTimeout::~PostTimeout() { innermost = outer_; }

double PostTimeout::current_s() { return innermost ? innermost->timeout_s_ : -1.0; }

}  // namespace a2a::transfer
