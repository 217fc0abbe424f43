// Declaration-only stand-in for Gloo's gloo/rendezvous/store.h (executor/distributed/
// gloo_backend.cc says why). ProcessGroupGloo::GlooStore derives from this class and overrides
// these members; GlooStore is only ever instantiated inside libtorch_cpu (against the real
// definition), never by dta code. GLOO_STORE_HAS_STORE_V2 is left undefined on purpose, so the
// header's v2 overrides are not declared.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace gloo::rendezvous {

class Store {
 public:
  virtual ~Store();
  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) = 0;
};

}  // namespace gloo::rendezvous
