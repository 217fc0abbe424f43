#include "core/tree/call_alignment.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace dta {
namespace {

// A column of an alignment of ranks [0, ranks): one slot (a single call kind), or a kept group (its
// kKeep slot, the alignment of its inner calls, its kBackwardKept slot).
struct Column {
  CallKind kind = CallKind::kForwardBackward;  // of a single slot; kKeep for a group
  std::vector<int64_t> calls;                  // single: per rank; group: the kKeep calls
  std::vector<int64_t> closes;                 // group: per rank its kBackwardKept call, or -1
  std::vector<Column> inner;                   // group: the calls between
  bool group() const { return kind == CallKind::kKeep; }
};
using Profile = std::vector<Column>;

int64_t TokensOf(const std::vector<std::vector<ModelCall>>& words, size_t rank, int64_t call) {
  return call < 0 ? 0 : words[rank][call].tokens;
}

class Aligner {
 public:
  Aligner(const std::vector<std::vector<ModelCall>>& words, const AlignmentCosts& costs)
      : words_(words), costs_(costs) {}

  double SlotCost(const std::vector<int64_t>& calls) const {
    return SlotCostWith(calls, calls.size(), -1);
  }

  // The cost of a slot of `calls`, rank `rank`'s entry replaced by `call` (rank out of range:
  // none replaced).
  double SlotCostWith(const std::vector<int64_t>& calls, size_t rank, int64_t call) const {
    int64_t most = 0, sum = 0;
    for (size_t r = 0; r < calls.size(); ++r) {
      const int64_t tokens = TokensOf(words_, r, r == rank ? call : calls[r]);
      most = std::max(most, tokens);
      sum += tokens;
    }
    const double ranks = static_cast<double>(words_.size());
    return costs_.alpha * static_cast<double>(most) +
           (1 - costs_.alpha) * static_cast<double>(sum) / ranks + costs_.call_overhead;
  }

  double Cost(const Column& column) const {
    if (!column.group()) return SlotCost(column.calls);
    double cost = SlotCost(column.calls) + SlotCost(column.closes);
    for (const Column& inner : column.inner) cost += Cost(inner);
    return cost;
  }

  // Rank `rank`'s word as a profile of one rank (in a frame of `width` ranks: the others -1).
  Profile Single(size_t rank, int64_t begin, int64_t end, size_t width) const {
    Profile profile;
    const std::vector<ModelCall>& word = words_[rank];
    for (int64_t i = begin; i < end; ++i) {
      Column column;
      column.calls.assign(width, -1);
      column.calls[rank] = i;
      column.kind = word[i].kind;
      if (word[i].kind == CallKind::kKeep) {
        const int64_t close = Close(rank, i);
        column.closes.assign(width, -1);
        column.closes[rank] = close;
        column.inner = Single(rank, i + 1, close, width);
        i = close;
      }
      profile.push_back(std::move(column));
    }
    return profile;
  }

  // Aligns `a` (ranks before `rank`) with `b` (rank `rank` alone) into one profile.
  Profile Merge(const Profile& a, const Profile& b, size_t rank) const {
    const size_t n = a.size(), m = b.size();
    if (static_cast<int64_t>(n + 1) * static_cast<int64_t>(m + 1) > costs_.max_table_cells) {
      return Greedy(a, b, rank);
    }
    std::vector<double> a_cost(n), b_cost(m);
    for (size_t i = 0; i < n; ++i) a_cost[i] = Cost(a[i]);
    for (size_t j = 0; j < m; ++j) b_cost[j] = Cost(b[j]);
    // best[i][j]: the cheapest alignment of a[i..] with b[j..]; choice: 0 pair, 1 a alone, 2 b
    // alone (ties in that order, so that every rank picks the same).
    std::vector<double> best((n + 1) * (m + 1), 0.0);
    std::vector<int8_t> choice((n + 1) * (m + 1), 0);
    absl::flat_hash_map<int64_t, Column> groups;  // paired groups, by i * m + j
    const auto at = [m](size_t i, size_t j) { return i * (m + 1) + j; };
    for (size_t i = n + 1; i-- > 0;) {
      for (size_t j = m + 1; j-- > 0;) {
        if (i == n && j == m) continue;
        double cost = 0;
        int8_t pick = -1;
        if (i < n && j < m && a[i].kind == b[j].kind) {
          double paired = 0;
          if (a[i].group()) {
            Column column = Pair(a[i], b[j], rank);
            paired = Cost(column);
            groups.emplace(static_cast<int64_t>(i * m + j), std::move(column));
          } else {
            paired = SlotCostWith(a[i].calls, rank, b[j].calls[rank]);
          }
          cost = paired + best[at(i + 1, j + 1)];
          pick = 0;
        }
        if (i < n) {
          const double c = a_cost[i] + best[at(i + 1, j)];
          if (pick < 0 || c < cost) cost = c, pick = 1;
        }
        if (j < m) {
          const double c = b_cost[j] + best[at(i, j + 1)];
          if (pick < 0 || c < cost) cost = c, pick = 2;
        }
        best[at(i, j)] = cost;
        choice[at(i, j)] = pick;
      }
    }
    Profile merged;
    for (size_t i = 0, j = 0; i < n || j < m;) {
      switch (choice[at(i, j)]) {
        case 0:
          merged.push_back(a[i].group() ? std::move(groups.at(static_cast<int64_t>(i * m + j)))
                                        : Pair(a[i], b[j], rank));
          ++i, ++j;
          break;
        case 1:
          merged.push_back(a[i++]);
          break;
        default:
          merged.push_back(b[j++]);
          break;
      }
    }
    return merged;
  }

  // One pass: matching heads of the same kind, else the side with more work left first.
  Profile Greedy(const Profile& a, const Profile& b, size_t rank) const {
    std::vector<double> a_left(a.size() + 1, 0.0), b_left(b.size() + 1, 0.0);
    for (size_t i = a.size(); i-- > 0;) a_left[i] = a_left[i + 1] + Cost(a[i]);
    for (size_t j = b.size(); j-- > 0;) b_left[j] = b_left[j + 1] + Cost(b[j]);
    Profile merged;
    size_t i = 0, j = 0;
    while (i < a.size() || j < b.size()) {
      if (i < a.size() && j < b.size() && a[i].kind == b[j].kind) {
        merged.push_back(Pair(a[i++], b[j++], rank));
      } else if (j == b.size() || (i < a.size() && a_left[i] >= b_left[j])) {
        merged.push_back(a[i++]);
      } else {
        merged.push_back(b[j++]);
      }
    }
    return merged;
  }

  // Two columns of one kind as one: the slots' calls side by side, groups' inner calls aligned.
  Column Pair(const Column& a, const Column& b, size_t rank) const {
    Column column = a;
    column.calls[rank] = b.calls[rank];
    if (a.group()) {
      column.closes[rank] = b.closes[rank];
      column.inner = Merge(a.inner, b.inner, rank);
    }
    return column;
  }

  int64_t Close(size_t rank, int64_t keep) const { return closes_[rank][keep]; }
  std::vector<std::vector<int64_t>> closes_;  // per rank, per kKeep call, its kBackwardKept

 private:
  const std::vector<std::vector<ModelCall>>& words_;
  AlignmentCosts costs_;
};

void Flatten(const Profile& profile, std::vector<AlignedSlot>& slots) {
  for (const Column& column : profile) {
    slots.push_back({.kind = column.kind, .calls = column.calls});
    if (!column.group()) continue;
    Flatten(column.inner, slots);
    slots.push_back({.kind = CallKind::kBackwardKept, .calls = column.closes});
  }
}

}  // namespace

absl::StatusOr<std::vector<AlignedSlot>> AlignCalls(
    const std::vector<std::vector<ModelCall>>& words, const AlignmentCosts& costs) {
  Aligner aligner(words, costs);
  aligner.closes_.resize(words.size());
  for (size_t r = 0; r < words.size(); ++r) {
    std::vector<int64_t>& closes = aligner.closes_[r];
    closes.assign(words[r].size(), -1);
    std::vector<int64_t> open;
    for (size_t i = 0; i < words[r].size(); ++i) {
      const ModelCall& call = words[r][i];
      if (call.tokens < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", r, ", call ", i, ": ", call.tokens, " tokens"));
      }
      if (call.kind == CallKind::kKeep) open.push_back(static_cast<int64_t>(i));
      if (call.kind == CallKind::kBackwardKept) {
        if (open.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "rank ", r, ", call ", i, ": a backward of a kept graph with none kept"));
        }
        closes[open.back()] = static_cast<int64_t>(i);
        open.pop_back();
      }
    }
    if (!open.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", r, ", call ", open.back(),
                                                     ": a kept graph whose backward never comes"));
    }
  }
  std::vector<AlignedSlot> slots;
  if (words.empty()) return slots;
  const size_t width = words.size();
  Profile profile = aligner.Single(0, 0, static_cast<int64_t>(words[0].size()), width);
  for (size_t r = 1; r < width; ++r) {
    profile = aligner.Merge(profile,
                            aligner.Single(r, 0, static_cast<int64_t>(words[r].size()), width), r);
  }
  Flatten(profile, slots);
  return slots;
}

double AlignmentCost(const std::vector<AlignedSlot>& slots,
                     const std::vector<std::vector<ModelCall>>& words,
                     const AlignmentCosts& costs) {
  Aligner aligner(words, costs);
  double cost = 0;
  for (const AlignedSlot& slot : slots) cost += aligner.SlotCost(slot.calls);
  return cost;
}

}  // namespace dta
