// Where a GPU's proxy thread should run: a CPU of the GPU's NUMA node (Linux sysfs), so that its
// polls of mapped pinned memory and its engine calls stay off the remote socket.
#pragma once

#include <string>
#include <vector>

namespace a2a::proxy {

// CPUs of a Linux cpulist ("0-3,8,10-11"), ascending as written; empty when malformed.
std::vector<int> parse_cpulist(const std::string& text);

// The CPU for the proxy thread of local rank `local_index` whose GPU is at PCI `bus_id`
// ("0000:1B:00.0", any case): among the device's NUMA-local CPUs
// (`<sysfs_root>/bus/pci/devices/<bus_id>/local_cpulist`) that are also in `allowed` (the
// process's affinity; empty = no restriction), the local_index-th counted from the highest (the
// main threads tend to run on the lowest), wrapping around. -1 when the list is missing or shares
// no CPU with `allowed`.
int cpu_near_device(const std::string& sysfs_root, const std::string& bus_id, int local_index,
                    const std::vector<int>& allowed);

// The CPUs this process may run on (sched_getaffinity); empty when unknown.
std::vector<int> allowed_cpus();

// This process's rank among the processes of its node (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID
// or LOCAL_RANK, the first set), 0 when none is set.
int local_process_rank();

}  // namespace a2a::proxy
