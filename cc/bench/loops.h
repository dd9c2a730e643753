// Timing loops over the public Engine API, in C++ so that no Python call sits in the measured
// path (benchmarks/engine.py drives them through jax_moe_a2a_bench). Every rank involved calls the
// same function. Benchmark code: not part of the library (cc/LAYERS, layer bench).
#pragma once

#include <cstdint>
#include <vector>

#include "transfer/engine.h"

namespace a2a::bench {

using transfer::Engine;
using transfer::PeerGroup;
using transfer::Region;
using transfer::RemoteRegion;

// Ping-pong of `size`-byte writes with immediate `imm` between us and `peer`: the initiator writes
// and waits for the answer, the other side waits and answers. Returns seconds for `iters` round
// trips (after `warmup` untimed ones); half round trip = seconds / iters / 2.
double pingpong(Engine& e, int peer, const Region& src, const RemoteRegion& dst, uint64_t size,
                int iters, int warmup, bool initiator, uint32_t imm, double timeout_s);

// One-way stream: the sender posts `count` writes of `size` bytes (each to dst offset 0), the
// receiver waits for all of them and answers with a zero-byte write carrying ack_imm. Returns the
// sender's seconds from the first post to the ack (0 on the receiver).
double stream(Engine& e, int peer, const Region& src, const RemoteRegion& dst, uint64_t size,
              int count, bool sender, uint32_t imm, uint32_t ack_imm, double timeout_s);

// Every iteration: scatter `size` bytes to every member of the group (entry i from src offset
// i*size to dsts[i] at offset my_slot*size), then wait for one arrival per member. imm alternates
// between imm and imm^1. Returns seconds for `iters` iterations after `warmup`.
double scatter_loop(Engine& e, const PeerGroup& g, const Region& src,
                    const std::vector<const RemoteRegion*>& dsts, uint64_t size, int my_slot,
                    int iters, int warmup, uint32_t imm, double timeout_s);

// `iters` barriers over the group (imm alternating between imm and imm^1) after `warmup`.
double barrier_loop(Engine& e, const PeerGroup& g, int iters, int warmup, uint32_t imm,
                    double timeout_s);

}  // namespace a2a::bench
