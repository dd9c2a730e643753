#include "proxy/topology.h"
#include "core/env.h"

#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace a2a::proxy {

namespace {

bool parse_int(const std::string& s, int* out) {
  if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); }))
    return false;
  *out = std::stoi(s);
  return true;
}

}  // namespace

std::vector<int> parse_cpulist(const std::string& text) {
  std::vector<int> cpus;
  std::string body = text;
  body.erase(std::remove_if(body.begin(), body.end(), [](unsigned char c) { return std::isspace(c); }), body.end());
  if (body.empty()) return cpus;
  std::stringstream ss(body);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t dash = item.find('-');
    int lo = 0, hi = 0;
    if (dash == std::string::npos) {
      if (!parse_int(item, &lo)) return {};
      hi = lo;
    } else if (!parse_int(item.substr(0, dash), &lo) || !parse_int(item.substr(dash + 1), &hi) || hi < lo) {
      return {};
    }
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
  }
  return cpus;
}

int cpu_near_device(const std::string& sysfs_root, const std::string& bus_id, int local_index,
                    const std::vector<int>& allowed) {
  std::string id = bus_id;
  std::transform(id.begin(), id.end(), id.begin(), [](unsigned char c) { return std::tolower(c); });
  std::ifstream f(sysfs_root + "/bus/pci/devices/" + id + "/local_cpulist");
  std::string text;
  if (!f || !std::getline(f, text)) return -1;
  std::vector<int> near;
  for (int c : parse_cpulist(text))
    if (allowed.empty() || std::find(allowed.begin(), allowed.end(), c) != allowed.end()) near.push_back(c);
  if (near.empty()) return -1;
  const int n = static_cast<int>(near.size());
  const int k = ((local_index % n) + n) % n;
  return near[n - 1 - k];
}

std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

int local_process_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"}) {
    int v = 0;
    const char* s = env::launcher(var);
    if (s && parse_int(s, &v)) return v;
  }
  return 0;
}

}  // namespace a2a::proxy
