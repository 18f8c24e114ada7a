// A tree over items with a load and a token count: the least-loaded item with room, fast.
// Shared by the peers (planner_peers.cpp) and the hierarchical placement.
#pragma once

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "planner.h"

namespace zeppelin_planner {

// The least-loaded item (then the lowest index) holding at most ``room`` tokens: what the
// Python reference finds with a heap of (load, item) (baselines._least_loaded_rank,
// hydraulis._least_loaded_with_room). A tree over the items keeps, per subtree, the least
// (load, item) and the fewest tokens, so a query skips whole subtrees without room or without
// a better load instead of popping every full item.
class RoomTree {
 public:
  using Entry = std::pair<double, i64>;
  RoomTree() : RoomTree(0) {}
  explicit RoomTree(i64 n) : n_(n), size_(1) {
    while (size_ < n_) size_ *= 2;
    best_.assign(2 * size_, {std::numeric_limits<double>::infinity(), -1});
    tokens_.assign(2 * size_, std::numeric_limits<i64>::max());
  }
  void set(i64 item, double load, i64 tokens) {
    i64 node = size_ + item;
    best_[node] = {load, item};
    tokens_[node] = tokens;
    for (node /= 2; node >= 1; node /= 2) {
      best_[node] = std::min(best_[2 * node], best_[2 * node + 1], less);
      tokens_[node] = std::min(tokens_[2 * node], tokens_[2 * node + 1]);
    }
  }
  i64 least_with_room(i64 room) const {
    Entry found{std::numeric_limits<double>::infinity(), -1};
    search(1, room, &found);
    return found.second;
  }

 private:
  static bool less(const Entry& a, const Entry& b) {
    if (a.second < 0) return false;
    if (b.second < 0) return true;
    return a < b;
  }
  void search(i64 node, i64 room, Entry* found) const {
    if (tokens_[node] > room || best_[node].second < 0) return;
    if (found->second >= 0 && !less(best_[node], *found)) return;
    if (node >= size_) {
      *found = best_[node];
      return;
    }
    const i64 first = less(best_[2 * node + 1], best_[2 * node]) ? 2 * node + 1 : 2 * node;
    search(first, room, found);
    search(first ^ 1, room, found);
  }
  i64 n_, size_;
  std::vector<Entry> best_;
  std::vector<i64> tokens_;
};

}  // namespace zeppelin_planner
