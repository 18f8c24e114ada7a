// Twin of planner/zeppelin.py and its steps (inter_node_step.py, intra_node_step.py,
// placement_state.py): the hierarchical placement (inter-node step, then intra-node step per
// node, then the leftovers). Names mirror the Python functions. The inter-node step is in
// planner_inter_node.cpp, the state both steps share in planner_placement.h.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <set>

#include "planner.h"
#include "planner_placement.h"
#include "planner_room.h"

namespace zeppelin_planner {
namespace {

using namespace placement;

// Per-GPU loads and tokens of one node (intra_node_step.NodeGpus).
struct NodeGpus {
  std::vector<double> loads;
  std::vector<i64> tokens;
  double total = 0.0;
  explicit NodeGpus(i64 gpn) : loads(gpn, 0.0), tokens(gpn, 0) {}

  void charge(const std::vector<i64>& gpus, i64 seqlen, double per_rank) {
    for (size_t p = 0; p < gpus.size(); ++p) {
      loads[gpus[p]] += per_rank;
      tokens[gpus[p]] += zigzag_share(seqlen, static_cast<i64>(gpus.size()), static_cast<i64>(p));
    }
    total = add_up(loads);
  }

  i64 place_local(i64 seqlen, double seconds, i64 capacity, double limit) {
    i64 best = -1;
    const i64 room = capacity - seqlen;
    for (size_t g = 0; g < loads.size(); ++g) {
      if (tokens[g] <= room && (best < 0 || loads[g] < loads[best])) best = static_cast<i64>(g);
    }
    if (best < 0 || loads[best] + seconds > limit) return -1;
    loads[best] += seconds;
    tokens[best] += seqlen;
    total += seconds;
    return best;
  }
};

// The GPUs of the node the sequence runs on (empty: no span has room).
std::vector<i64> choose_gpus(Placement& st, NodeGpus& gpus, i64 seq, double remaining,
                             i64 upcoming) {
  const Problem& pb = st.pb;
  const i64 gpn = st.gpn, seqlen = pb.seqlens[seq];
  const double seconds = st.local_time[seq];
  std::vector<i64>& order = st.order;
  order.resize(gpn);
  for (i64 g = 0; g < gpn; ++g) order[g] = g;
  std::stable_sort(order.begin(), order.end(),
                   [&](i64 a, i64 b) { return gpus.loads[a] < gpus.loads[b]; });
  const double floor = (gpus.total + remaining) / static_cast<double>(gpn);
  const Spans* ahead = upcoming >= 0 ? &cached_spans(st, upcoming) : nullptr;
  std::vector<std::pair<double, i64>> peaks;
  st.options.resize(gpn + 1);
  for (const auto& [k, per_rank] : cached_spans(st, seq)) {
    const i64 share = zigzag_share_bound(seqlen, k);
    std::vector<i64>& room = st.room;
    room.clear();
    for (i64 g : order) {
      if (static_cast<i64>(room.size()) == k) break;
      if (gpus.tokens[g] + share <= pb.capacity) room.push_back(g);
    }
    if (static_cast<i64>(room.size()) < k) continue;
    const double wasted =
        std::max(0.0, per_rank * static_cast<double>(k) - seconds) / static_cast<double>(gpn);
    double projected = std::max(gpus.loads[room.back()] + per_rank, floor + wasted);
    if (ahead != nullptr && !ahead->empty()) {
      std::vector<double>& after = st.after;
      after.resize(gpn);
      for (i64 g = 0; g < gpn; ++g) {
        const bool in = std::find(room.begin(), room.end(), g) != room.end();
        after[g] = gpus.loads[g] + (in ? per_rank : 0.0);
      }
      std::sort(after.begin(), after.end());
      double best = kInf;
      for (const auto& [j, t] : *ahead) best = std::min(best, after[j - 1] + t);
      projected = std::max(projected, best);
    }
    peaks.emplace_back(projected, k);
    std::sort(room.begin(), room.end());
    st.options[k] = room;
  }
  if (peaks.empty()) return {};
  return st.options[smallest_near_best(peaks, 1e-9)];
}

std::vector<std::pair<i64, Task>> place_inter_shares(Placement& st, i64 node,
                                                     const NodeAssignment& na, NodeGpus& gpus) {
  const Problem& pb = st.pb;
  const i64 gpn = st.gpn;
  std::vector<std::pair<i64, Task>> tasks;
  for (const auto& [seq, nodes] : na.inter) {
    auto where = std::find(nodes.begin(), nodes.end(), node);
    if (where == nodes.end()) continue;
    const i64 seqlen = pb.seqlens[seq], ring_size = static_cast<i64>(nodes.size()) * gpn;
    const double per_rank = st.span_time(seqlen, ring_size, INTER);
    const i64 first = (where - nodes.begin()) * gpn;
    for (i64 g = 0; g < gpn; ++g) {
      gpus.loads[g] += per_rank;
      gpus.tokens[g] += zigzag_share(seqlen, ring_size, first + g);
      if (gpus.tokens[g] > pb.capacity) {
        throw CapacityError{"node " + std::to_string(node) + " GPU " + std::to_string(g) +
                            " would hold " + std::to_string(gpus.tokens[g]) +
                            " tokens of inter-node sequences, over the capacity " +
                            std::to_string(pb.capacity) +
                            "; raise capacity_tokens_per_gpu (or capacity_factor)"};
      }
    }
    if (nodes[0] == node) {
      Task task{{}, INTER};
      for (i64 n : nodes) {
        for (i64 g = 0; g < gpn; ++g) task.ring.push_back(n * gpn + g);
      }
      tasks.emplace_back(seq, std::move(task));
    }
  }
  gpus.total = add_up(gpus.loads);
  return tasks;
}

void assign_gpus(Placement& st, i64 node, const NodeAssignment& na, Tasks& tasks,
                 std::vector<i64>& leftovers, NodeGpus& gpus) {
  const Problem& pb = st.pb;
  const i64 gpn = st.gpn, base = node * gpn;
  for (auto& [seq, task] : place_inter_shares(st, node, na, gpus)) tasks[seq] = std::move(task);
  const std::vector<i64>& seqs = na.per_node[node];
  std::vector<double> mine;
  for (i64 seq : seqs) mine.push_back(st.local_time[seq]);
  double remaining = add_up(mine);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const i64 seq = seqs[i], seqlen = pb.seqlens[seq];
    const double seconds = st.local_time[seq];
    const double floor = (gpus.total + remaining) / static_cast<double>(gpn) * (1.0 + st.slack);
    const i64 g = gpus.place_local(seqlen, seconds, pb.capacity, std::max(st.target, floor));
    if (g >= 0) {
      tasks[seq] = Task{{base + g}, LOCAL};
      remaining -= seconds;
      continue;
    }
    const i64 upcoming = i + 1 < seqs.size() ? seqs[i + 1] : -1;
    std::vector<i64> picked = choose_gpus(st, gpus, seq, remaining, upcoming);
    remaining -= seconds;
    if (picked.empty()) {
      leftovers.push_back(seq);
    } else if (picked.size() == 1) {
      gpus.charge(picked, seqlen, seconds);
      tasks[seq] = Task{{base + picked[0]}, LOCAL};
    } else {
      gpus.charge(picked, seqlen, st.span_time(seqlen, static_cast<i64>(picked.size()), INTRA));
      Task task{{}, INTRA};
      for (i64 p : picked) task.ring.push_back(base + p);
      tasks[seq] = std::move(task);
    }
  }
}

void place_leftovers(Placement& st, std::vector<i64> seqs, std::vector<NodeGpus>& nodes,
                     Tasks& tasks) {
  const Problem& pb = st.pb;
  const i64 gpn = st.gpn;
  std::stable_sort(seqs.begin(), seqs.end(),
                   [&](i64 a, i64 b) { return pb.seqlens[a] > pb.seqlens[b]; });
  for (i64 seq : seqs) {
    const i64 seqlen = pb.seqlens[seq];
    const double seconds = st.local_time[seq];
    bool found = false;
    double best_load = 0;
    i64 best_n = 0, best_g = 0;
    for (size_t n = 0; n < nodes.size(); ++n) {
      for (i64 g = 0; g < gpn; ++g) {
        if (nodes[n].tokens[g] + seqlen > pb.capacity) continue;
        const double load = nodes[n].loads[g];
        if (!found || load < best_load) {  // (load, n, g) ascending: the first minimum wins
          found = true;
          best_load = load;
          best_n = static_cast<i64>(n);
          best_g = g;
        }
      }
    }
    if (found) {
      nodes[best_n].charge({best_g}, seqlen, seconds);
      tasks[seq] = Task{{best_n * gpn + best_g}, LOCAL};
      continue;
    }
    bool any = false;
    double peak = 0;
    i64 node = 0;
    std::vector<i64> chosen;
    for (size_t n = 0; n < nodes.size(); ++n) {
      std::vector<i64> picked = choose_gpus(st, nodes[n], seq, 0.0, -1);
      if (picked.empty()) continue;
      double busiest = nodes[n].loads[picked[0]];
      for (i64 g : picked) busiest = std::max(busiest, nodes[n].loads[g]);
      if (!any || busiest < peak) {
        any = true;
        peak = busiest;
        node = static_cast<i64>(n);
        chosen = picked;
      }
    }
    if (!any) {
      throw CapacityError{"sequence " + std::to_string(seq) + " (" + std::to_string(seqlen) +
                          " tokens) fits nowhere: no GPU, and no GPUs of one node, have room for "
                          "it within the capacity " + std::to_string(pb.capacity) +
                          " tokens per GPU; raise capacity_tokens_per_gpu (or capacity_factor)"};
    }
    const int tier = chosen.size() > 1 ? INTRA : LOCAL;
    nodes[node].charge(chosen, seqlen, st.span_time(seqlen, static_cast<i64>(chosen.size()), tier));
    Task task{{}, tier};
    for (i64 g : chosen) task.ring.push_back(node * gpn + g);
    tasks[seq] = std::move(task);
  }
}

}  // namespace

Tasks place_hierarchical(const Problem& pb, bool with_linear) {
  const double per_token = with_linear ? pb.costs.linear_per_token : 0.0;
  std::vector<double> local_time(pb.seqlens.size());
  for (size_t i = 0; i < local_time.size(); ++i) {
    const double s = static_cast<double>(pb.seqlens[i]);
    local_time[i] = pb.costs.compute(s, 1);
    if (with_linear) local_time[i] = local_time[i] + per_token * s;
  }
  const double total = add_up(local_time);
  const double world = static_cast<double>(pb.world());
  Placement st{pb, total / world * (1.0 + pb.slack), pb.slack, total, per_token};
  st.local_time = std::move(local_time);
  st.gpn = pb.gpn;
  st.spans.resize(pb.seqlens.size());
  st.has_spans.assign(pb.seqlens.size(), 0);
  const std::vector<i64>& order = pb.order;
  NodeAssignment na = assign_nodes(st, order);
  Tasks tasks(pb.seqlens.size());
  std::vector<NodeGpus> nodes;
  std::vector<i64> leftovers;
  for (i64 node = 0; node < pb.nodes; ++node) {
    nodes.emplace_back(pb.gpn);
    assign_gpus(st, node, na, tasks, leftovers, nodes.back());
  }
  place_leftovers(st, leftovers, nodes, tasks);
  return tasks;
}

}  // namespace zeppelin_planner
