// The state the hierarchical placement's steps share (planner/zeppelin.py's placement_state.py
// and the inter-node step's node assignment): used by planner_inter_node.cpp (the inter-node
// step) and planner_hierarchical.cpp (the intra-node step, the leftovers, the entry point).
#pragma once
#include <functional>
#include <limits>
#include <queue>
#include <utility>
#include <vector>

#include "planner.h"

namespace zeppelin_planner {
namespace placement {

constexpr double kInf = std::numeric_limits<double>::infinity();
using Entry = std::pair<double, i64>;  // (load, node)
using MinHeap = std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>>;
using Spans = std::vector<std::pair<i64, double>>;  // (k, per-rank seconds)

struct Placement {
  const Problem& pb;
  double target, slack, total_work, per_token, overhead = 0.0;
  std::vector<double> local_time;
  i64 gpn;
  // span_times of each sequence once computed (a pure function of the sequence, so one cache
  // serves every node), and choose_gpus's scratch buffers, reused call after call
  std::vector<Spans> spans;
  std::vector<char> has_spans;
  std::vector<i64> order, room;
  std::vector<double> after;
  std::vector<std::vector<i64>> options;

  bool fits(i64 seqlen, i64 ring) const {
    return (ring == 1 || seqlen >= 2 * ring) && zigzag_share_bound(seqlen, ring) <= pb.capacity;
  }
  double span_time(i64 seqlen, i64 ring, int tier) const {
    const double seconds = pb.costs.task_time(static_cast<double>(seqlen), ring, tier, pb.routing);
    return per_token != 0.0 ? seconds + per_token * static_cast<double>(seqlen) /
                                            static_cast<double>(ring)
                            : seconds;
  }
};

struct NodeAssignment {
  std::vector<std::pair<i64, std::vector<i64>>> inter;  // (seq, its nodes sorted), placed order
  std::vector<std::vector<i64>> per_node;
};

// span_times of sequence ``seq``, computed once per sequence and cached in ``st``.
const Spans& cached_spans(Placement& st, i64 seq);
// The index of the smallest option whose peak is within ``slack`` of the best.
i64 smallest_near_best(const std::vector<std::pair<double, i64>>& peaks, double slack);
// The inter-node step (inter_node_step.py): heavy sequences spread over nodes, light ones whole.
NodeAssignment assign_nodes(Placement& st, const std::vector<i64>& order);

}  // namespace placement
}  // namespace zeppelin_planner
