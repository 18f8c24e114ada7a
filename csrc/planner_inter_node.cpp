// Twin of planner/zeppelin.py's inter-node step (inter_node_step.py): the nodes each sequence
// runs on, heavy sequences spread over several nodes, light ones whole. Names mirror the Python
// functions.
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
namespace placement {

Spans span_times(const Placement& st, i64 seq) {
  const i64 seqlen = st.pb.seqlens[seq];
  Spans spans;
  if (seqlen <= st.pb.capacity) spans.emplace_back(1, st.local_time[seq]);
  for (i64 k = 2; k <= st.gpn; ++k) {
    if (st.fits(seqlen, k)) spans.emplace_back(k, st.span_time(seqlen, k, INTRA));
  }
  return spans;
}

const Spans& cached_spans(Placement& st, i64 seq) {
  if (!st.has_spans[seq]) {
    st.spans[seq] = span_times(st, seq);
    st.has_spans[seq] = 1;
  }
  return st.spans[seq];
}

double best_node_time(Placement& st, i64 seq, std::map<i64, double>& cache) {
  auto it = cache.find(seq);
  if (it != cache.end()) return it->second;
  double best = kInf;
  for (const auto& span : span_times(st, seq)) best = std::min(best, span.second);
  cache[seq] = best;
  return best;
}

i64 smallest_near_best(const std::vector<std::pair<double, i64>>& peaks, double slack) {
  double best = peaks[0].first;
  for (const auto& p : peaks) best = std::min(best, p.first);
  i64 out = -1;
  for (const auto& p : peaks) {
    if (p.first <= best * (1.0 + slack) && (out < 0 || p.second < out)) out = p.second;
  }
  return out;
}

std::vector<i64> span_grid(i64 nodes) {
  std::vector<i64> grid;
  i64 m = 2;
  while (m <= nodes) {
    grid.push_back(m);
    m = m < 16 ? m + 1 : m + std::max<i64>(1, m / 12);
  }
  if (nodes >= 2 && grid.back() != nodes) grid.push_back(nodes);
  return grid;
}

i64 choose_node_span(Placement& st, const std::vector<double>& node_loads, i64 seq,
                     i64 upcoming, std::map<i64, double>& best_times) {
  const Problem& pb = st.pb;
  const i64 gpn = st.gpn, nodes = pb.nodes, world = pb.world();
  const i64 seqlen = pb.seqlens[seq];
  const double seconds = st.local_time[seq];
  const double floor = (st.total_work + st.overhead) / static_cast<double>(world);
  double after = upcoming >= 0 ? best_node_time(st, upcoming, best_times) : 0.0;
  if (after > st.target) after = 0.0;
  std::vector<std::pair<double, i64>> peaks;
  const double one = best_node_time(st, seq, best_times);
  const double g = static_cast<double>(gpn);
  if (one < kInf) {
    const double rest = nodes > 1 ? node_loads[1] : node_loads[0] + seconds;
    const double nxt = std::min(rest, node_loads[0] + seconds) / g + after;
    peaks.emplace_back(std::max({(node_loads[0] + seconds) / g, one, floor, nxt}), 1);
  }
  for (i64 span : span_grid(nodes)) {
    if (!st.fits(seqlen, span * gpn)) continue;
    const double per_rank = st.span_time(seqlen, span * gpn, INTER);
    const double wasted =
        std::max(0.0, per_rank * static_cast<double>(span) * g - seconds) /
        static_cast<double>(world);
    const double rest = span < nodes ? node_loads[span] : kInf;
    const double nxt = std::min(rest, node_loads[0] + per_rank * g) / g + after;
    peaks.emplace_back(std::max({node_loads[span - 1] / g + per_rank, floor + wasted, nxt}), span);
  }
  if (peaks.empty()) {
    throw CapacityError{"a sequence of " + std::to_string(seqlen) +
                        " tokens cannot be placed: no span of ranks keeps every rank within the "
                        "capacity " + std::to_string(pb.capacity) + " tokens"};
  }
  i64 under = -1;
  for (const auto& p : peaks) {
    if (p.first <= st.target && (under < 0 || p.second < under)) under = p.second;
  }
  return under >= 0 ? under : smallest_near_best(peaks, st.slack);
}

// pop_nodes for one node, without building vectors when the least-loaded node has room.
Entry pop_node(MinHeap& heap, const std::vector<i64>& tokens, i64 share, i64 room, i64 seq,
               i64 gpn);

std::vector<Entry> pop_nodes(MinHeap& heap, const std::vector<i64>& tokens, i64 share, i64 room,
                             i64 count, i64 seq, i64 gpn) {
  std::vector<Entry> chosen, skipped;
  while (!heap.empty() && static_cast<i64>(chosen.size()) < count) {
    Entry e = heap.top();
    heap.pop();
    (tokens[e.second] + share <= room ? chosen : skipped).push_back(e);
  }
  for (const Entry& e : skipped) heap.push(e);
  if (static_cast<i64>(chosen.size()) < count) {
    throw CapacityError{"sequence " + std::to_string(seq) + " needs " + std::to_string(count) +
                        " node(s) with room for " + std::to_string(share) + " tokens each, found " +
                        std::to_string(chosen.size()) + " (a node holds " + std::to_string(room) +
                        " tokens at the capacity of " + std::to_string(room / gpn) +
                        " tokens per GPU); raise capacity_tokens_per_gpu (or capacity_factor)"};
  }
  return chosen;
}

Entry pop_node(MinHeap& heap, const std::vector<i64>& tokens, i64 share, i64 room, i64 seq,
               i64 gpn) {
  if (!heap.empty() && tokens[heap.top().second] + share <= room) {
    const Entry e = heap.top();
    heap.pop();
    return e;
  }
  return pop_nodes(heap, tokens, share, room, 1, seq, gpn)[0];
}

// Node loads and tokens while light sequences are added (inter_node_step._LightNodes). The Python
// reference keeps a heap of (tokens, node) with stale entries it drops; the nodes it visits
// are the current (tokens, node) pairs in ascending order, which this ordered set holds.
struct LightNodes {
  static constexpr size_t kScan = 16;
  std::vector<double> att;
  std::vector<i64>& tokens;
  i64 room;
  double per_token, att_max, tok_max;
  std::set<std::pair<i64, i64>> order;

  LightNodes(std::vector<double> a, std::vector<i64>& t, i64 r, double pt)
      : att(std::move(a)), tokens(t), room(r), per_token(pt) {
    att_max = *std::max_element(att.begin(), att.end());
    tok_max = static_cast<double>(*std::max_element(tokens.begin(), tokens.end()));
    for (size_t n = 0; n < tokens.size(); ++n) order.emplace(tokens[n], static_cast<i64>(n));
  }

  i64 easy(double seconds, i64 seqlen) const {
    size_t skipped = 0;
    for (auto it = order.begin(); it != order.end() && skipped < kScan; ++it) {
      const auto [count, n] = *it;
      if (count + seqlen <= room && att[n] + seconds <= att_max) {
        return static_cast<double>(count + seqlen) <= tok_max ? n : -1;
      }
      ++skipped;
    }
    return -1;
  }

  i64 best(double seconds, i64 seqlen) const {
    i64 node = -1;
    double best_step = kInf;
    const double len = static_cast<double>(seqlen), cap = static_cast<double>(room);
    for (size_t n = 0; n < att.size(); ++n) {
      const double tok = static_cast<double>(tokens[n]);
      if (tok + len > cap) continue;  // inf: never below a finite step
      const double step =
          std::max(att_max, att[n] + seconds) + std::max(tok_max, tok + len) * per_token +
          tok * 1e-15;
      if (node < 0 || step < best_step) {
        node = static_cast<i64>(n);
        best_step = step;
      }
    }
    return node;
  }

  i64 place(double seconds, i64 seqlen) {
    i64 node = easy(seconds, seqlen);
    if (node < 0) {
      node = best(seconds, seqlen);
      if (node < 0) return -1;
    }
    order.erase({tokens[node], node});
    att[node] += seconds;
    tokens[node] += seqlen;
    att_max = std::max(att_max, att[node]);
    tok_max = std::max(tok_max, static_cast<double>(tokens[node]));
    order.emplace(tokens[node], node);
    return node;
  }
};

void place_heavy(Placement& st, const std::vector<i64>& order, size_t split, MinHeap& heap,
                 std::vector<i64>& tokens, NodeAssignment& out) {
  const Problem& pb = st.pb;
  const i64 room = st.gpn * pb.capacity;
  std::map<i64, double> best_times;
  for (size_t position = 0; position < split; ++position) {
    const i64 seq = order[position], seqlen = pb.seqlens[seq];
    const double seconds = st.local_time[seq];
    if (seconds <= st.target && seqlen <= pb.capacity) {
      Entry top = heap.top();
      i64 node = top.second;
      if (tokens[node] + seqlen <= room) {
        heap.pop();
        heap.emplace(top.first + seconds, node);
      } else {
        Entry e = pop_node(heap, tokens, seqlen, room, seq, st.gpn);
        node = e.second;
        heap.emplace(e.first + seconds, node);
      }
      out.per_node[node].push_back(seq);
      tokens[node] += seqlen;
      continue;
    }
    const i64 upcoming = position + 1 < order.size() ? order[position + 1] : -1;
    std::vector<double> loads;
    {
      MinHeap copy = heap;
      while (!copy.empty()) {
        loads.push_back(copy.top().first);
        copy.pop();
      }
    }
    const i64 span = choose_node_span(st, loads, seq, upcoming, best_times);
    const i64 share = (seqlen + span - 1) / span;
    std::vector<Entry> chosen = pop_nodes(heap, tokens, share, room, span, seq, st.gpn);
    double work;
    if (span == 1) {
      out.per_node[chosen[0].second].push_back(seq);
      work = seconds;
    } else {
      std::vector<i64> nodes;
      for (const Entry& e : chosen) nodes.push_back(e.second);
      std::sort(nodes.begin(), nodes.end());
      out.inter.emplace_back(seq, nodes);
      work = st.span_time(seqlen, span * st.gpn, INTER) * static_cast<double>(st.gpn);
      st.overhead += std::max(0.0, work * static_cast<double>(span) - seconds);
    }
    for (const Entry& e : chosen) {
      tokens[e.second] += share;
      heap.emplace(e.first + work, e.second);
    }
  }
}

void place_light(Placement& st, const std::vector<i64>& order, size_t split, MinHeap& heap,
                 std::vector<i64>& tokens, NodeAssignment& out) {
  const Problem& pb = st.pb;
  if (st.per_token != 0.0) {  // pop_node on every light sequence, as a tree over the nodes
    const i64 room = st.gpn * pb.capacity;
    RoomTree nodes(pb.nodes);
    std::vector<double> load(pb.nodes);
    while (!heap.empty()) {
      load[heap.top().second] = heap.top().first;
      heap.pop();
    }
    for (i64 n = 0; n < pb.nodes; ++n) nodes.set(n, load[n], tokens[n]);
    for (size_t i = split; i < order.size(); ++i) {
      const i64 seq = order[i], seqlen = pb.seqlens[seq];
      const i64 node = nodes.least_with_room(room - seqlen);
      if (node < 0) pop_nodes(heap, tokens, seqlen, room, 1, seq, st.gpn);  // raises, as Python
      load[node] += st.local_time[seq];
      tokens[node] += seqlen;
      nodes.set(node, load[node], tokens[node]);
      out.per_node[node].push_back(seq);
    }
    return;
  }
  std::vector<double> att(pb.nodes, 0.0);
  MinHeap copy = heap;
  while (!copy.empty()) {
    att[copy.top().second] = copy.top().first;
    copy.pop();
  }
  LightNodes light(att, tokens, st.gpn * pb.capacity, pb.costs.linear_per_token);
  for (size_t i = split; i < order.size(); ++i) {
    const i64 seq = order[i];
    const i64 node = light.place(st.local_time[seq], pb.seqlens[seq]);
    if (node < 0) {
      const std::string len = std::to_string(pb.seqlens[seq]);
      throw CapacityError{"sequence " + std::to_string(seq) + " (" + len +
                          " tokens) fits on no node: every node is within " + len +
                          " tokens of its " + std::to_string(light.room) + " (capacity " +
                          std::to_string(pb.capacity) + " tokens per GPU)"};
    }
    out.per_node[node].push_back(seq);
  }
}

NodeAssignment assign_nodes(Placement& st, const std::vector<i64>& order) {
  const Problem& pb = st.pb;
  MinHeap heap;
  for (i64 n = 0; n < pb.nodes; ++n) heap.emplace(0.0, n);
  std::vector<i64> tokens(pb.nodes, 0);
  NodeAssignment out;
  out.per_node.resize(pb.nodes);
  i64 total_tokens = 0;
  for (i64 s : pb.seqlens) total_tokens += s;
  const double density = st.total_work / static_cast<double>(total_tokens);
  size_t split = order.size();
  for (size_t i = 0; i < order.size(); ++i) {
    const i64 seq = order[i];
    if (st.local_time[seq] <= density * static_cast<double>(pb.seqlens[seq]) &&
        st.local_time[seq] <= st.target && pb.seqlens[seq] <= pb.capacity) {
      split = i;
      break;
    }
  }
  place_heavy(st, order, split, heap, tokens, out);
  place_light(st, order, split, heap, tokens, out);
  return out;
}

}  // namespace placement
}  // namespace zeppelin_planner
