// The caller's bound, per thread, on how long one write may keep retrying a full transmit queue.
// An op that waits at most timeout_s for its peers must not spend 30 s (EngineOptions::
// post_timeout_s) retrying a write to a peer whose process is gone (-FI_EAGAIN over tcp;ofi_rxm).
#pragma once

namespace a2a::transfer {

// While one lives on a thread, a write that thread posts retries -FI_EAGAIN for at most
// min(timeout_s, post_timeout_s) from its first -FI_EAGAIN, then throws TimeoutError naming the
// peer (missing = {peer}), as a wait for that peer would; without one, for post_timeout_s, then
// TransferError. Scopes nest (the innermost applies). Other threads (a proxy's, the progress
// thread) are not affected.
class PostTimeout {
 public:
  explicit PostTimeout(double timeout_s);
  ~PostTimeout();
  PostTimeout(const PostTimeout&) = delete;
  PostTimeout& operator=(const PostTimeout&) = delete;

  // The innermost scope's timeout on this thread, or a negative value when there is none.
  static double current_s();

 private:
  double timeout_s_;
  const PostTimeout* outer_;
};

}  // namespace a2a::transfer
