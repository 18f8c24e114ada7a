// C++17 twin of megatron_zeppelin/router/reference.py: the NIC-aware routing schedule of one
// ring step. Same algorithm, same integer arithmetic, hence the same slices bit for bit; see
// the Python modules reference.py (algorithm) and model.py (cost model, pipeline).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace zeppelin_router {

using i64 = std::int64_t;

// Result of route_raw, in the layout of reference.route_raw:
// flat: [flow, src_proxy, dst_proxy, offset, nbytes]* ordered by flow then offset;
// nic_out / nic_in: bytes per NIC (index node * nics + nic);
// phases: (max dispatch, max NIC, max combine) resource time in ticks;
// direct_ticks: step time in ticks with every flow sent direct (one chunk);
// chunks / ticks: the pipeline's chunk count and its modelled step time in ticks.
struct RawResult {
  std::vector<i64> flat;
  std::vector<i64> nic_out;
  std::vector<i64> nic_in;
  std::array<i64, 3> phases{};
  i64 direct_ticks = 0;
  i64 chunks = 1;
  i64 ticks = 0;
};

// costs: (NVLink ticks/byte, NVLink ticks/message, NIC ticks/byte, NIC ticks/message);
// max_chunks / min_chunk_bytes: the pipeline's chunk rule (model.py).
// Throws std::invalid_argument on inconsistent inputs (the Python side validates first).
RawResult route_raw(i64 nodes, i64 gpus_per_node, i64 nics_per_node,
                    const std::vector<i64>& gpu_to_nic, const std::vector<i64>& costs,
                    const std::vector<i64>& src, const std::vector<i64>& dst,
                    const std::vector<i64>& nbytes, i64 align, i64 max_chunks,
                    i64 min_chunk_bytes);

}  // namespace zeppelin_router
