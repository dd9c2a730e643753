// The process's NVSHMEM runtime as the nvshmem backend uses it: one initialisation per process
// (bootstrapped by a unique id that Python carries through the jax.distributed key-value store,
// or attached to a runtime someone else already initialised), and one symmetric arena carved
// into communicators locally, so that creating and freeing communicators needs no collective
// allocation after the first one.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace a2a::nvshmem {

// nvshmemx_init_status(): 0 not initialised, 1 bootstrapped, 2 initialised, 3 limited MPG, 4 full MPG.
int init_status();
const char* status_name(int status);

// 128 bytes of a fresh unique id (any process may create it; one process does, the others read it).
std::string unique_id();

// Binds `device` and initialises NVSHMEM as PE `pe` of `npes` with `uid`, unless a runtime is
// already up in this process: then it only attaches this library's device code to it. Either
// way at most one initialisation per process. Returns the status afterwards; throws on failure.
int ensure_initialized(int pe, int npes, const std::string& uid, int device);

int my_pe();
int n_pes();

// The arena: `bytes` of symmetric heap allocated collectively by the first call on every PE
// (nvshmem_malloc); later calls must pass the same size or less. Returns its local base.
uint8_t* arena(int64_t bytes);
int64_t arena_size();  // 0 before the first allocation

// First-fit allocation of `bytes` (256-byte aligned) inside the arena: offset, or -1 when full.
int64_t arena_alloc(int64_t bytes);
void arena_free(int64_t offset);

// Host barrier over every PE, after this process's device work is done (nvshmem_barrier_all:
// supported in limited MPG mode, unlike the host collectives).
void barrier_all();

// The same barrier on `stream` (nvshmemx_barrier_all_on_stream), for kernel timing only
// (gpu/kernel_timer.h): every PE must make the same number of calls.
cudaError_t barrier_all_on_stream(cudaStream_t stream);

}  // namespace a2a::nvshmem
