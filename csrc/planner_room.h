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
  using Entry = std::pair<double, i64>;  // (load, item); empty slots: (inf, max) never win
  RoomTree() : RoomTree(0) {}
  explicit RoomTree(i64 n) : size_(1) {
    while (size_ < n) size_ *= 2;
    best_.assign(2 * size_, kEmpty);
    tokens_.assign(2 * size_, std::numeric_limits<i64>::max());
  }
  void set(i64 item, double load, i64 tokens) {
    i64 node = size_ + item;
    best_[node] = {load, item};
    tokens_[node] = tokens;
    for (node /= 2; node >= 1; node /= 2) {
      best_[node] = std::min(best_[2 * node], best_[2 * node + 1]);
      tokens_[node] = std::min(tokens_[2 * node], tokens_[2 * node + 1]);
    }
  }
  // The least (load, item) among items holding at most ``room`` tokens; -1 if none.
  i64 least_with_room(i64 room) const {
    Entry found = kEmpty;
    i64 stack[128];
    int depth = 0;
    stack[depth++] = 1;
    while (depth > 0) {
      const i64 node = stack[--depth];
      if (tokens_[node] > room || !(best_[node] < found)) continue;
      if (node >= size_) {
        found = best_[node];
        continue;
      }
      const i64 left = 2 * node, right = left + 1;  // the subtree with the lower load first
      const bool right_first = best_[right] < best_[left];
      stack[depth++] = right_first ? left : right;
      stack[depth++] = right_first ? right : left;
    }
    return found == kEmpty ? -1 : found.second;
  }

 private:
  static constexpr Entry kEmpty{std::numeric_limits<double>::infinity(),
                                std::numeric_limits<i64>::max()};
  i64 size_;
  std::vector<Entry> best_;
  std::vector<i64> tokens_;
};

}  // namespace zeppelin_planner
