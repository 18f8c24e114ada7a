// C++17 twin of megatron_zeppelin/router/model.py: the routed step's cost model in integer
// ticks (read that module's docstring for the legs, the pipeline formula and the chunk rule).
// Every function mirrors the Python function of the same name; internal to csrc/router.cpp.
#pragma once

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "router.h"

namespace zeppelin_router {
namespace model {

// model.MAX_CHUNKS_LIMIT: with scaled loads below 2^53 (check_tick_range), a scaled pipeline sum
// stays below 2 * 16 * 2^53 = 2^58.
constexpr i64 kMaxChunksLimit = 16;

// One part of a plan: egress NIC, ingress NIC, src proxy, dst proxy, bytes.
struct Part {
  i64 e, i, p, q, nb;
  bool operator<(const Part& o) const { return e < o.e; }  // parts of a plan have distinct e
};
using RoutePlan = std::vector<Part>;

inline i64 chunk_cap(i64 largest_bytes, i64 max_chunks, i64 min_chunk_bytes) {
  return std::min(max_chunks, std::max<i64>(1, largest_bytes / min_chunk_bytes));
}

// The pipeline formula on per-chunk phase maxima scaled by `chunks`.
inline i64 pipeline_scaled(i64 d, i64 n, i64 m, i64 f, i64 chunks) {
  if (chunks == 1) return d + n + m;
  if (chunks == 2) return d + std::max(d, n) + std::max(n, m) + m;
  return d + std::max(d, n) + (chunks - 2) * f + std::max(n, m) + m;
}

struct Problem {
  i64 nodes, g, k;
  std::vector<i64> nic;
  std::vector<std::vector<i64>> gpus_of_nic;
  std::vector<i64> usable;
  i64 cv, lv, cn, ln;
  const std::vector<i64>& src;
  const std::vector<i64>& dst;
  const std::vector<i64>& nbytes;
  i64 align, max_chunks, min_chunk_bytes;
  i64 cs;  // the search's chunk count
  // Per flow: source / destination node, and their first GPU and first NIC index.
  std::vector<i64> x, y, xg, yg, xo, yo;
};

// Per-resource ticks scaled at cs chunks, message counts (*_m_*), bytes per NIC (b_*).
struct Loads {
  i64 cs;
  std::vector<i64> d_out, d_in, c_out, c_in, n_out, n_in;
  std::vector<i64> d_m_out, d_m_in, c_m_out, c_m_in, n_m_out, n_m_in, b_out, b_in;
  Loads(i64 nodes, i64 gpus, i64 nics, i64 chunks)
      : cs(chunks), d_out(nodes * gpus), d_in(nodes * gpus), c_out(nodes * gpus),
        c_in(nodes * gpus), n_out(nodes * nics), n_in(nodes * nics), d_m_out(nodes * gpus),
        d_m_in(nodes * gpus), c_m_out(nodes * gpus), c_m_in(nodes * gpus),
        n_m_out(nodes * nics), n_m_in(nodes * nics), b_out(nodes * nics), b_in(nodes * nics) {}
};

inline void apply_plan(const Problem& pb, Loads& loads, i64 f, const RoutePlan& plan, i64 sign) {
  const i64 s = pb.src[f], d = pb.dst[f], xo = pb.xo[f], yo = pb.yo[f];
  const i64 lv = loads.cs * pb.lv, ln = loads.cs * pb.ln;
  for (const Part& part : plan) {
    if (part.p != s) {
      const i64 t = sign * (part.nb * pb.cv + lv);
      loads.d_out[s] += t;
      loads.d_in[part.p] += t;
      loads.d_m_out[s] += sign;
      loads.d_m_in[part.p] += sign;
    }
    const i64 t = sign * (part.nb * pb.cn + ln);
    loads.n_out[xo + part.e] += t;
    loads.n_in[yo + part.i] += t;
    loads.n_m_out[xo + part.e] += sign;
    loads.n_m_in[yo + part.i] += sign;
    loads.b_out[xo + part.e] += sign * part.nb;
    loads.b_in[yo + part.i] += sign * part.nb;
    if (part.q != d) {
      const i64 c = sign * (part.nb * pb.cv + lv);
      loads.c_out[part.q] += c;
      loads.c_in[d] += c;
      loads.c_m_out[part.q] += sign;
      loads.c_m_in[d] += sign;
    }
  }
}

// Flow f's own completion if `plan` were added: the pipeline formula at loads.cs chunks over
// the resources the plan touches, in ticks times cs.
inline i64 score_plan(const Problem& pb, const Loads& loads, i64 f, const RoutePlan& plan) {
  const i64 s = pb.src[f], d = pb.dst[f], xo = pb.xo[f], yo = pb.yo[f];
  const i64 lv = loads.cs * pb.lv, ln = loads.cs * pb.ln;
  i64 dsum = 0, dmax = 0, csum = 0, cmax = 0, nmax = 0, share = 0;
  for (const Part& part : plan) {
    if (part.p != s) {
      const i64 t = part.nb * pb.cv + lv;
      dsum += t;
      const i64 x = loads.d_in[part.p] + t;
      dmax = std::max(dmax, x);
      share = std::max(share, x + loads.c_in[part.p]);
    }
    const i64 t = part.nb * pb.cn + ln;
    nmax = std::max({nmax, loads.n_out[xo + part.e] + t, loads.n_in[yo + part.i] + t});
    if (part.q != d) {
      const i64 c = part.nb * pb.cv + lv;
      csum += c;
      const i64 x = loads.c_out[part.q] + c;
      cmax = std::max(cmax, x);
      share = std::max(share, x + loads.d_out[part.q]);
    }
  }
  if (dsum) {
    const i64 x = loads.d_out[s] + dsum;
    dmax = std::max(dmax, x);
    share = std::max(share, x + loads.c_out[s]);
  }
  if (csum) {
    const i64 x = loads.c_in[d] + csum;
    cmax = std::max(cmax, x);
    share = std::max(share, x + loads.d_in[d]);
  }
  return pipeline_scaled(dmax, nmax, cmax, std::max(nmax, share), loads.cs);
}

// Per-chunk (d, n, m, f) maxima over the whole pool at `chunks`, scaled by `chunks`.
inline std::array<i64, 4> pool_phase_scaled(const Problem& pb, const Loads& L, i64 chunks) {
  const i64 dv = (chunks - L.cs) * pb.lv, dn = (chunks - L.cs) * pb.ln;
  i64 d = 0, n = 0, m = 0, share = 0;
  for (size_t r = 0; r < L.d_out.size(); ++r) {
    const i64 dout = L.d_out[r] + dv * L.d_m_out[r], din = L.d_in[r] + dv * L.d_m_in[r];
    const i64 cout = L.c_out[r] + dv * L.c_m_out[r], cin = L.c_in[r] + dv * L.c_m_in[r];
    d = std::max({d, dout, din});
    m = std::max({m, cout, cin});
    share = std::max({share, dout + cout, din + cin});
  }
  for (size_t r = 0; r < L.n_out.size(); ++r) {
    n = std::max({n, L.n_out[r] + dn * L.n_m_out[r], L.n_in[r] + dn * L.n_m_in[r]});
  }
  return {d, n, m, chunks >= 3 ? std::max(n, share) : n};
}

inline std::array<i64, 3> phase_ticks(const Problem& pb, const Loads& loads) {
  const std::array<i64, 4> a = pool_phase_scaled(pb, loads, 1);
  return {a[0], a[1], a[2]};
}

// The pool's modelled step time at `chunks` chunks, in ticks (rounded up).
inline i64 step_ticks(const Problem& pb, const Loads& loads, i64 chunks) {
  const std::array<i64, 4> a = pool_phase_scaled(pb, loads, chunks);
  const i64 scaled = pipeline_scaled(a[0], a[1], a[2], a[3], chunks);
  return (scaled + chunks - 1) / chunks;
}

// (chunks, step ticks): the allowed chunk count with the least step time (ties: fewer).
// Same values as step_ticks for every allowed count, fused into one pass over the resources
// (idle resources, without messages, carry no load and are skipped).
inline std::pair<i64, i64> best_chunks(const Problem& pb, const Loads& L, i64 largest_slice) {
  const i64 cap = chunk_cap(largest_slice, pb.max_chunks, pb.min_chunk_bytes);
  std::array<i64, kMaxChunksLimit + 1> d{}, n{}, m{}, share{};
  for (size_t r = 0; r < L.d_out.size(); ++r) {
    const i64 mdo = L.d_m_out[r], mdi = L.d_m_in[r], mco = L.c_m_out[r], mci = L.c_m_in[r];
    if ((mdo | mdi | mco | mci) == 0) continue;
    const i64 at1 = (1 - L.cs) * pb.lv;  // a load at one chunk: scaled load + at1 * messages
    i64 dout = L.d_out[r] + at1 * mdo, din = L.d_in[r] + at1 * mdi;
    i64 cout = L.c_out[r] + at1 * mco, cin = L.c_in[r] + at1 * mci;
    for (i64 c = 1; c <= cap; ++c) {
      d[c] = std::max(d[c], std::max(dout, din));
      m[c] = std::max(m[c], std::max(cout, cin));
      share[c] = std::max(share[c], std::max(dout + cout, din + cin));
      dout += pb.lv * mdo;
      din += pb.lv * mdi;
      cout += pb.lv * mco;
      cin += pb.lv * mci;
    }
  }
  for (size_t r = 0; r < L.n_out.size(); ++r) {
    const i64 mo = L.n_m_out[r], mi = L.n_m_in[r];
    if ((mo | mi) == 0) continue;
    i64 out = L.n_out[r] + (1 - L.cs) * pb.ln * mo, in = L.n_in[r] + (1 - L.cs) * pb.ln * mi;
    for (i64 c = 1; c <= cap; ++c) {
      n[c] = std::max(n[c], std::max(out, in));
      out += pb.ln * mo;
      in += pb.ln * mi;
    }
  }
  std::pair<i64, i64> best{0, 0};
  for (i64 c = 1; c <= cap; ++c) {
    const i64 f = c >= 3 ? std::max(n[c], share[c]) : n[c];
    const i64 ticks = (pipeline_scaled(d[c], n[c], m[c], f, c) + c - 1) / c;
    if (c == 1 || ticks < best.second) best = {c, ticks};
  }
  return best;
}

}  // namespace model
}  // namespace zeppelin_router
