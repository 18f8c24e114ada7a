// Twin of the peers' placements the portfolio uses: baselines.hybrid_dp_tasks,
// baselines.static_cp_tasks, common.within_capacity and hydraulis.hydraulis_tasks.
#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <set>
#include <tuple>

#include "planner.h"
#include "planner_room.h"

namespace zeppelin_planner {
namespace {

using Entry = std::pair<double, i64>;
using IntHeap = std::priority_queue<std::pair<i64, i64>, std::vector<std::pair<i64, i64>>,
                                    std::greater<std::pair<i64, i64>>>;

i64 smallest_share(const Problem& pb, i64 seqlen) {
  i64 best = -1;
  auto consider = [&](i64 g) {
    if (g == 1 || seqlen >= 2 * g) {
      const i64 share = zigzag_share_bound(seqlen, g);
      if (best < 0 || share < best) best = share;
    }
  };
  for (i64 k = 1; k <= pb.gpn; ++k) consider(k);
  for (i64 m = 2; m <= pb.nodes; ++m) consider(m * pb.gpn);
  return best;
}

i64 fewest_ranks(const Problem& pb, i64 seqlen, i64 capacity) {
  for (i64 k = 1; k <= pb.gpn; ++k) {
    if (zigzag_share_bound(seqlen, k) <= capacity && (k == 1 || seqlen >= 2 * k)) return k;
  }
  for (i64 nodes = 2; nodes <= pb.nodes; ++nodes) {
    const i64 k = nodes * pb.gpn;
    if (zigzag_share_bound(seqlen, k) <= capacity) return k;
  }
  throw CapacityError{"a sequence of " + std::to_string(seqlen) +
                      " tokens does not fit the pool of " + std::to_string(pb.nodes * pb.gpn) +
                      " ranks at " + std::to_string(capacity) +
                      " tokens per rank (--max-seqlen-per-dp-cp-rank): raise it"};
}

// baselines._least_loaded_block: first rank of the block, -1 if none.
i64 least_loaded_block(const Problem& pb, const std::vector<double>& loads,
                       const std::vector<i64>& tokens, i64 room, i64 k) {
  // the starts in the reference's order: every k-block of each node, else whole-node blocks
  const bool inside = k <= pb.gpn;
  const i64 per_node = inside ? pb.gpn - k + 1 : 1;
  const i64 nodes = inside ? pb.nodes : pb.nodes - k / pb.gpn + 1;
  i64 best = -1;
  double best_load = 0;
  for (i64 n = 0; n < nodes; ++n) {
    for (i64 i = 0; i < per_node; ++i) {
      const i64 s = n * pb.gpn + i;
      i64 most = tokens[s];
      double busiest = loads[s];
      for (i64 r = s + 1; r < s + k && most <= room; ++r) {
        most = std::max(most, tokens[r]);
        busiest = std::max(busiest, loads[r]);
      }
      if (most > room) continue;
      if (best < 0 || busiest < best_load) {
        best = s;
        best_load = busiest;
      }
    }
  }
  return best;
}

std::vector<i64> powers(i64 limit) {
  std::vector<i64> out;
  for (i64 c = 1; c <= limit; c *= 2) out.push_back(c);
  return out;
}

std::vector<std::vector<i64>> strategies(const Problem& pb) {
  const i64 world = pb.world();
  const i64 longest = *std::max_element(pb.seqlens.begin(), pb.seqlens.end());
  std::vector<i64> fits;
  for (i64 c : powers(world)) {
    if (world % c == 0 && zigzag_share_bound(longest, c) <= pb.capacity) fits.push_back(c);
  }
  std::vector<std::vector<i64>> out;
  // A strategy's sizes are `count` bigs then smalls: (big, bigs, small, smalls) with the
  // smalls folded into the bigs when they are the same size names it, so this set finds
  // the repeats the reference drops with `sizes not in out`.
  std::set<std::tuple<i64, i64, i64, i64>> seen;
  for (size_t b = 0; b < std::min<size_t>(3, fits.size()); ++b) {
    const i64 big = fits[b];
    for (i64 count : powers(world / big)) {
      const i64 rest = world - count * big;
      for (i64 small : powers(std::min(big, pb.gpn))) {
        if (rest % small) continue;
        const bool folded = rest == 0 || small == big;
        const auto key = folded ? std::make_tuple(big, count + rest / big, i64{0}, i64{0})
                                : std::make_tuple(big, count, small, rest / small);
        if (!seen.insert(key).second) continue;
        std::vector<i64> sizes(count, big);
        sizes.insert(sizes.end(), rest / small, small);
        out.push_back(std::move(sizes));
      }
    }
  }
  return out;
}

double seq_time(const Problem& pb, i64 seqlen, i64 size, int tier) {
  const i64 ring = std::max<i64>(1, std::min(size, seqlen / 2));
  return pb.costs.task_time(static_cast<double>(seqlen), ring, ring > 1 ? tier : LOCAL, false) +
         pb.costs.linear_per_token * static_cast<double>(seqlen) / static_cast<double>(ring);
}

// seq_time of every sequence on a replica of each size, computed once per (sequence, size)
// across the strategies (a pure function: the same values as computing them each time).
struct SeqTimes {
  const Problem& pb;
  // index: log2 of the (power-of-two) size; sized once, so references into it stay valid
  std::vector<std::vector<double>> by_size = std::vector<std::vector<double>>(63);
  // The times of ``size`` (-1: not computed yet), one slot per sequence.
  std::vector<double>& of(i64 size) {
    size_t index = 0;
    while ((i64{1} << index) < size) ++index;
    if (by_size[index].empty()) by_size[index].assign(pb.seqlens.size(), -1.0);
    return by_size[index];
  }
  double get(std::vector<double>& times, i64 seq, i64 size) const {
    if (times[seq] < 0) {
      times[seq] = seq_time(pb, pb.seqlens[seq], size, size <= pb.gpn ? INTRA : INTER);
    }
    return times[seq];
  }
};

// Stage 1 (hydraulis.dispatch): false when a sequence fits nowhere or the bound is reached.
bool dispatch(const Problem& pb, const std::vector<i64>& order, const std::vector<i64>& sizes,
              double bound, SeqTimes& times, double* makespan, std::vector<i64>* replica_of) {
  std::vector<double> load(sizes.size(), 0.0);
  std::vector<i64> tokens(sizes.size(), 0);
  replica_of->assign(pb.seqlens.size(), -1);
  struct Kind {  // the replicas of one size: a tree over them, their indices, the times
    i64 size;
    RoomTree tree;
    std::vector<i64> replicas;
    std::vector<double>* times;
  };
  std::vector<Kind> kinds;
  std::vector<i64> slot(sizes.size());  // a replica's index in its kind's tree
  for (size_t r = 0; r < sizes.size(); ++r) {
    auto kind = std::find_if(kinds.begin(), kinds.end(),
                             [&](const Kind& k) { return k.size == sizes[r]; });
    if (kind == kinds.end()) {
      kinds.push_back(Kind{sizes[r], RoomTree(), {}, &times.of(sizes[r])});
      kind = kinds.end() - 1;
    }
    slot[r] = static_cast<i64>(kind->replicas.size());
    kind->replicas.push_back(static_cast<i64>(r));
  }
  for (Kind& kind : kinds) {
    kind.tree = RoomTree(static_cast<i64>(kind.replicas.size()));
    for (size_t i = 0; i < kind.replicas.size(); ++i) kind.tree.set(static_cast<i64>(i), 0.0, 0);
  }
  for (i64 seq : order) {
    const i64 s = pb.seqlens[seq];
    bool any = false;
    double best_end = 0;
    i64 best_r = 0, best_share = 0;
    Kind* best_kind = nullptr;
    for (Kind& kind : kinds) {
      const i64 share = zigzag_share_bound(s, std::max<i64>(1, std::min(kind.size, s / 2)));
      const i64 found = kind.tree.least_with_room(pb.capacity - share);
      if (found < 0) continue;
      const i64 r = kind.replicas[found];
      const double end = load[r] + times.get(*kind.times, seq, kind.size);
      if (!any || end < best_end || (end == best_end && r < best_r)) {
        any = true;
        best_end = end;
        best_r = r;
        best_share = share;
        best_kind = &kind;
      }
    }
    if (!any || best_end >= bound) return false;
    load[best_r] = best_end;
    tokens[best_r] += best_share;
    best_kind->tree.set(slot[best_r], best_end, tokens[best_r]);
    (*replica_of)[seq] = best_r;
  }
  *makespan = *std::max_element(load.begin(), load.end());
  return true;
}

Tasks pack(const Problem& pb, const std::vector<i64>& sizes,
           const std::vector<std::vector<i64>>& members) {
  Tasks tasks(pb.seqlens.size());
  std::vector<i64> order(sizes.size());
  for (size_t r = 0; r < order.size(); ++r) order[r] = static_cast<i64>(r);
  std::stable_sort(order.begin(), order.end(), [&](i64 a, i64 b) { return sizes[a] > sizes[b]; });
  i64 first = 0;
  for (i64 r : order) {
    const i64 size = sizes[r];
    IntHeap held;
    for (i64 i = 0; i < size; ++i) held.emplace(0, first + i);
    std::vector<i64> seqs = members[r];
    std::stable_sort(seqs.begin(), seqs.end(),
                     [&](i64 a, i64 b) { return pb.seqlens[a] > pb.seqlens[b]; });
    for (i64 seq : seqs) {
      const i64 s = pb.seqlens[seq], k = std::max<i64>(1, std::min(size, s / 2));
      std::vector<std::pair<i64, i64>> chosen;
      for (i64 j = 0; j < k; ++j) {
        chosen.push_back(held.top());
        held.pop();
      }
      Task task;
      for (const auto& [count, rank] : chosen) {
        held.emplace(count + s / k, rank);
        task.ring.push_back(rank);
      }
      std::sort(task.ring.begin(), task.ring.end());
      task.tier = tier_of(pb, task.ring);
      tasks[seq] = std::move(task);
    }
    first += size;
  }
  return tasks;
}

}  // namespace

// baselines.ranks_per_document: (length, ranks) flattened, for each of lengths (distinct, longest
// first) spread over more than one rank at per_rank; {-1} where one does not fit the pool.
std::vector<i64> ranks_per_document(const Problem& pb, const std::vector<i64>& lengths,
                                    i64 per_rank) {
  std::vector<i64> out;
  try {
    for (i64 seqlen : lengths) {
      if (seqlen <= per_rank) break;
      out.push_back(seqlen);
      out.push_back(fewest_ranks(pb, seqlen, per_rank));
    }
  } catch (const CapacityError&) {
    return {-1};
  }
  return out;
}

i64 default_max_seqlen_per_rank(const Problem& pb) {
  i64 longest = 0, total = 0;
  for (i64 s : pb.seqlens) {
    longest = std::max(longest, s);
    total += s;
  }
  const i64 suggested = std::max((longest + pb.gpn - 1) / pb.gpn,
                                 (total + pb.world() - 1) / pb.world());
  i64 best = suggested;
  std::set<i64> longer;
  for (i64 s : pb.seqlens) {
    if (s > suggested) longer.insert(s);
  }
  for (i64 s : longer) best = std::max(best, smallest_share(pb, s));
  return std::min(pb.capacity, best);
}

Tasks hybrid_dp_tasks(const Problem& pb, i64 per_rank) {
  const i64 world = pb.world();
  std::vector<double> loads(world, 0.0);
  std::vector<i64> tokens(world, 0);
  RoomTree ranks(world);
  for (i64 r = 0; r < world; ++r) ranks.set(r, 0.0, 0);
  Tasks tasks(pb.seqlens.size());
  for (i64 seq : pb.order) {
    const i64 seqlen = pb.seqlens[seq];
    const i64 k = fewest_ranks(pb, seqlen, per_rank);
    const i64 room = pb.capacity - zigzag_share_bound(seqlen, k);
    const i64 start = k == 1 ? ranks.least_with_room(room)
                             : least_loaded_block(pb, loads, tokens, room, k);
    if (start < 0) {
      throw CapacityError{"hybrid-dp: no " + std::to_string(k) +
                          " rank(s) have room for sequence " +
                          std::to_string(seq) + " (" + std::to_string(seqlen) +
                          " tokens) within the capacity " + std::to_string(pb.capacity)};
    }
    Task task;
    for (i64 r = start; r < start + k; ++r) task.ring.push_back(r);
    task.tier = tier_of(pb, task.ring);
    const double work =
        pb.costs.task_time(static_cast<double>(seqlen), k, task.tier, false) +
        pb.costs.linear_per_token * static_cast<double>(seqlen) / static_cast<double>(k);
    for (i64 pos = 0; pos < k; ++pos) {
      const i64 r = task.ring[pos];
      loads[r] += work;
      tokens[r] += zigzag_share(seqlen, k, pos);
      ranks.set(r, loads[r], tokens[r]);
    }
    tasks[seq] = std::move(task);
  }
  return tasks;
}

Tasks static_cp_tasks(const Problem& pb, i64 cp) {
  const i64 world = pb.world();
  IntHeap replicas;
  for (i64 r = 0; r < world / cp; ++r) replicas.emplace(0, r);
  std::vector<i64> rank_tokens(world, 0);
  Tasks tasks(pb.seqlens.size());
  for (i64 seq : pb.order) {
    const i64 seqlen = pb.seqlens[seq];
    const auto [tokens, replica] = replicas.top();
    replicas.pop();
    std::vector<i64> group(cp);
    for (i64 i = 0; i < cp; ++i) group[i] = replica * cp + i;
    const i64 k = std::max<i64>(1, std::min(cp, seqlen / 2));
    if (k < cp) {  // the k ranks of the group holding the fewest tokens (all of them: no sort)
      std::stable_sort(group.begin(), group.end(),
                       [&](i64 a, i64 b) { return rank_tokens[a] < rank_tokens[b]; });
      group.resize(k);
      std::sort(group.begin(), group.end());
    }
    for (i64 r : group) rank_tokens[r] += seqlen / static_cast<i64>(group.size());
    Task task{group, LOCAL};
    task.tier = tier_of(pb, task.ring);
    tasks[seq] = std::move(task);
    replicas.emplace(tokens + seqlen, replica);
  }
  return tasks;
}

bool within_capacity(const Problem& pb, const Tasks& tasks) {
  std::vector<i64> tokens(pb.world(), 0);
  for (size_t seq = 0; seq < tasks.size(); ++seq) {
    const i64 size = static_cast<i64>(tasks[seq].ring.size());
    for (i64 pos = 0; pos < size; ++pos) {
      tokens[tasks[seq].ring[pos]] += zigzag_share(pb.seqlens[seq], size, pos);
    }
  }
  return *std::max_element(tokens.begin(), tokens.end()) <= pb.capacity;
}

std::pair<Tasks, std::vector<i64>> hydraulis_tasks(const Problem& pb) {
  double best = std::numeric_limits<double>::infinity();
  std::vector<i64> best_sizes, best_replica, replica_of;
  SeqTimes times{pb};
  for (const std::vector<i64>& sizes : strategies(pb)) {
    double makespan;
    if (dispatch(pb, pb.order, sizes, best, times, &makespan, &replica_of)) {
      best = makespan;
      best_sizes = sizes;
      best_replica.swap(replica_of);
    }
  }
  if (best_sizes.empty()) {
    throw CapacityError{"hydraulis: no set of CP replicas holds the batch within the capacity " +
                        std::to_string(pb.capacity) + " tokens per rank"};
  }
  std::vector<std::vector<i64>> members(best_sizes.size());
  for (i64 seq : pb.order) members[best_replica[seq]].push_back(seq);  // dispatch order
  return {pack(pb, best_sizes, members), best_sizes};
}

}  // namespace zeppelin_planner
