// The two kinds of environment switch: on unless "0" (EnvSwitchOn), off unless "1"
// (EnvSwitchOptIn), for unset, empty and other values; a switch set for a scope (ScopedEnv).
#include "core/base/env_switch.h"

#include <cstdlib>

#include "core/base/scoped_env.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

constexpr const char* kName = "DTA_ENV_SWITCH_TEST_VARIABLE";

TEST(EnvSwitch, OnUnlessZero) {
  unsetenv(kName);
  EXPECT_TRUE(EnvSwitchOn(kName));
  for (const char* on : {"1", "", "yes", "00", " 0"}) {
    setenv(kName, on, 1);
    EXPECT_TRUE(EnvSwitchOn(kName)) << '"' << on << '"';
  }
  setenv(kName, "0", 1);
  EXPECT_FALSE(EnvSwitchOn(kName));
  unsetenv(kName);
}

TEST(EnvSwitch, OptInOnlyForOne) {
  unsetenv(kName);
  EXPECT_FALSE(EnvSwitchOptIn(kName));
  for (const char* off : {"0", "", "yes", "true", "11", " 1"}) {
    setenv(kName, off, 1);
    EXPECT_FALSE(EnvSwitchOptIn(kName)) << '"' << off << '"';
  }
  setenv(kName, "1", 1);
  EXPECT_TRUE(EnvSwitchOptIn(kName));
  unsetenv(kName);
}

TEST(ScopedEnv, SetsForItsScopeAndRestoresThePreviousValueOrNone) {
  unsetenv(kName);
  {
    const ScopedEnv off(kName, "0");
    EXPECT_FALSE(EnvSwitchOn(kName));
    {
      const ScopedEnv unset(kName, nullptr);
      EXPECT_EQ(std::getenv(kName), nullptr);
    }
    ASSERT_NE(std::getenv(kName), nullptr);
    EXPECT_STREQ(std::getenv(kName), "0");
  }
  EXPECT_EQ(std::getenv(kName), nullptr);
}

}  // namespace
}  // namespace dta
