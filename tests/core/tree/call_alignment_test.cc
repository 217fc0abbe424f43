// The lockstep alignment of ranks' model calls (core/tree/call_alignment.h): on random well-nested
// words of up to four ranks, every rank runs each of its calls exactly once and in order, slots
// pair calls of one kind, kept graphs stay last in first out with pads paired with pads; the
// dynamic programme is optimal against brute force for two ranks and no worse than the greedy
// merge or running the words one after another; bad words are refused naming the rank and call.
#include "core/tree/call_alignment.h"

#include <algorithm>
#include <array>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

using ::testing::HasSubstr;
using Word = std::vector<ModelCall>;

constexpr CallKind kF = CallKind::kForward, kO = CallKind::kKeep, kC = CallKind::kBackwardKept,
                   kA = CallKind::kForwardBackward, kK = CallKind::kLayerReplay;

// A random well-nested word: calls of the flat kinds, and kept pairs nested up to depth 3.
Word RandomWord(std::mt19937_64& rng, int64_t calls, int depth = 0) {
  Word word;
  std::uniform_int_distribution<int> pick(0, depth < 3 ? 4 : 2);
  std::uniform_int_distribution<int64_t> tokens(0, 300);
  while (static_cast<int64_t>(word.size()) < calls) {
    const int kind = pick(rng);
    if (kind <= 2) {
      word.push_back({std::array{kF, kA, kK}[kind], tokens(rng)});
      continue;
    }
    word.push_back({kO, tokens(rng)});
    const Word inner =
        RandomWord(rng, std::uniform_int_distribution<int64_t>(0, 3)(rng), depth + 1);
    word.insert(word.end(), inner.begin(), inner.end());
    word.push_back({kC, tokens(rng)});
  }
  return word;
}

// Every property a lockstep needs, for every rank.
void ExpectValid(const std::vector<AlignedSlot>& slots, const std::vector<Word>& words) {
  for (size_t r = 0; r < words.size(); ++r) {
    std::vector<int64_t> real;
    std::vector<int64_t> stack;  // kept graphs: their kKeep call, or -1 for a pad's
    for (const AlignedSlot& slot : slots) {
      ASSERT_EQ(slot.calls.size(), words.size());
      const int64_t call = slot.calls[r];
      if (call >= 0) {
        real.push_back(call);
        ASSERT_LT(call, static_cast<int64_t>(words[r].size()));
        EXPECT_EQ(words[r][call].kind, slot.kind) << "rank " << r << " call " << call;
      }
      if (slot.kind == kO) stack.push_back(call);
      if (slot.kind == kC) {
        ASSERT_FALSE(stack.empty()) << "rank " << r << ": a backward with nothing kept";
        const int64_t keep = stack.back();
        stack.pop_back();
        EXPECT_EQ(keep < 0, call < 0) << "rank " << r << ": a real backward of a pad or back";
        if (call >= 0 && keep >= 0) {
          // The word's own pairing: the newest open kKeep before this kBackwardKept.
          int64_t open = 0;
          int64_t expected = -1;
          for (int64_t i = call - 1; i >= 0; --i) {
            if (words[r][i].kind == kC) ++open;
            if (words[r][i].kind == kO && open-- == 0) {
              expected = i;
              break;
            }
          }
          EXPECT_EQ(keep, expected) << "rank " << r;
        }
      }
    }
    EXPECT_TRUE(stack.empty());
    std::vector<int64_t> all(words[r].size());
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(real, all) << "rank " << r << " runs each call once, in order";
  }
}

TEST(CallAlignment, TheHeadersExample) {
  const std::vector<Word> words = {{{kA, 100}, {kA, 20}}, {{kA, 90}}};
  const auto slots = AlignCalls(words);
  ASSERT_TRUE(slots.ok()) << slots.status();
  EXPECT_EQ(*slots, (std::vector<AlignedSlot>{{kA, {0, 0}}, {kA, {1, -1}}}));
}

TEST(CallAlignment, OneRankRunsItsOwnWordAndEqualWordsNeedNoPads) {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 20; ++trial) {
    const Word word = RandomWord(rng, 12);
    const auto alone = AlignCalls({word});
    ASSERT_TRUE(alone.ok());
    ASSERT_EQ(alone->size(), word.size());
    for (size_t i = 0; i < word.size(); ++i) {
      EXPECT_EQ((*alone)[i].kind, word[i].kind);
      EXPECT_EQ((*alone)[i].calls, std::vector<int64_t>{static_cast<int64_t>(i)});
    }
    const auto same = AlignCalls({word, word, word});
    ASSERT_TRUE(same.ok());
    EXPECT_EQ(same->size(), word.size());
    ExpectValid(*same, {word, word, word});
  }
}

TEST(CallAlignment, RandomWordsOfUpToFourRanksAreValidAndNoWorseThanGreedyOrInTurn) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t ranks = 1 + trial % 4;
    std::vector<Word> words;
    for (size_t r = 0; r < ranks; ++r) {
      words.push_back(RandomWord(rng, std::uniform_int_distribution<int64_t>(0, 14)(rng)));
    }
    const auto slots = AlignCalls(words);
    ASSERT_TRUE(slots.ok()) << slots.status();
    ExpectValid(*slots, words);
    const auto greedy = AlignCalls(words, {.max_table_cells = 0});
    ASSERT_TRUE(greedy.ok());
    ExpectValid(*greedy, words);
    // Every rank's word in turn, the others padding.
    std::vector<AlignedSlot> in_turn;
    for (size_t r = 0; r < ranks; ++r) {
      for (size_t i = 0; i < words[r].size(); ++i) {
        AlignedSlot slot{.kind = words[r][i].kind, .calls = std::vector<int64_t>(ranks, -1)};
        slot.calls[r] = static_cast<int64_t>(i);
        in_turn.push_back(slot);
      }
    }
    const double cost = AlignmentCost(*slots, words);
    if (ranks == 2) EXPECT_LE(cost, AlignmentCost(*greedy, words) + 1e-9) << "trial " << trial;
    EXPECT_LE(cost, AlignmentCost(in_turn, words) + 1e-9) << "trial " << trial;
  }
}

// Every alignment of two flat words (each step: pair the heads if their kinds match, or take one
// head alone), the cheapest one's cost.
double BruteForce(const std::vector<Word>& words, size_t i, size_t j,
                  std::vector<AlignedSlot>& slots) {
  const Word &a = words[0], &b = words[1];
  if (i == a.size() && j == b.size()) return AlignmentCost(slots, words);
  double best = 1e300;
  const auto with = [&](AlignedSlot slot, size_t ni, size_t nj) {
    slots.push_back(std::move(slot));
    best = std::min(best, BruteForce(words, ni, nj, slots));
    slots.pop_back();
  };
  const int64_t ii = static_cast<int64_t>(i), jj = static_cast<int64_t>(j);
  if (i < a.size() && j < b.size() && a[i].kind == b[j].kind)
    with({a[i].kind, {ii, jj}}, i + 1, j + 1);
  if (i < a.size()) with({a[i].kind, {ii, -1}}, i + 1, j);
  if (j < b.size()) with({b[j].kind, {-1, jj}}, i, j + 1);
  return best;
}

TEST(CallAlignment, TwoFlatWordsAreAlignedOptimally) {
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<int> kind(0, 2);
  std::uniform_int_distribution<int64_t> tokens(0, 500);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<Word> words(2);
    for (Word& word : words) {
      for (int64_t i = std::uniform_int_distribution<int64_t>(0, 6)(rng); i > 0; --i) {
        word.push_back({std::array{kF, kA, kK}[kind(rng)], tokens(rng)});
      }
    }
    const auto slots = AlignCalls(words);
    ASSERT_TRUE(slots.ok());
    std::vector<AlignedSlot> scratch;
    EXPECT_NEAR(AlignmentCost(*slots, words), BruteForce(words, 0, 0, scratch), 1e-6)
        << "trial " << trial;
  }
}

TEST(CallAlignment, KeptGroupsPairOnlyWithGroups) {
  // Rank 0 keeps a graph around an inner call; rank 1 runs the same calls flat.
  const std::vector<Word> words = {{{kO, 50}, {kA, 10}, {kC, 50}}, {{kA, 40}, {kA, 10}}};
  const auto slots = AlignCalls(words);
  ASSERT_TRUE(slots.ok());
  ExpectValid(*slots, words);
  for (const AlignedSlot& slot : *slots) {
    if (slot.kind == kO || slot.kind == kC) EXPECT_EQ(slot.calls[1], -1);
  }
}

TEST(CallAlignment, LongWordsAreMergedGreedilyAndStayValid) {
  std::mt19937_64 rng(5);
  const std::vector<Word> words = {RandomWord(rng, 300), RandomWord(rng, 280), RandomWord(rng, 10)};
  const auto slots = AlignCalls(words, {.max_table_cells = 1000});
  ASSERT_TRUE(slots.ok());
  ExpectValid(*slots, words);
}

TEST(CallAlignment, BadWordsAreRefusedNamingTheRankAndCall) {
  EXPECT_THAT(AlignCalls({{{kA, 1}}, {{kA, 1}, {kC, 3}}}).status().message(),
              HasSubstr("rank 1, call 1: a backward of a kept graph with none kept"));
  EXPECT_THAT(AlignCalls({{{kO, 1}, {kA, 1}}}).status().message(),
              HasSubstr("rank 0, call 0: a kept graph whose backward never comes"));
  EXPECT_THAT(AlignCalls({{{kA, -2}}}).status().message(), HasSubstr("rank 0, call 0: -2 tokens"));
  const auto none = AlignCalls({});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

}  // namespace
}  // namespace dta
