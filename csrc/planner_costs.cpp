// Twin of cost_model.CostKernel and twin_arithmetic.interp / add_up, and the zigzag helpers of
// segments.py: the same expressions in the same order as the Python reference.
#include <algorithm>
#include <cmath>

#include "planner.h"

namespace zeppelin_planner {

namespace {

// twin_arithmetic.interp: numpy.interp's expression for one point, clamped at the ends.
double interp(double x, const std::vector<double>& xs, const std::vector<double>& ys) {
  if (x <= xs[0]) return ys[0];
  const size_t last = xs.size() - 1;
  if (x >= xs[last]) return ys[last];
  size_t j = 0;
  while (xs[j + 1] <= x) ++j;
  if (xs[j] == x) return ys[j];
  const double slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]);
  return slope * (x - xs[j]) + ys[j];
}

}  // namespace

double add_up(const std::vector<double>& values) {
  double total = 0.0;
  for (double v : values) total += v;
  return total;
}

i64 zigzag_share(i64 length, i64 ring, i64 position) {
  if (ring == 1) return length;
  const i64 n = 2 * ring, mirror = n - 1 - position;
  return ((position + 1) * length / n - position * length / n) +
         ((mirror + 1) * length / n - mirror * length / n);
}

i64 zigzag_share_bound(i64 length, i64 ring) {
  if (ring == 1) return length;
  return 2 * ((length + 2 * ring - 1) / (2 * ring));
}

int tier_of(const Problem& pb, const std::vector<i64>& ring) {
  if (ring.size() == 1) return LOCAL;
  const i64 first = ring[0] / pb.gpn;
  for (i64 r : ring) {
    if (r / pb.gpn != first) return INTER;
  }
  return INTRA;
}

std::vector<i64> longest_first(const std::vector<i64>& seqlens) {
  std::vector<i64> order(seqlens.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<i64>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](i64 a, i64 b) { return seqlens[a] > seqlens[b]; });
  return order;
}

double Costs::flops(double chunk) const {
  return interp(std::log(chunk), log_lengths, flops_per_s);
}

// cost_model.window_work (scalar branch), the same expression.
double Costs::window_work(double seqlen) const {
  if (window_share <= 0.0) return 1.0;
  if (seqlen <= window + 1.0) return 1.0;
  const double w = window + 1.0;
  return (1.0 - window_share) +
         window_share * std::min(1.0, (2.0 * seqlen * w - window * w) / (seqlen * seqlen));
}

double Costs::compute(double seqlen, i64 ring) const {
  const double g = static_cast<double>(ring);
  return attn_coef * seqlen * seqlen * window_work(seqlen) / g / flops(seqlen / g);
}

double Costs::routed(double nbytes) const {
  return std::exp(interp(std::log(nbytes), routed_log_sizes, routed_log_times));
}

std::pair<double, double> Costs::relayed(double seqlen, i64 ring) const {
  const double g = static_cast<double>(ring);
  const double chunk = seqlen / g;
  if (window_share <= 0.0) return {chunk, -1.0};
  const double dense = (1.0 - window_share) * chunk;
  const auto [kv, dkv] = trimmed(chunk, ring);
  return {dense + window_share * kv, dense + window_share * dkv};
}

std::pair<double, double> Costs::trimmed(double chunk, i64 ring) const {
  const double g = static_cast<double>(ring);
  return {std::min(chunk, window), std::min(chunk, 2.0 * window * (g - 1.0) / g)};
}

RingWindow& RingWindow::add(const WindowParts& parts) {
  if (parts.halo) {
    halo_kv = halo_kv + parts.kv;
    halo_dkv = halo_dkv + parts.dkv;
  } else {
    rest_kv = rest_kv + parts.kv;
    rest_dkv = rest_dkv + parts.dkv;
    rest = rest + 1;
  }
  even = even + parts.even;
  first = first + parts.first;
  if (parts.rest > 0.0) {  // over the min(G - 1, 2D) steps within the reach
    const double per_step =
        parts.rest / static_cast<double>(std::min<i64>(ring - 1, 2 * parts.reach));
    for (i64 d = 1; d <= parts.reach; ++d) near[d] = near[d] + per_step;
  }
  return *this;
}

RingWindow& RingWindow::settle(bool split) {
  if (!split && rest > 0) {  // a group with any sequence round the ring sends all round it
    rest_kv = rest_kv + halo_kv;
    rest_dkv = rest_dkv + halo_dkv;
    halo_kv = 0.0;
    halo_dkv = 0.0;
  }
  return *this;
}

double Costs::unwindowed(double seqlen, i64 ring) const {
  const double g = static_cast<double>(ring);
  return attn_coef * seqlen * seqlen / g / flops(seqlen / g);
}

double Costs::dense_compute(double seqlen, i64 ring) const {
  return unwindowed(seqlen, ring) * (1.0 - window_share);
}

WindowParts Costs::window_parts(double seqlen, i64 ring) const {
  const double g = static_cast<double>(ring);
  const double chunk = seqlen / g;
  const double windowed = unwindowed(seqlen, ring) * window_share;
  const auto [kv, dkv] = trimmed(chunk, ring);
  if (seqlen <= window + 1.0) {
    return WindowParts{windowed, 0.0, 0.0, std::max<i64>(1, ring / 2), kv, dkv, false};
  }
  const bool halo = ring >= 3 && std::floor(seqlen / (2.0 * g)) >= window;  // halo_fits
  const double w = window + 1.0;
  const double kept = std::min(1.0, (2.0 * seqlen * w - window * w) / (seqlen * seqlen));
  const double work = windowed * kept, half = seqlen / (2.0 * g);
  const double band = window * (window + 1.0) / 2.0;
  const double step0 = window <= half ? 2.0 * g * (half * (window + 1.0) - band) + band
                                     : 2.0 * g * half * (half + 1.0) / 2.0;
  const double first = work * std::min(1.0, step0 / (kept * seqlen * seqlen / 2.0));
  const i64 reach =
      std::max<i64>(1, std::min<i64>(ring / 2, static_cast<i64>(std::ceil(window / half))));
  return WindowParts{0.0, first, work - first, reach, kv, dkv, halo};
}

double Costs::accumulator_rows(double share, const RingWindow& window) const {
  const double rows = window.halo_kv + window.rest_dkv;
  return (1.0 - window_share) * share + window_share * rows;
}

double Costs::ring_exposed(double dense, const RingWindow& window, double share, int tier,
                           bool use_routing) const {
  const i64 ring = window.ring;
  const double g = static_cast<double>(ring), w = window_share, h = ring_step_s;
  double exposed =
      (g - 1) * std::max(0.0, comm(share, tier, use_routing) * (1.0 - w) - dense / g -
                                  (1.0 - w) * h);
  const double even = window.even / g + w * h;
  if (window.halo_kv > 0.0) {  // KV to both neighbours behind step 0, once
    exposed = exposed + std::max(0.0, comm(window.halo_kv, tier, use_routing, 0.0) * w -
                                          window.first - even);
  }
  if (window.rest <= 0) return exposed;
  const double hop = comm(window.rest_kv, tier, use_routing, window.rest_dkv) * w;
  exposed = exposed + std::max(0.0, hop - window.first - even);
  for (i64 t = 1; t < ring - 1; ++t) {
    exposed = exposed + std::max(0.0, hop - window.near[std::min(t, ring - t)] - even);
  }
  return exposed;
}

double Costs::comm(double chunk, int tier, bool use_routing, double dkv) const {
  const double fwd = kv_per_token * chunk;
  const double bwd =
      dkv < 0.0 ? fwd * bwd_bytes_factor : fwd + kv_per_token * dkv * (bwd_bytes_factor - 1.0);
  double per_layer;
  if (tier == INTER && use_routing && routable) {
    per_layer = routed(fwd) + routed(bwd);
  } else if (tier == INTRA) {
    per_layer = (fwd + bwd) / nvlink_byte_per_s + 2.0 * nvlink_latency_s;
  } else {
    per_layer = (fwd + bwd) / nic_byte_per_s + 2.0 * nic_latency_s;
  }
  return per_layer * static_cast<double>(layers);
}

double Costs::dkv_tail(double chunk, int tier, bool use_routing) const {
  const double nbytes = kv_per_token * chunk * (bwd_bytes_factor - 1.0);
  double per_layer;
  if (tier == INTER && use_routing && routable) {
    per_layer = routed(nbytes);
  } else if (tier == INTRA) {
    per_layer = nbytes / nvlink_byte_per_s + nvlink_latency_s;
  } else {
    per_layer = nbytes / nic_byte_per_s + nic_latency_s;
  }
  return per_layer * static_cast<double>(layers);
}

double Costs::task_time(double seqlen, i64 ring, int tier, bool use_routing) const {
  double c = compute(seqlen, ring);
  if (ring == 1) return c;
  const double g = static_cast<double>(ring);
  if (window_share > 0.0) {
    return c + g * ring_step_s +
           ring_exposed(dense_compute(seqlen, ring),
                        RingWindow(ring).add(window_parts(seqlen, ring)), seqlen / g, tier,
                        use_routing);
  }
  c = c + g * ring_step_s;  // the engine's host work per ring step
  return c + (g - 1) * std::max(0.0, comm(seqlen / g, tier, use_routing) - c / g);
}

}  // namespace zeppelin_planner
