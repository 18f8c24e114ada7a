// Twin of estimate.estimate_tasks (one wave: the portfolio's candidates) and of the portfolio's
// candidates and choice (portfolio.py).
#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <map>
#include <set>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "planner.h"

namespace zeppelin_planner {
namespace {

struct RingHash {
  size_t operator()(const std::vector<i64>& ring) const {
    size_t h = ring.size();
    for (i64 r : ring) h = h * 1000003u ^ static_cast<size_t>(r);
    return h;
  }
};

struct RingGroup {
  const std::vector<i64>* members;
  double compute = 0.0, share = 0.0;
  int tier = LOCAL;
  double dense = 0.0;  // the dense layers' compute, where a sliding window is set
  RingWindow window;   // the windowed layers' steps and rows
};

// estimate._pace
std::vector<double> pace(std::vector<double> att, const std::vector<RingGroup>& groups,
                         const std::vector<double>& per_round) {
  if (groups.empty()) return att;
  std::map<i64, std::vector<size_t>> rings_of;
  for (size_t index = 0; index < groups.size(); ++index) {
    for (i64 r : *groups[index].members) rings_of[r].push_back(index);
  }
  std::map<std::pair<i64, i64>, double> work;
  auto rounds = [&](i64 rank, i64 size, bool after) {
    double total = 0.0;
    for (size_t h : rings_of[rank]) {
      const i64 g = static_cast<i64>(groups[h].members->size());
      total += per_round[h] * static_cast<double>(after ? std::max<i64>(0, g - size)
                                                        : std::min(g, size));
    }
    return total;
  };
  for (size_t index = 0; index < groups.size(); ++index) {
    const std::vector<i64>& members = *groups[index].members;
    const i64 size = static_cast<i64>(members.size());
    double peak = 0.0;
    for (i64 m : members) {
      auto it = work.find({m, size});
      if (it == work.end())
        it = work.emplace(std::make_pair(m, size), rounds(m, size, false)).first;
      peak = std::max(peak, it->second);
    }
    for (i64 r : members) att[r] = std::max(att[r], peak + rounds(r, size, true));
  }
  return att;
}

// estimate.shared_peak: the ranks' work under fair sharing of shared_by ranks per device;
// over the work sorted ascending, increment i runs at max(1 / shared_by, (n - i) / n) of its
// timed seconds (same operations in the same order as the Python).
double shared_peak(const std::vector<double>& seconds, double shared_by) {
  const double peak = *std::max_element(seconds.begin(), seconds.end());
  if (shared_by == 1.0) return peak;
  std::vector<double> sorted(seconds);
  std::sort(sorted.begin(), sorted.end());
  const double n = static_cast<double>(sorted.size()), alone = 1.0 / shared_by;
  double total = 0.0, previous = 0.0;
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    total += (sorted[i] - previous) * std::max(alone, (n - static_cast<double>(i)) / n);
    previous = sorted[i];
  }
  return total;
}

// estimate.remap_a2a_seconds
double remap_a2a_seconds(const Problem& pb, const std::vector<Move>& moves) {
  std::map<i64, i64> nv_out, nv_in;
  std::map<std::pair<i64, i64>, i64> nic_out, nic_in;
  const i64 gpn = pb.gpn;
  for (const Move& m : moves) {
    if (m.src / gpn == m.dst / gpn) {
      nv_out[m.src] += m.tokens;
      nv_in[m.dst] += m.tokens;
      continue;
    }
    for (i64 i = 0; i < pb.tp; ++i) {
      nic_out[{m.src / gpn, pb.gpu_to_nic[(m.src % gpn) * pb.tp + i]}] += m.tokens;
      nic_in[{m.dst / gpn, pb.gpu_to_nic[(m.dst % gpn) * pb.tp + i]}] += m.tokens;
    }
  }
  i64 nv = 0, nic = 0;
  for (const auto& kv : nv_out) nv = std::max(nv, kv.second);
  for (const auto& kv : nv_in) nv = std::max(nv, kv.second);
  for (const auto& kv : nic_out) nic = std::max(nic, kv.second);
  for (const auto& kv : nic_in) nic = std::max(nic, kv.second);
  const double nvlink = static_cast<double>(nv) * pb.qkvo_bytes;
  const double nicb = static_cast<double>(nic) * pb.qkvo_bytes;
  double time = 0.0;
  if (nvlink != 0.0) {
    time = std::max(time, nvlink / pb.costs.nvlink_byte_per_s + pb.costs.nvlink_latency_s);
  }
  if (nicb != 0.0) time = std::max(time, nicb / pb.costs.nic_byte_per_s + pb.costs.nic_latency_s);
  return time;
}

// estimate.remap_fixed_seconds
double remap_fixed_seconds(const Problem& pb, const std::vector<Move>& moves) {
  bool cross = false, inside = false;
  for (const Move& m : moves) {
    if (m.tokens <= 0 || m.src == m.dst) continue;
    if (m.src / pb.gpn != m.dst / pb.gpn) {
      cross = true;
    } else {
      inside = true;
    }
  }
  if (!cross && !inside) return 0.0;
  const double latency = std::max(cross ? pb.costs.nic_latency_s : 0.0,
                                  inside ? pb.costs.nvlink_latency_s : 0.0);
  return 2.0 * static_cast<double>(pb.costs.layers) * latency + pb.costs.remap_step_s;
}

}  // namespace

Estimate estimate_tasks(const Problem& pb, const Tasks& tasks, const std::vector<i64>* linear,
                        const std::vector<Move>& moves) {
  const Costs& k = pb.costs;
  const i64 world = pb.world();
  std::vector<double> ring(world, 0.0), exposed(world, 0.0), local(world, 0.0), tokens(world, 0.0);
  std::unordered_map<std::vector<i64>, size_t, RingHash> index;
  std::vector<RingGroup> groups;
  for (size_t seq = 0; seq < tasks.size(); ++seq) {
    const double s = static_cast<double>(pb.seqlens[seq]);
    const i64 g = static_cast<i64>(tasks[seq].ring.size());
    if (g == 1) {
      local[tasks[seq].ring[0]] += k.compute(s, 1);
      tokens[tasks[seq].ring[0]] += s;
      continue;
    }
    auto [it, fresh] = index.emplace(tasks[seq].ring, groups.size());
    if (fresh) groups.push_back(RingGroup{&it->first, 0.0, 0.0, tasks[seq].tier});
    groups[it->second].compute += k.compute(s, g);
    groups[it->second].share += s / static_cast<double>(g);
    if (k.window_share > 0.0) {
      groups[it->second].dense += k.dense_compute(s, g);
      if (groups[it->second].window.ring != g) groups[it->second].window = RingWindow(g);
      groups[it->second].window.add(k.window_parts(s, g));
    }
  }
  std::vector<double> per_round(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    RingGroup& grp = groups[i];
    const double g = static_cast<double>(grp.members->size());
    grp.compute = grp.compute + g * k.ring_step_s;  // the engine's host work per ring step
    double hidden;
    if (k.window_share > 0.0) {  // each step's exchange behind that step's own compute
      grp.window.settle(k.halo_split);
      hidden = k.ring_exposed(grp.dense, grp.window, grp.share, grp.tier, pb.routing) +
               k.dkv_tail(k.accumulator_rows(grp.share, grp.window),
                          grp.tier, pb.routing);
    } else {
      hidden = (g - 1) * std::max(0.0, k.comm(grp.share, grp.tier, pb.routing) - grp.compute / g) +
               k.dkv_tail(grp.share, grp.tier, pb.routing);
    }
    for (i64 r : *grp.members) {
      ring[r] += grp.compute;
      exposed[r] += hidden;
      tokens[r] += grp.share;
    }
    per_round[i] = (grp.compute + hidden) / g;
  }
  std::vector<double> base(world);
  for (i64 r = 0; r < world; ++r) base[r] = ring[r] + std::max(local[r], exposed[r]);
  const std::vector<double> att = pace(std::move(base), groups, per_round);

  const double per_token = k.linear_per_token;
  const double bwd_att = pb.bwd_ratio / (1.0 + pb.bwd_ratio);
  const double bwd_lin = (pb.fwd_bwd_linear - 1.0) / pb.fwd_bwd_linear;
  Estimate est;
  double last_bwd;
  if (linear != nullptr) {
    std::vector<double> lin;
    for (i64 n : *linear) lin.push_back(per_token * static_cast<double>(n));
    const double peak = shared_peak(att, pb.shared_by);
    est.linear = shared_peak(lin, pb.shared_by);
    est.attention = 0.0 + peak;
    est.remap = remap_a2a_seconds(pb, moves) * 2.0 * static_cast<double>(k.layers) +
                remap_fixed_seconds(pb, moves);
    last_bwd = est.linear * bwd_lin + peak * bwd_att;
  } else {
    i64 crit = 0;
    double best = 0.0;
    std::vector<double> totals(world);
    for (i64 r = 0; r < world; ++r) {
      totals[r] = att[r] + per_token * tokens[r];
      if (r == 0 || totals[r] > best) {
        best = totals[r];
        crit = r;
      }
    }
    // the critical rank's parts, scaled to the wave's time on shared devices
    const double scale = best > 0.0 ? shared_peak(totals, pb.shared_by) / best : 1.0;
    est.linear = 0.0 + per_token * tokens[crit] * scale;
    est.attention = 0.0 + att[crit] * scale;
    last_bwd = (per_token * tokens[crit] * bwd_lin + att[crit] * bwd_att) * scale;
  }
  est.grad = std::max(0.0, pb.grad_s - last_bwd);
  est.step = est.linear + est.attention + est.remap + est.grad;
  return est;
}

std::pair<std::vector<std::pair<i64, double>>, Tasks> static_cp_best(const Problem& pb,
                                                                     i64 max_cp) {
  const i64 world = pb.world();
  const i64 longest = *std::max_element(pb.seqlens.begin(), pb.seqlens.end());
  std::vector<std::pair<i64, double>> scores;
  Tasks best;
  double best_step = 0.0;
  for (i64 cp = 1; cp <= std::min(world, max_cp); ++cp) {
    if (world % cp || zigzag_share_bound(longest, cp) > pb.capacity) continue;
    Tasks tasks = static_cp_tasks(pb, cp);
    if (!within_capacity(pb, tasks)) continue;
    const double step = estimate_tasks(pb, tasks, nullptr, {}).step;
    if (scores.empty() || step < best_step) {
      best_step = step;
      best = std::move(tasks);
    }
    scores.emplace_back(cp, step);
  }
  return {std::move(scores), std::move(best)};
}

namespace {

// One candidate of the portfolio: built and estimated by a job (portfolio.candidates).
struct Candidate {
  std::string name;
  bool optional = false;      // a peer's plan: skipped when it cannot place the batch
  bool present = false;       // built, and within the capacity
  Tasks tasks;
  bool remapped = false;
  Layout linear;
  double step = 0.0;
  std::exception_ptr error;   // a CapacityError of a required candidate, or any failure
};

void build(const Problem& pb, Candidate& c, const std::function<Tasks()>& place) {
  try {
    c.tasks = place();
    if (c.remapped) {
      auto [linear, moves] = remap_layout(pb, c.tasks);
      c.linear = std::move(linear);
      std::vector<i64> tokens(pb.world(), 0);
      for (i64 r = 0; r < pb.world(); ++r) {
        for (const Seg& s : c.linear[r]) tokens[r] += s.end - s.start;
      }
      c.present = within_capacity(pb, c.tasks);
      if (c.present) c.step = estimate_tasks(pb, c.tasks, &tokens, moves).step;
    } else {
      c.present = within_capacity(pb, c.tasks);
      if (c.present) c.step = estimate_tasks(pb, c.tasks, nullptr, {}).step;
    }
  } catch (const CapacityError&) {
    if (!c.optional) c.error = std::current_exception();
  } catch (...) {
    c.error = std::current_exception();
  }
}

}  // namespace

Choice portfolio(const Problem& pb) {
  std::vector<Candidate> candidates;
  std::vector<std::function<Tasks()>> jobs;
  if (pb.remap) {
    candidates.push_back(Candidate{"hierarchical+remap"});
    candidates.back().remapped = true;
    jobs.emplace_back([&pb] { return place_hierarchical(pb, false); });
  }
  candidates.push_back(Candidate{"hierarchical"});
  jobs.emplace_back([&pb] { return place_hierarchical(pb, true); });
  // portfolio.hybrid_candidates: a cap placing the batch as an earlier one does is skipped
  std::set<std::vector<i64>> placed;
  std::vector<i64> lengths(pb.seqlens);
  std::sort(lengths.begin(), lengths.end(), std::greater<i64>());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
  auto hybrid = [&](i64 cap, std::string name) {
    std::vector<i64> counts = ranks_per_document(pb, lengths, cap);
    if (counts == std::vector<i64>{-1} || !placed.insert(std::move(counts)).second) return;
    candidates.push_back(Candidate{std::move(name), true});
    jobs.emplace_back([&pb, cap] { return hybrid_dp_tasks(pb, cap); });
  };
  const i64 per_rank = default_max_seqlen_per_rank(pb);
  hybrid(per_rank, "hybrid-dp");
  if (pb.capacity > per_rank) {  // portfolio.widest_hybrid
    hybrid(pb.capacity, "hybrid-dp(cap=" + std::to_string(pb.capacity) + ")");
  }
  candidates.push_back(Candidate{"hydraulis", true});
  jobs.emplace_back([&pb] { return hydraulis_tasks(pb).first; });
  const i64 world = pb.world();
  const i64 longest = *std::max_element(pb.seqlens.begin(), pb.seqlens.end());
  for (i64 cp = 1; cp <= std::min<i64>(world, 2 * pb.gpn); ++cp) {
    if (world % cp == 0 && zigzag_share_bound(longest, cp) <= pb.capacity) {
      candidates.push_back(Candidate{"static-cp(cp=" + std::to_string(cp) + ")"});
      jobs.emplace_back([&pb, cp] { return static_cp_tasks(pb, cp); });
    }
  }
  // portfolio.swept_hybrid_caps: hybrid DP at the caps its users sweep (baselines.swept_caps)
  for (i64 k = 1; k <= world; k *= 2) {
    const i64 cap = (longest + k - 1) / k;
    if (k > 1 && cap < kMinSweptCap) break;
    if (cap <= pb.capacity) hybrid(cap, "hybrid-dp(cap=" + std::to_string(cap) + ")");
  }
  // Candidates are independent: build them on up to two threads (the result does not depend
  // on which thread built what), the Hydraulis search first as the longest job.
  std::vector<size_t> order(candidates.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_partition(order.begin(), order.end(),
                        [&](size_t i) { return candidates[i].name == "hydraulis"; });
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t k = next++; k < order.size(); k = next++) {
      build(pb, candidates[order[k]], jobs[order[k]]);
    }
  };
  const unsigned threads = std::min(2u, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();

  Choice out;
  bool any = false;
  for (Candidate& c : candidates) {
    if (c.error) std::rethrow_exception(c.error);  // the first failing candidate, in order
    if (!c.present) continue;
    out.names.push_back(c.name);
    out.estimates.push_back(c.step);
    if (!any || c.step < out.estimates[out.winner]) {
      any = true;
      out.winner = static_cast<i64>(out.names.size()) - 1;
      out.tasks = std::move(c.tasks);
      out.remapped = c.remapped;
      out.linear = std::move(c.linear);
    }
  }
  return out;
}

}  // namespace zeppelin_planner
