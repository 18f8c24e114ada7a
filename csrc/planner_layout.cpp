// Twin of plan.ring_groups_of / attention_layout_of and planner/linear_layout.py (the remap's
// linear layout: node token targets by bisection, then surplus to deficit inside nodes first).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <map>

#include "planner.h"

namespace zeppelin_planner {
namespace {

struct Group {
  int tier;
  i64 first;  // the group's first task (sequence)
  std::vector<i64> ring;
  std::vector<i64> seqs;
};

// plan.ring_groups_of: tasks sharing a ring fuse, ordered by (tier, first task) (one wave).
std::vector<Group> ring_groups(const Problem& pb, const Tasks& tasks) {
  std::map<std::vector<i64>, size_t> index;
  std::vector<Group> groups;
  for (size_t seq = 0; seq < tasks.size(); ++seq) {
    auto [it, fresh] = index.emplace(tasks[seq].ring, groups.size());
    if (fresh) groups.push_back(Group{tier_of(pb, tasks[seq].ring), static_cast<i64>(seq),
                                      tasks[seq].ring, {}});
    groups[it->second].seqs.push_back(static_cast<i64>(seq));
  }
  std::sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
    return a.tier != b.tier ? a.tier < b.tier : a.first < b.first;
  });
  return groups;
}

struct Interval {
  std::vector<double> lo, hi;
  bool ok;
};

// linear_layout._intervals
Interval intervals(const std::vector<double>& tokens, double r, double c, double budget) {
  const size_t n = tokens.size();
  Interval out{std::vector<double>(n, 0.0), std::vector<double>(n), true};
  for (size_t i = 0; i < n; ++i) {
    const double right = (budget + tokens[i] * c) / (r + c);
    if (r > c) {
      const double left = (budget - tokens[i] * c) / (r - c);
      out.hi[i] = right >= tokens[i] ? right : left;
      if (!(out.hi[i] >= 0)) out.ok = false;
    } else {
      out.hi[i] = right;
      if (!(right >= tokens[i])) out.ok = false;
      if (c > r) out.lo[i] = std::max(0.0, (tokens[i] * c - budget) / (c - r));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!(out.lo[i] <= out.hi[i])) out.ok = false;
  }
  return out;
}

// linear_layout._closest_within
std::vector<i64> closest_within(const Interval& spans, const std::vector<i64>& node_tokens,
                                i64 total) {
  const size_t n = node_tokens.size();
  std::vector<double> values(n);
  for (size_t i = 0; i < n; ++i) {
    values[i] = std::min(std::max(static_cast<double>(node_tokens[i]), spans.lo[i]), spans.hi[i]);
  }
  double left = static_cast<double>(total) - add_up(values);
  for (size_t i = 0; i < n; ++i) {
    double step;
    if (left > 0) {
      step = std::min(spans.hi[i] - values[i], left);
    } else if (left < 0) {
      step = std::max(spans.lo[i] - values[i], left);
    } else {
      break;
    }
    values[i] += step;
    left -= step;
  }
  std::vector<i64> ints(n);
  i64 sum = 0;
  for (size_t i = 0; i < n; ++i) {
    ints[i] = static_cast<i64>(std::nearbyint(values[i]));  // round half to even, as Python
    sum += ints[i];
  }
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return static_cast<double>(ints[a]) - values[a] < static_cast<double>(ints[b]) - values[b];
  });
  const i64 rest = total - sum;
  for (i64 j = 0; j < std::llabs(rest); ++j) ints[order[j % n]] += rest > 0 ? 1 : -1;
  return ints;
}

// linear_layout.node_token_targets
std::vector<i64> node_token_targets(const std::vector<i64>& node_tokens, double r, double c) {
  i64 total = 0;
  for (i64 t : node_tokens) total += t;
  const size_t n = node_tokens.size();
  if (n == 1 || total == 0) return node_tokens;
  std::vector<double> tokens(node_tokens.begin(), node_tokens.end());
  double lo_t = static_cast<double>(total) / static_cast<double>(n) * r;
  double hi_t = static_cast<double>(*std::max_element(node_tokens.begin(), node_tokens.end())) * r;
  for (int it = 0; it < 50; ++it) {
    const double mid = (lo_t + hi_t) / 2;
    Interval iv = intervals(tokens, r, c, mid);
    const double t = static_cast<double>(total);
    if (iv.ok && add_up(iv.lo) <= t && t <= add_up(iv.hi)) {
      hi_t = mid;
    } else {
      lo_t = mid;
    }
  }
  return closest_within(intervals(tokens, r, c, hi_t), node_tokens, total);
}

// linear_layout.rank_targets with the remap's costs
std::vector<i64> rank_targets(const Problem& pb, const std::vector<i64>& per_rank) {
  const i64 world = pb.world(), gpn = pb.gpn;
  std::vector<i64> targets;
  if (pb.remap_c <= 0) {
    i64 total = 0;
    for (i64 t : per_rank) total += t;
    for (i64 rank = 0; rank < world; ++rank)
      targets.push_back(total / world + (rank < total % world));
    return targets;
  }
  std::vector<i64> nodes(pb.nodes, 0);
  for (i64 rank = 0; rank < world; ++rank) nodes[rank / gpn] += per_rank[rank];
  const double per_node_rate = pb.linear_r / static_cast<double>(gpn);
  for (i64 node_total : node_token_targets(nodes, per_node_rate, pb.remap_c)) {
    for (i64 i = 0; i < gpn; ++i) targets.push_back(node_total / gpn + (i < node_total % gpn));
  }
  return targets;
}

void split_at(const std::vector<Seg>& segments, i64 budget, std::vector<Seg>& keep,
              std::deque<Seg>& rest) {
  for (const Seg& seg : segments) {
    const i64 length = seg.end - seg.start;
    if (budget >= length) {
      keep.push_back(seg);
      budget -= length;
    } else if (budget > 0) {
      keep.push_back(Seg{seg.seq, seg.start, seg.start + budget});
      rest.push_back(Seg{seg.seq, seg.start + budget, seg.end});
      budget = 0;
    } else {
      rest.push_back(seg);
    }
  }
}

void match(const std::vector<i64>& sources, const std::vector<i64>& all_sinks,
           std::vector<std::deque<Seg>>& surplus, std::vector<i64>& deficit, Layout& kept,
           std::vector<Move>& moves) {
  std::vector<i64> sinks;
  for (i64 r : all_sinks) {
    if (deficit[r] > 0) sinks.push_back(r);
  }
  if (sinks.empty()) return;
  size_t k = 0;
  for (i64 src : sources) {
    std::deque<Seg>& queue = surplus[src];
    while (!queue.empty() && k < sinks.size()) {
      const i64 dst = sinks[k];
      const Seg seg = queue.front();
      queue.pop_front();
      const i64 take = std::min(seg.end - seg.start, deficit[dst]);
      kept[dst].push_back(Seg{seg.seq, seg.start, seg.start + take});
      moves.push_back(Move{dst, src, take});
      if (take < seg.end - seg.start) queue.push_front(Seg{seg.seq, seg.start + take, seg.end});
      deficit[dst] -= take;
      if (deficit[dst] == 0) ++k;
    }
  }
}

}  // namespace

Layout attention_layout(const Problem& pb, const Tasks& tasks) {
  Layout out(pb.world());
  for (const Group& group : ring_groups(pb, tasks)) {
    const std::vector<i64>& ring = group.ring;
    const i64 size = static_cast<i64>(ring.size());
    if (size == 1) {
      for (i64 seq : group.seqs) out[ring[0]].push_back(Seg{seq, 0, pb.seqlens[seq]});
      continue;
    }
    const i64 n = 2 * size;
    for (i64 pos = 0; pos < size; ++pos) {
      const i64 mirror = n - 1 - pos;
      for (i64 seq : group.seqs) {
        const i64 length = pb.seqlens[seq];
        out[ring[pos]].push_back(Seg{seq, pos * length / n, (pos + 1) * length / n});
        out[ring[pos]].push_back(Seg{seq, mirror * length / n, (mirror + 1) * length / n});
      }
    }
  }
  return out;
}

std::pair<Layout, std::vector<Move>> remap_layout(const Problem& pb, const Tasks& tasks) {
  const Layout attention = attention_layout(pb, tasks);
  const i64 world = pb.world();
  std::vector<i64> per_rank(world, 0);
  for (i64 r = 0; r < world; ++r) {
    for (const Seg& s : attention[r]) per_rank[r] += s.end - s.start;
  }
  const std::vector<i64> targets = rank_targets(pb, per_rank);
  Layout kept(world);
  std::vector<std::deque<Seg>> surplus(world);
  std::vector<i64> deficit(world);
  for (i64 r = 0; r < world; ++r) {
    if (per_rank[r] <= targets[r]) {
      kept[r] = attention[r];
    } else {
      split_at(attention[r], targets[r], kept[r], surplus[r]);
    }
    deficit[r] = std::max<i64>(0, targets[r] - per_rank[r]);
  }
  std::vector<Move> moves;
  for (i64 node = 0; node < pb.nodes; ++node) {
    std::vector<i64> ranks;
    for (i64 g = 0; g < pb.gpn; ++g) ranks.push_back(node * pb.gpn + g);
    match(ranks, ranks, surplus, deficit, kept, moves);
  }
  std::vector<i64> all(world);
  for (i64 r = 0; r < world; ++r) all[r] = r;
  match(all, all, surplus, deficit, kept, moves);
  return {std::move(kept), std::move(moves)};
}

}  // namespace zeppelin_planner
