// A process-wide table from (communicator id, EP group) to a backend's communicator object, shared
// by the backends whose FFI handlers find their state by an integer attribute. A communicator over
// one axis of a larger mesh has one EP group per position along the other axes (every group runs
// the same HLO, so the handler tells them apart by a group operand or by its device); this process
// holds an entry for every group it has ranks in. Single-group communicators use group 0.
#pragma once

#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace a2a {

template <typename T>
class Registry {
 public:
  explicit Registry(const char* what) : what_(what) {}

  void add(int64_t id, std::shared_ptr<T> value, int group = 0) {
    std::lock_guard<std::mutex> lock(mu_);
    items_[{id, group}] = std::move(value);
  }

  // Throws std::invalid_argument naming the backend when (id, group) is unknown.
  std::shared_ptr<T> find(int64_t id, int group = 0) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = items_.find({id, group});
    if (it == items_.end()) {
      std::string msg = std::string("jax_moe_a2a: no ") + what_ + " communicator with id " + std::to_string(id);
      if (group != 0) msg += " and EP group " + std::to_string(group) + " in this process";
      throw std::invalid_argument(msg);
    }
    return it->second;
  }

  // The first group of `id` (ascending) whose entry satisfies pred, or null. No allocation: the
  // GPU handlers call it per launch to find the group of their device.
  template <typename Pred>
  std::shared_ptr<T> find_if(int64_t id, Pred&& pred) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = items_.lower_bound({id, INT_MIN}); it != items_.end() && it->first.first == id; ++it)
      if (pred(*it->second)) return it->second;
    return nullptr;
  }

  // Every group of `id` in this process, by ascending group.
  std::vector<std::shared_ptr<T>> all(int64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<T>> out;
    for (auto it = items_.lower_bound({id, INT_MIN}); it != items_.end() && it->first.first == id; ++it)
      out.push_back(it->second);
    return out;
  }

  // Removes and returns every group's entry of `id` (none if unknown); the caller closes them
  // outside the lock.
  std::vector<std::shared_ptr<T>> remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<T>> out;
    auto it = items_.lower_bound({id, INT_MIN});
    while (it != items_.end() && it->first.first == id) {
      out.push_back(std::move(it->second));
      it = items_.erase(it);
    }
    return out;
  }

 private:
  const char* what_;
  mutable std::mutex mu_;
  std::map<std::pair<int64_t, int>, std::shared_ptr<T>> items_;
};

}  // namespace a2a
