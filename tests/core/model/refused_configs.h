// Parsing config.json files in tests: ParseOk, and table-driven refusals; shared by the config
// tests.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/model/config_json.h"
#include "core/model/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace dta::testing {

struct RefusedConfig {
  std::string name;
  std::string edit;  // a JSON object merged into the base config (a merge patch: null deletes)
  absl::StatusCode code;
  std::string expected;  // in the message
};

// The config `json` parses to (a test failure naming the error and the file if it does not parse;
// a default ModelConfig then).
inline ModelConfig ParseOk(const std::string& json) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(json);
  EXPECT_TRUE(config.ok()) << config.status() << "\n" << json;
  return config.ok() ? *config : ModelConfig();
}

// Each case's edit merged into `base` must be refused by ParseModelConfig with the case's code and
// a message containing its expected text.
inline void ExpectRefused(const nlohmann::json& base, const std::vector<RefusedConfig>& cases) {
  for (const RefusedConfig& c : cases) {
    nlohmann::json json = base;
    json.merge_patch(nlohmann::json::parse(c.edit));
    const absl::StatusOr<ModelConfig> config = ParseModelConfig(json.dump());
    ASSERT_FALSE(config.ok()) << c.name;
    EXPECT_EQ(config.status().code(), c.code) << c.name << ": " << config.status();
    EXPECT_THAT(std::string(config.status().message()), ::testing::HasSubstr(c.expected)) << c.name;
  }
}

}  // namespace dta::testing
