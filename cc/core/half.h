// The four halves of an all-to-all step, as the GPU kernels and the FFI handlers name them (the
// `op` of gpu/params.h's OpFlags, failure messages, the handlers' launches). int-sized, so the
// device layout of the parameter structs that carry it does not change.
#pragma once

namespace a2a {

enum class Half : int { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };

constexpr int kNumHalves = 4;

// The half numbered i (its value above; Python passes the number), or false when i names none.
inline bool half_of(int i, Half* h) {
  if (i < static_cast<int>(Half::kDispatchSend) || i >= kNumHalves) return false;
  *h = static_cast<Half>(i);
  return true;
}

inline const char* half_name(Half h) {
  switch (h) {
    case Half::kDispatchSend: return "dispatch_send";
    case Half::kDispatchRecv: return "dispatch_recv";
    case Half::kCombineSend: return "combine_send";
    case Half::kCombineRecv: return "combine_recv";
  }
  return "?";
}

}  // namespace a2a
