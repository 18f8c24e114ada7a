// C++17 twin of the planners behind zeppelin's portfolio (megatron_zeppelin/planner/):
// hierarchical placement (zeppelin.py), remap layout (linear_layout.py), hybrid DP and static CP
// (baselines.py), Hydraulis (hydraulis.py), the step estimate (estimate.py) and the portfolio
// (portfolio.py). Every function mirrors the Python function of the same name, with the same
// arithmetic in the same order (no FMA contraction: -ffp-contract=off), so both backends return
// the same plans bit for bit; the Python modules document the algorithms.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace zeppelin_planner {

using i64 = std::int64_t;

enum Tier : int { INTER = 0, INTRA = 1, LOCAL = 2 };

// Twin of cost_window.WindowParts: a windowed layer's ring work of one rank's share.
struct WindowParts {
  double even = 0.0, first = 0.0, rest = 0.0;
  i64 reach = 1;
  double kv = 0.0, dkv = 0.0;
  bool halo = false;  // the window fits in every chunk of a ring of 3 or more
};

// Twin of cost_window.RingWindow: a ring's windowed work summed over its sequences.
struct RingWindow {
  i64 ring = 1;
  double even = 0.0, first = 0.0;
  // hop rows (KV, dK/dV): the sequences whose window fits in their chunks, and the others
  double halo_kv = 0.0, halo_dkv = 0.0, rest_kv = 0.0, rest_dkv = 0.0;
  i64 rest = 0;
  std::vector<double> near;  // work of the steps d away from step 0, d in [0, ring / 2]
  RingWindow(i64 ring_size = 1)  // NOLINT: implicit, so that RingGroup{...} default-inits it
      : ring(ring_size), near(static_cast<size_t>(ring_size / 2 + 1), 0.0) {}
  RingWindow& add(const WindowParts& parts);
  RingWindow& settle(bool split);  // the group as the engine runs it (HALO_SPLIT)
};

// Twin of cost_model.CostKernel (planner_costs.cpp).
struct Costs {
  double attn_coef = 0;
  std::vector<double> log_lengths, flops_per_s;
  double kv_per_token = 0, bwd_bytes_factor = 0;
  i64 layers = 0;
  double nvlink_byte_per_s = 0, nvlink_latency_s = 0, nic_byte_per_s = 0, nic_latency_s = 0;
  bool routable = false;
  std::vector<double> routed_log_sizes, routed_log_times;
  double linear_per_token = 0;
  double ring_step_s = 0;  // host work per ring step, all layers, fwd + bwd
  double remap_step_s = 0;  // the remap's host work per micro-batch, all layers, fwd + bwd
  double window = 0;        // the model's sliding window (tokens), where window_share > 0
  double window_share = 0;  // fraction of layers with the window
  bool halo_split = true;   // the engine splits a partly fitting windowed group

  double window_work(double seqlen) const;
  double flops(double chunk) const;
  double compute(double seqlen, i64 ring) const;
  double routed(double nbytes) const;
  // (KV rows, dK/dV rows; -1: as many) a ring hop carries under the window
  std::pair<double, double> relayed(double seqlen, i64 ring) const;
  std::pair<double, double> trimmed(double chunk, i64 ring) const;
  double unwindowed(double seqlen, i64 ring) const;
  double dense_compute(double seqlen, i64 ring) const;
  WindowParts window_parts(double seqlen, i64 ring) const;
  // cost_model.CostKernel.accumulator_rows: the engine's halo exchange
  double accumulator_rows(double share, const RingWindow& window) const;
  double ring_exposed(double dense, const RingWindow& window, double share, int tier,
                      bool routed) const;
  double comm(double chunk, int tier, bool routed, double dkv = -1.0) const;
  double dkv_tail(double chunk, int tier, bool routed) const;
  double task_time(double seqlen, i64 ring, int tier, bool routed) const;
};

// Everything one planning call reads: the batch after ``common.prepare``, the cost kernel and
// the settings of config, linear layout, remap and step estimate.
struct Problem {
  std::vector<i64> seqlens;
  i64 capacity = 0, nodes = 0, gpn = 0;
  Costs costs;
  bool routing = true, remap = true;
  double slack = 0;
  double linear_r = 0, remap_c = 0;       // linear_layout.rank_targets(r, c)
  double qkvo_bytes = 0;                  // estimate.remap_a2a_seconds: bytes per token
  i64 tp = 1, nics_per_node = 1;
  std::vector<i64> gpu_to_nic;            // of the cluster's GPUs (gpn * tp of them)
  double grad_s = 0, bwd_ratio = 0;       // estimate._step
  double fwd_bwd_linear = 3.0;
  double shared_by = 1.0;                 // estimate.shared_peak: ranks sharing a device
  std::vector<i64> order;                 // sequences longest first (stable): longest_first
  i64 world() const { return nodes * gpn; }
};

struct Task {
  std::vector<i64> ring;
  int tier = LOCAL;
};
using Tasks = std::vector<Task>;

// A remap transfer: tokens held by src for the linear modules, attended on dst.
struct Move {
  i64 src, dst, tokens;
};
// A token range of a sequence: (seq, start, end).
struct Seg {
  i64 seq, start, end;
};
using Layout = std::vector<std::vector<Seg>>;

struct Estimate {
  double step = 0, linear = 0, attention = 0, remap = 0, grad = 0;
};

// Raised where the Python reference raises CapacityError (the message says why).
struct CapacityError {
  std::string message;
};

i64 zigzag_share(i64 length, i64 ring, i64 position);
i64 zigzag_share_bound(i64 length, i64 ring);
int tier_of(const Problem& pb, const std::vector<i64>& ring);
std::vector<i64> longest_first(const std::vector<i64>& seqlens);
double add_up(const std::vector<double>& values);

Tasks place_hierarchical(const Problem& pb, bool with_linear);
Tasks hybrid_dp_tasks(const Problem& pb, i64 per_rank);
std::vector<i64> ranks_per_document(const Problem& pb, const std::vector<i64>& lengths,
                                    i64 per_rank);  // {-1}: does not fit
i64 default_max_seqlen_per_rank(const Problem& pb);
constexpr i64 kMinSweptCap = 1024;  // baselines.MIN_CAP (parity: test_planner)
Tasks static_cp_tasks(const Problem& pb, i64 cp);
bool within_capacity(const Problem& pb, const Tasks& tasks);
std::pair<Tasks, std::vector<i64>> hydraulis_tasks(const Problem& pb);
// baselines.StaticCPBest: (cp, estimated step) of every legal size up to max_cp, in size order,
// and the tasks of the fastest (ties: the smaller size).
std::pair<std::vector<std::pair<i64, double>>, Tasks> static_cp_best(const Problem& pb, i64 max_cp);

Layout attention_layout(const Problem& pb, const Tasks& tasks);
std::pair<Layout, std::vector<Move>> remap_layout(const Problem& pb, const Tasks& tasks);
Estimate estimate_tasks(const Problem& pb, const Tasks& tasks, const std::vector<i64>* linear,
                        const std::vector<Move>& moves);

struct Choice {
  std::vector<std::string> names;   // every candidate, in tie-break order
  std::vector<double> estimates;    // their estimated step seconds
  i64 winner = 0;
  Tasks tasks;                      // the winner's
  bool remapped = false;
  Layout linear;                    // the winner's linear layout when remapped
};
Choice portfolio(const Problem& pb);

}  // namespace zeppelin_planner
