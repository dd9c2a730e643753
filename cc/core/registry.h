// A process-wide table from communicator id to a backend's communicator object, shared by the
// backends whose FFI handlers find their state by an integer attribute.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

namespace a2a {

template <typename T>
class Registry {
 public:
  explicit Registry(const char* what) : what_(what) {}

  void add(int64_t id, std::shared_ptr<T> value) {
    std::lock_guard<std::mutex> lock(mu_);
    items_[id] = std::move(value);
  }

  // Throws std::invalid_argument naming the backend when the id is unknown.
  std::shared_ptr<T> find(int64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = items_.find(id);
    if (it == items_.end())
      throw std::invalid_argument(std::string("jax_moe_a2a: no ") + what_ + " communicator with id " + std::to_string(id));
    return it->second;
  }

  // Removes and returns the entry (null if unknown); the caller closes it outside the lock.
  std::shared_ptr<T> remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = items_.find(id);
    if (it == items_.end()) return nullptr;
    auto v = std::move(it->second);
    items_.erase(it);
    return v;
  }

 private:
  const char* what_;
  mutable std::mutex mu_;
  std::map<int64_t, std::shared_ptr<T>> items_;
};

}  // namespace a2a
