// A proxy thread's counters as the Python dict both bindings return (cuda inter-node path, host
// backend's proxied mode): dispatches, combines, dispatches_landed, combines_landed, polls, sleeps, woken,
// sleeps_under_way, counts_to_landed_ns, comb_to_landed_ns, staged_bytes, staging_ns, staging_busy_ns, cpu, flag_path, row_path, rails, pipeline, priv_early,
// over_early, counts_to_priv_ns, recv_early, staged_early, comb_staged_early, pieces_behind_copy, pieces_copied_early, copies_in_flight_max, post_ns, post_blocked_ns, progress_events,
// progress_held_polls, progressing_polls, write_pieces, comb_pieces, row_bytes_to,
// comb_bytes_to, row_writes_to, comb_writes_to (lists, one entry per rank), and per op (host backend's proxied mode) call_ns_<op>, wait_ns_<op>.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "core/half.h"
#include "proxy/proxy.h"

namespace a2a::python {

inline nanobind::dict proxy_stats_dict(const proxy::ProxyStats& s) {
  nanobind::dict d;
  d["dispatches"] = s.dispatches;
  d["combines"] = s.combines;
  d["dispatches_landed"] = s.dispatches_landed;
  d["combines_landed"] = s.combines_landed;
  d["polls"] = s.polls;
  d["sleeps"] = s.sleeps;
  d["woken"] = s.woken;
  d["sleeps_under_way"] = s.sleeps_under_way;
  d["counts_to_landed_ns"] = s.counts_to_landed_ns;
  d["comb_to_landed_ns"] = s.comb_to_landed_ns;
  d["staged_bytes"] = s.staged_bytes;
  d["staging_ns"] = s.staging_ns;
  d["staging_busy_ns"] = s.staging_busy_ns;
  d["cpu"] = s.cpu;
  d["flag_path"] = s.flag_path;
  d["row_path"] = s.row_path;
  d["rails"] = s.rails;
  d["pipeline"] = s.pipeline;
  d["priv_early"] = s.priv_early;
  d["over_early"] = s.over_early;
  d["counts_to_priv_ns"] = s.counts_to_priv_ns;
  d["recv_early"] = s.recv_early;
  d["staged_early"] = s.staged_early;
  d["comb_staged_early"] = s.comb_staged_early;
  d["pieces_behind_copy"] = s.pieces_behind_copy;
  d["pieces_copied_early"] = s.pieces_copied_early;
  d["copies_in_flight_max"] = s.copies_in_flight_max;
  d["post_ns"] = s.post_ns;
  d["post_blocked_ns"] = s.post_blocked_ns;
  d["progress_events"] = s.progress_events;
  d["progress_held_polls"] = s.progress_held_polls;
  d["progressing_polls"] = s.progressing_polls;
  d["write_pieces"] = s.write_pieces;
  d["comb_pieces"] = s.comb_pieces;
  d["row_bytes_to"] = s.row_bytes_to;
  d["comb_bytes_to"] = s.comb_bytes_to;
  d["row_writes_to"] = s.row_writes_to;
  d["comb_writes_to"] = s.comb_writes_to;
  for (int i = 0; i < kNumHalves; ++i) {  // protocol::Op numbers the halves as Half does
    const std::string op = half_name(static_cast<Half>(i));
    d[("call_ns_" + op).c_str()] = s.packer_call_ns[i];
    d[("wait_ns_" + op).c_str()] = s.packer_wait_ns[i];
  }
  return d;
}

}  // namespace a2a::python
