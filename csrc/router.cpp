// C++17 twin of megatron_zeppelin/router/reference.py (read that module's docstring for the
// algorithm; the cost model is router_model.h, the twin of model.py). Every function mirrors the
// Python function of the same name; all arithmetic is on 64-bit integers, so both produce the
// same schedule bit for bit.
#include "router.h"

#include "router_model.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace zeppelin_router {
namespace {

using model::kMaxChunksLimit;
using model::Loads;
using model::Part;
using model::RoutePlan;
using model::Problem;
using model::apply_plan;
using model::score_plan;

constexpr int kMaxSweeps = 3;
constexpr int kHysteresisShift = 6;  // later sweeps: a plan must win by > 1/64 of its score

// A rail of a flow: NIC level (ticks), NVLink legs, NIC k, src proxy p, dst proxy q.
struct Rail {
  i64 level;
  i64 legs;
  i64 k, p, q;
  bool operator<(const Rail& o) const {
    if (level != o.level) return level < o.level;
    if (legs != o.legs) return legs < o.legs;
    return k < o.k;
  }
};

RoutePlan make_direct_plan(const Problem& pb, i64 f) {
  const i64 s = pb.src[f], d = pb.dst[f];
  return {Part{pb.nic[s - pb.xg[f]], pb.nic[d - pb.yg[f]], s, d, pb.nbytes[f]}};
}

void pick_rail_proxies(const Problem& pb, const Loads& loads, i64 f, i64 k, i64* p, i64* q) {
  const i64 d = pb.dst[f], xg = pb.xg[f], yg = pb.yg[f];
  const i64 ls = pb.src[f] - xg, ld = d - yg;
  i64 local;
  if (pb.nic[ls] == k) {
    local = ls;
  } else if (pb.nic[ld] == k) {
    local = ld;
  } else {
    local = -1;
    i64 best = 0;
    for (i64 l : pb.gpus_of_nic[k]) {  // ascending: the first minimum wins, as in Python
      const i64 v = loads.d_in[xg + l] + loads.c_out[yg + l];
      if (local < 0 || v < best) {
        local = l;
        best = v;
      }
    }
  }
  *p = xg + local;
  *q = pb.nic[ld] == k ? d : yg + local;
}

void list_rails(const Problem& pb, const Loads& loads, i64 f, std::vector<Rail>* rails) {
  const i64 s = pb.src[f], d = pb.dst[f], xo = pb.xo[f], yo = pb.yo[f];
  rails->clear();
  for (i64 k : pb.usable) {
    Rail r{};
    pick_rail_proxies(pb, loads, f, k, &r.p, &r.q);
    r.k = k;
    r.level = std::max(loads.n_out[xo + k], loads.n_in[yo + k]);
    r.legs = (r.p != s) + (r.q != d);
    // insertion sort (at most nics_per_node rails): shift the larger rails up by one
    size_t j = rails->size();
    rails->push_back(r);
    for (; j > 0 && r < (*rails)[j - 1]; --j) (*rails)[j] = (*rails)[j - 1];
    (*rails)[j] = r;
  }
}

// Units per rail over the first m rails (ascending levels); false unless every rail gets some.
bool water_fill(const Problem& pb, const std::vector<Rail>& rails, i64 m, i64 units,
                std::vector<i64>* x, std::vector<i64>* base_buf) {
  const i64 r = pb.cn * pb.align;
  const i64 total = units * r;
  std::vector<i64>& base = *base_buf;
  base.resize(m);
  for (i64 j = 0; j < m; ++j) base[j] = rails[j].level + pb.cs * pb.ln;
  i64 used = 1, acc = base[0];
  while (used < m && base[used] * used < total + acc) {
    acc += base[used];
    ++used;
  }
  if (used < m) return false;
  x->assign(m, 0);
  i64 sum = 0;
  for (i64 j = 0; j < m; ++j) {  // equal levels (common: idle NICs) share one division
    (*x)[j] = j > 0 && base[j] == base[j - 1] ? (*x)[j - 1] : (total + acc - m * base[j]) / (m * r);
    sum += (*x)[j];
  }
  for (i64 left = units - sum; left > 0; --left) {
    i64 best = 0;
    for (i64 j = 1; j < m; ++j) {
      if (base[j] + ((*x)[j] + 1) * r < base[best] + ((*x)[best] + 1) * r) best = j;
    }
    ++(*x)[best];
  }
  return *std::min_element(x->begin(), x->end()) > 0;
}

// Re-plans flow f against loads that exclude it; returns true when the plan changed.
class Replanner {
 public:
  explicit Replanner(const Problem& pb) : pb_(pb) {}

  bool replan(const Loads& loads, i64 f, RoutePlan* plan, bool hysteresis) {
    best_score_ = score_plan(pb_, loads, f, *plan);
    if (hysteresis) best_score_ -= best_score_ >> kHysteresisShift;
    replaced_ = false;
    const i64 s = pb_.src[f], d = pb_.dst[f];
    cand_.assign(1, Part{pb_.nic[s - pb_.xg[f]], pb_.nic[d - pb_.yg[f]], s, d, pb_.nbytes[f]});
    offer(loads, f);  // the direct plan
    offer_singles(loads, f);
    offer_splits(loads, f);
    if (replaced_) {
      std::sort(best_.begin(), best_.end());
      *plan = best_;
    }
    return replaced_;
  }

 private:
  // Scores cand_ and keeps it as best_ when strictly better (parts are sorted on acceptance).
  void offer(const Loads& loads, i64 f) {
    const i64 score = score_plan(pb_, loads, f, cand_);
    if (score < best_score_) {
      best_ = cand_;
      best_score_ = score;
      replaced_ = true;
    }
  }

  void offer_singles(const Loads& loads, i64 f) {
    list_rails(pb_, loads, f, &rails_);
    const i64 nic_s = pb_.nic[pb_.src[f] - pb_.xg[f]], nic_d = pb_.nic[pb_.dst[f] - pb_.yg[f]];
    const i64 keys[3] = {nic_s, nic_d, rails_[0].k};
    for (int j = 0; j < 3; ++j) {
      const i64 k = keys[j];
      if ((j > 0 && keys[0] == k) || (j > 1 && keys[1] == k)) continue;  // offered already
      if (nic_s == k && nic_d == k) continue;  // that rail is the direct plan
      const Rail& rail = *std::find_if(rails_.begin(), rails_.end(),
                                       [k](const Rail& r) { return r.k == k; });
      cand_.assign(1, Part{k, k, rail.p, rail.q, pb_.nbytes[f]});
      offer(loads, f);
    }
  }

  void offer_splits(const Loads& loads, i64 f) {
    const i64 units = pb_.nbytes[f] / pb_.align;
    const i64 n = static_cast<i64>(rails_.size());
    for (i64 m = 2; m <= n; ++m) {
      if (!water_fill(pb_, rails_, m, units, &units_, &base_)) break;
      cand_.clear();
      for (i64 j = 0; j < m; ++j) {
        const Rail& r = rails_[j];
        cand_.push_back(Part{r.k, r.k, r.p, r.q, units_[j] * pb_.align});
      }
      offer(loads, f);
    }
  }

  const Problem& pb_;
  RoutePlan best_, cand_;
  i64 best_score_ = 0;
  bool replaced_ = false;
  std::vector<Rail> rails_;
  std::vector<i64> units_, base_;
};

// Re-plans flows in a fixed order, skipping a flow when nothing changed on its two nodes
// since its last re-plan (the re-plan would keep its plan: exact, only faster).
class Sweeper {
 public:
  explicit Sweeper(const Problem& pb)
      : pb_(pb), replanner_(pb), version_(pb.nodes, 0), stamp_x_(pb.src.size(), -1),
        stamp_y_(pb.src.size(), -1) {
    const i64 n = static_cast<i64>(pb.src.size());
    order_.resize(n);
    for (i64 f = 0; f < n; ++f) order_[f] = f;
    std::sort(order_.begin(), order_.end(), [&pb](i64 a, i64 b) {
      return pb.nbytes[a] != pb.nbytes[b] ? pb.nbytes[a] > pb.nbytes[b] : a < b;
    });
  }

  bool sweep(Loads& loads, std::vector<RoutePlan>& plans, bool hysteresis) {
    bool changed = false;
    for (i64 f : order_) {
      const i64 x = pb_.x[f], y = pb_.y[f];
      if (stamp_x_[f] == version_[x] && stamp_y_[f] == version_[y]) continue;
      apply_plan(pb_, loads, f, plans[f], -1);
      const bool replaced = replanner_.replan(loads, f, &plans[f], hysteresis);
      apply_plan(pb_, loads, f, plans[f], +1);
      if (replaced) {
        changed = true;
        ++version_[x];
        ++version_[y];
      }
      stamp_x_[f] = version_[x];
      stamp_y_[f] = version_[y];
    }
    return changed;
  }

 private:
  const Problem& pb_;
  Replanner replanner_;
  std::vector<i64> order_, version_, stamp_x_, stamp_y_;
};

i64 largest_part(const std::vector<RoutePlan>& plans) {
  i64 largest = 0;
  for (const RoutePlan& plan : plans) {
    for (const Part& part : plan) largest = std::max(largest, part.nb);
  }
  return largest;
}

std::vector<RoutePlan> search_plans(const Problem& pb, Loads& loads, i64* direct_ticks) {
  const i64 n = static_cast<i64>(pb.src.size());
  std::vector<RoutePlan> plans(n);
  for (i64 f = 0; f < n; ++f) {
    plans[f] = make_direct_plan(pb, f);
    apply_plan(pb, loads, f, plans[f], +1);
  }
  *direct_ticks = model::step_ticks(pb, loads, 1);
  std::vector<RoutePlan> best = plans;
  i64 best_ticks = *direct_ticks;
  Sweeper sweeper(pb);
  for (int it = 0; it < kMaxSweeps; ++it) {
    if (!sweeper.sweep(loads, plans, it > 0)) break;
    const i64 ticks = model::best_chunks(pb, loads, largest_part(plans)).second;
    if (ticks < best_ticks) {
      best = plans;
      best_ticks = ticks;
    }
  }
  return best;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("_router_cpp.route_raw: " + what);
}

// Mirrors schedule.check_tick_range: every resource time scaled by up to max_chunks chunks
// must stay below 2^53 ticks, so that no intermediate product overflows (the Python side
// checks first; this is a backstop).
void check_tick_range(i64 nodes, i64 g, i64 k, const std::vector<i64>& gpu_to_nic,
                      const std::vector<i64>& costs, const std::vector<i64>& src,
                      const std::vector<i64>& dst, const std::vector<i64>& nbytes,
                      i64 max_chunks) {
  constexpr i64 kMaxTicks = i64{1} << 53;
  std::vector<i64> per_node(nodes, 0);
  for (size_t f = 0; f < src.size(); ++f) {
    require(nbytes[f] < kMaxTicks, "flow " + std::to_string(f) + ": nbytes too large");
    per_node[src[f] / g] = std::min(kMaxTicks, per_node[src[f] / g] + nbytes[f]);
    per_node[dst[f] / g] = std::min(kMaxTicks, per_node[dst[f] / g] + nbytes[f]);
  }
  std::vector<bool> used(k, false);
  for (i64 nic : gpu_to_nic) used[nic] = true;
  const i64 messages = static_cast<i64>(src.size()) *
                       (std::count(used.begin(), used.end(), true) + 1) * max_chunks;
  const i64 cost = std::max(costs[0], costs[2]), latency = std::max(costs[1], costs[3]);
  const i64 busiest = *std::max_element(per_node.begin(), per_node.end());
  const bool fits = busiest <= kMaxTicks / cost &&
                    (latency == 0 || messages <= (kMaxTicks - busiest * cost) / latency) &&
                    busiest * cost + messages * latency < kMaxTicks;
  require(fits, "flows exceed the router's range of 2^53 ticks per resource");
}

void check_inputs(i64 nodes, i64 g, i64 k, const std::vector<i64>& gpu_to_nic,
                  const std::vector<i64>& costs, const std::vector<i64>& src,
                  const std::vector<i64>& dst, const std::vector<i64>& nbytes, i64 align,
                  i64 max_chunks, i64 min_chunk_bytes) {
  require(nodes >= 1 && g >= 1 && k >= 1, "nodes, gpus_per_node, nics_per_node must be >= 1");
  require(static_cast<i64>(gpu_to_nic.size()) == g, "gpu_to_nic needs gpus_per_node entries");
  for (i64 nic : gpu_to_nic) require(nic >= 0 && nic < k, "gpu_to_nic entry out of range");
  require(costs.size() == 4, "costs needs 4 entries");
  for (i64 c : costs) require(c >= 0, "costs must be >= 0");
  require(costs[0] >= 1 && costs[2] >= 1, "per-byte costs must be >= 1 tick");
  require(align >= 1, "align must be >= 1");
  require(max_chunks >= 1 && max_chunks <= kMaxChunksLimit,
          "max_chunks must be in [1, " + std::to_string(kMaxChunksLimit) + "]");
  require(min_chunk_bytes >= 1, "min_chunk_bytes must be >= 1");
  require(src.size() == dst.size() && src.size() == nbytes.size(),
          "src, dst and nbytes need the same length");
  for (size_t f = 0; f < src.size(); ++f) {
    const std::string name = "flow " + std::to_string(f) + ": ";
    require(src[f] >= 0 && src[f] < nodes * g && dst[f] >= 0 && dst[f] < nodes * g,
            name + "rank out of range");
    require(src[f] / g != dst[f] / g, name + "src and dst on the same node");
    require(nbytes[f] > 0 && nbytes[f] % align == 0, name + "nbytes not a positive multiple "
            "of align");
  }
  check_tick_range(nodes, g, k, gpu_to_nic, costs, src, dst, nbytes, max_chunks);
}

Problem make_problem(i64 nodes, i64 g, i64 k, const std::vector<i64>& gpu_to_nic,
                     const std::vector<i64>& costs, const std::vector<i64>& src,
                     const std::vector<i64>& dst, const std::vector<i64>& nbytes, i64 align,
                     i64 max_chunks, i64 min_chunk_bytes) {
  Problem pb{nodes, g, k, gpu_to_nic, {}, {}, costs[0], costs[1], costs[2], costs[3], src, dst,
             nbytes, align, max_chunks, min_chunk_bytes, 1, {}, {}, {}, {}, {}, {}};
  pb.gpus_of_nic.resize(k);
  for (i64 l = 0; l < g; ++l) pb.gpus_of_nic[gpu_to_nic[l]].push_back(l);
  for (i64 nic = 0; nic < k; ++nic) {
    if (!pb.gpus_of_nic[nic].empty()) pb.usable.push_back(nic);
  }
  const i64 largest = nbytes.empty() ? 0 : *std::max_element(nbytes.begin(), nbytes.end());
  pb.cs = model::chunk_cap(largest / static_cast<i64>(pb.usable.size()), max_chunks,
                           min_chunk_bytes);
  for (size_t f = 0; f < src.size(); ++f) {
    pb.x.push_back(src[f] / g);
    pb.y.push_back(dst[f] / g);
    pb.xg.push_back(pb.x[f] * g);
    pb.yg.push_back(pb.y[f] * g);
    pb.xo.push_back(pb.x[f] * k);
    pb.yo.push_back(pb.y[f] * k);
  }
  return pb;
}

}  // namespace

RawResult route_raw(i64 nodes, i64 gpus_per_node, i64 nics_per_node,
                    const std::vector<i64>& gpu_to_nic, const std::vector<i64>& costs,
                    const std::vector<i64>& src, const std::vector<i64>& dst,
                    const std::vector<i64>& nbytes, i64 align, i64 max_chunks,
                    i64 min_chunk_bytes) {
  check_inputs(nodes, gpus_per_node, nics_per_node, gpu_to_nic, costs, src, dst, nbytes, align,
               max_chunks, min_chunk_bytes);
  const Problem pb = make_problem(nodes, gpus_per_node, nics_per_node, gpu_to_nic, costs, src,
                                  dst, nbytes, align, max_chunks, min_chunk_bytes);
  RawResult out;
  Loads search(nodes, gpus_per_node, nics_per_node, pb.cs);
  const std::vector<RoutePlan> plans = search_plans(pb, search, &out.direct_ticks);
  Loads loads(nodes, gpus_per_node, nics_per_node, 1);
  for (size_t f = 0; f < plans.size(); ++f) {
    apply_plan(pb, loads, static_cast<i64>(f), plans[f], +1);
    i64 offset = 0;
    for (const Part& part : plans[f]) {
      out.flat.insert(out.flat.end(), {static_cast<i64>(f), part.p, part.q, offset, part.nb});
      offset += part.nb;
    }
  }
  out.phases = model::phase_ticks(pb, loads);
  const std::pair<i64, i64> best = model::best_chunks(pb, loads, largest_part(plans));
  out.chunks = best.first;
  out.ticks = best.second;
  out.nic_out = std::move(loads.b_out);
  out.nic_in = std::move(loads.b_in);
  return out;
}

}  // namespace zeppelin_router
