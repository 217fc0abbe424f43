// The layout planner's parameter count (core/layout) is exactly what Qwen3Model allocates.
#include "core/layout/memory_plan.h"
#include "executor/model/qwen3_model.h"

#include "gtest/gtest.h"

namespace dta {
namespace {

TEST(ParameterCount, EqualsTheModelsParameters) {
  for (const bool tie : {false, true}) {
    Qwen3Config c;
    c.vocab_size = 37;
    c.hidden_size = 24;
    c.intermediate_size = 40;
    c.num_hidden_layers = 3;
    c.num_attention_heads = 6;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.tie_word_embeddings = tie;
    const Qwen3Model model(c, at::TensorOptions().dtype(at::kFloat));
    int64_t total = 0;
    int64_t norms = 0;
    for (const auto& [name, p] : model.named_parameters()) {
      total += p.numel();
      if (name.find("norm") != std::string::npos) norms += p.numel();
    }
    const ParameterCount count = CountParameters(c);
    EXPECT_EQ(count.total(), total) << "tie " << tie;
    EXPECT_EQ(count.replicated, norms) << "tie " << tie;
  }
}

}  // namespace
}  // namespace dta
