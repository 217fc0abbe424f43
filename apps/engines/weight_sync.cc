#include "apps/engines/weight_sync.h"

#include <curl/curl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <random>
#include <stdexcept>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/base/private_files.h"
#include "core/model/layer_spec.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

using Json = nlohmann::json;

// A bounded blocking POST whose answer is 2xx and, when it is a JSON object, has no "success":
// false (SGLang's and AReaL's answers). UNAVAILABLE naming the URL otherwise.
absl::Status Post(const std::string& url, const Json& body, const std::string& token,
                  std::chrono::milliseconds timeout) {
  static const CURLcode ready = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (ready != CURLE_OK) return absl::InternalError("libcurl cannot start");
  std::unique_ptr<CURL, decltype(&curl_easy_cleanup)> curl(curl_easy_init(), curl_easy_cleanup);
  if (curl == nullptr) return absl::InternalError("libcurl cannot make a handle");
  const std::string payload = body.dump();
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  headers = curl_slist_append(headers, "Expect:");
  if (!token.empty()) {
    headers = curl_slist_append(headers, absl::StrCat("Authorization: Bearer ", token).c_str());
  }
  std::unique_ptr<curl_slist, decltype(&curl_slist_free_all)> owned_headers(headers,
                                                                            curl_slist_free_all);
  std::string answer;
  auto append = +[](char* data, size_t size, size_t count, void* out) -> size_t {
    auto* text = static_cast<std::string*>(out);
    if (text->size() > (64 << 10)) return 0;  // an answer this long is not one of theirs
    text->append(data, size * count);
    return size * count;
  };
  char error[CURL_ERROR_SIZE] = "";
  CURL* handle = curl.get();
  curl_easy_setopt(handle, CURLOPT_URL, url.c_str());
  curl_easy_setopt(handle, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(handle, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(handle, CURLOPT_POSTFIELDS, payload.c_str());
  curl_easy_setopt(handle, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(payload.size()));
  curl_easy_setopt(handle, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(handle, CURLOPT_TIMEOUT_MS, std::max<long>(1, timeout.count()));
  curl_easy_setopt(handle, CURLOPT_WRITEFUNCTION, append);
  curl_easy_setopt(handle, CURLOPT_WRITEDATA, &answer);
  curl_easy_setopt(handle, CURLOPT_ERRORBUFFER, error);
  const CURLcode code = curl_easy_perform(handle);
  if (code != CURLE_OK) {
    return absl::UnavailableError(
        absl::StrCat(url, ": ", error[0] != '\0' ? error : curl_easy_strerror(code)));
  }
  long status = 0;
  curl_easy_getinfo(handle, CURLINFO_RESPONSE_CODE, &status);
  const std::string excerpt = answer.substr(0, 200);
  if (status < 200 || status >= 300) {
    return absl::UnavailableError(absl::StrCat(url, ": HTTP ", status, ": ", excerpt));
  }
  const Json json = Json::parse(answer, nullptr, /*allow_exceptions=*/false);
  if (json.is_object()) {
    const auto success = json.find("success");
    if (success != json.end() && success->is_boolean() && !success->get<bool>()) {
      return absl::UnavailableError(absl::StrCat(url, ": the engine refused: ", excerpt));
    }
  }
  return absl::OkStatus();
}

// Runs `call(e)` for every engine e on its own thread. UNAVAILABLE with every failure's message,
// in engine order (one engine's quick refusal can make another's rendezvous time out).
absl::Status ForEachEngine(size_t engines, const std::function<absl::Status(size_t)>& call) {
  std::vector<absl::Status> results(engines);
  std::vector<std::thread> threads;
  threads.reserve(engines);
  for (size_t e = 0; e < engines; ++e) {
    threads.emplace_back([&results, &call, e] { results[e] = call(e); });
  }
  for (std::thread& thread : threads) thread.join();
  std::vector<std::string> failures;
  for (const absl::Status& result : results) {
    if (!result.ok()) failures.emplace_back(result.message());
  }
  if (failures.empty()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrJoin(failures, "; "));
}

// What one route is called on an engine of `kind`.
std::string Route(const WeightSyncEngine& engine, const char* sglang, const char* areal) {
  return absl::StrCat(engine.url, engine.kind == EngineKind::kSglang ? sglang : areal);
}

std::string RandomHex128() {
  std::random_device device;
  return absl::StrFormat("%08x%08x%08x%08x", device(), device(), device(), device());
}

// A tensor as the engines receive it: its checkpoint name and whole shape, and where it comes from
// (the parameter `index`, and for stacked experts the expert).
struct SyncedTensor {
  std::string name;
  std::vector<int64_t> shape;
  size_t index = 0;
  int64_t expert = -1;  // -1: the whole parameter
};

// Every tensor of the published checkpoint, in its order (SaveHfModel's).
std::vector<SyncedTensor> SyncedTensors(const Decoder& model) {
  const std::vector<ParameterSpec> specs = BuildModelSpec(model.config()).Parameters();
  TORCH_CHECK(specs.size() == model.named_parameters().size(),
              "weight sync: the model's parameters are not its layer spec's");
  std::vector<SyncedTensor> tensors;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!specs[i].per_expert()) {
      tensors.push_back({model.named_parameters()[i].first, specs[i].shape, i});
      continue;
    }
    const std::vector<std::string> names = specs[i].CheckpointNames();
    const std::vector<int64_t> shape(specs[i].shape.begin() + 1, specs[i].shape.end());
    for (size_t e = 0; e < names.size(); ++e) {
      tensors.push_back({names[e], shape, i, static_cast<int64_t>(e)});
    }
  }
  return tensors;
}

int64_t Bytes(const std::vector<int64_t>& shape) {
  int64_t elements = 1;
  for (int64_t size : shape) elements *= size;
  return elements * 2;  // bf16
}

// Turns what c10d throws into UNAVAILABLE.
template <typename F>
absl::Status Collective(F&& f) {
  try {
    f();
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::UnavailableError(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return absl::UnavailableError(e.what());
  }
}

}  // namespace

// Gathers the parameters whole in order, each once (Decoder::GatherParameter: collectives over the
// tensor- and expert-parallel groups, which every rank of them must call in the same order), so
// that the sender's sync can fail anywhere and its peers' gathers still meet its own (Rest).
class ParameterGathers {
 public:
  explicit ParameterGathers(const Decoder& model) : model_(model) {}

  // The whole of parameter `index`, no earlier than the previous call's: gathers up to it. A failed
  // gather is kept for RethrowFailure, and reported here as std::runtime_error.
  const at::Tensor& Whole(size_t index) {
    TORCH_CHECK(index + 1 >= next_, "weight sync: parameter ", index, " gathered out of order");
    try {
      while (next_ <= index) whole_ = model_.GatherParameter(next_++);
    } catch (...) {
      error_ = std::current_exception();
      throw std::runtime_error("the gather of the trainer's weights failed");
    }
    return whole_;
  }

  // Gathers the parameters not gathered yet (discarded). Nothing after a failed gather.
  void Rest() {
    whole_ = at::Tensor();
    while (error_ == nullptr && next_ < model_.named_parameters().size()) {
      (void)model_.GatherParameter(next_++);
    }
  }

  // Throws what a failed gather threw, if one did.
  void RethrowFailure() const {
    if (error_ != nullptr) std::rethrow_exception(error_);
  }

 private:
  const Decoder& model_;
  size_t next_ = 0;   // the next parameter to gather
  at::Tensor whole_;  // parameter next_ - 1, whole
  std::exception_ptr error_;
};

void TakePartInPublish(const Decoder& model) {
  at::NoGradGuard no_grad;
  ParameterGathers(model).Rest();
}

absl::StatusOr<std::vector<WeightSyncEngine>> ParseWeightSyncEngines(std::string_view spec) {
  std::vector<WeightSyncEngine> engines;
  for (absl::string_view entry :
       absl::StrSplit(absl::string_view(spec.data(), spec.size()), ',', absl::SkipEmpty())) {
    const std::string where = absl::StrCat("weight sync engine '", entry, "'");
    int workers = 1;
    if (const size_t star = entry.rfind('*'); star != absl::string_view::npos) {
      if (!absl::SimpleAtoi(entry.substr(star + 1), &workers) || workers < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": the worker count after '*' must be an integer >= 1"));
      }
      entry = entry.substr(0, star);
    }
    absl::StatusOr<std::vector<EngineEndpoint>> parsed =
        ParseEngineEndpoints(std::string_view(entry.data(), entry.size()));
    if (!parsed.ok())
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", parsed.status().message()));
    if (parsed->size() != 1 || (*parsed)[0].kind == EngineKind::kVllm) {
      return absl::InvalidArgumentError(
          absl::StrCat(where,
                       ": expected sglang=URL or areal-vllm=URL (vLLM's own server cannot "
                       "join a c10d group)"));
    }
    engines.push_back({(*parsed)[0].kind, (*parsed)[0].url, workers});
  }
  return engines;
}

std::vector<size_t> PackBuckets(const std::vector<int64_t>& sizes, int64_t bucket_bytes) {
  std::vector<size_t> starts = {0};
  int64_t filled = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > starts.back() && filled + sizes[i] > bucket_bytes) {
      starts.push_back(i);
      filled = 0;
    }
    filled += sizes[i];
  }
  if (!sizes.empty()) starts.push_back(sizes.size());
  return starts;
}

WeightBroadcaster::WeightBroadcaster(WeightSyncOptions options) : options_(std::move(options)) {
  for (const WeightSyncEngine& engine : options_.engines) {
    rank_offsets_.push_back(world_size_);
    world_size_ += engine.workers;
  }
}

WeightBroadcaster::~WeightBroadcaster() {
  Disconnect();
  for (std::thread& retiring : retiring_) retiring.join();
}

absl::Status WeightBroadcaster::Connect() {
  DestroyPredecessorGroup();
  group_name_ = absl::StrCat("dta-weights-", RandomHex128());
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(options_.port);
  store_options.isServer = true;
  store_options.waitWorkers = false;
  store_options.timeout = options_.timeout;
  int port = 0;
  const absl::Status hosted = Collective([&] {
    store_ = c10::make_intrusive<c10d::TCPStore>(options_.address, store_options);
    port = static_cast<c10d::TCPStore&>(*store_).getPort();
  });
  if (!hosted.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot host the weight group's store on ",
                                               options_.address, ":", options_.port, ": ",
                                               hosted.message()));
  }
  const bool cuda = options_.device.is_cuda();
  // The engines' workers concurrently: each answers once its side of the rendezvous is done.
  std::thread requests;
  absl::Status joined;
  requests = std::thread([&] {
    joined = ForEachEngine(options_.engines.size(), [&](size_t e) {
      const WeightSyncEngine& engine = options_.engines[e];
      return Post(Route(engine, "/init_weights_update_group", "/areal_init_weights_update_group"),
                  {{"master_address", options_.address},
                   {"master_port", std::to_string(port)},  // a string, as AReaL sends it
                   {"rank_offset", rank_offsets_[e]},
                   {"world_size", world_size_},
                   {"backend", cuda ? "nccl" : "gloo"},
                   {"group_name", group_name_}},
                  options_.bearer_token, options_.timeout);
    });
  });
  // torch's init_custom_process_group prefixes the store with the group name, then
  // _new_process_group_helper with "<name>/", then with "<device>/" for the backend: the same
  // keys, so that the engines' Python ranks and this one meet.
  c10::intrusive_ptr<c10d::Store> prefixed = c10::make_intrusive<c10d::PrefixStore>(
      absl::StrCat(group_name_, "/"), c10::make_intrusive<c10d::PrefixStore>(group_name_, store_));
  absl::StatusOr<std::unique_ptr<ProcessGroup>> group = ProcessGroup::CreateWithStore(
      prefixed, /*rank=*/0, world_size_, options_.device,
      {.timeout = options_.timeout, .group_name = cuda ? "cuda/" : "cpu/", .peers_may_fail = true});
  absl::Status sequenced = group.status();
  if (group.ok()) {
    // Gloo's other ranks wait for rank 0's sequence number in the store (NCCL's is a no-op).
    sequenced = Collective([&] { (*group)->backend()->setSequenceNumberForGroup(); });
  }
  requests.join();
  if (group.ok()) group_ = *std::move(group);
  if (!sequenced.ok() || !joined.ok()) {
    const absl::Status failed = !joined.ok() ? joined : sequenced;
    Disconnect();
    return absl::UnavailableError(absl::StrCat("cannot form the weight group ", group_name_, " of ",
                                               world_size_, " ranks: ", failed.message()));
  }
  if (!options_.group_file.empty()) {
    const Json saved = {{"group_name", group_name_}};
    std::error_code missing;
    std::filesystem::remove(options_.group_file, missing);
    if (absl::Status written = CreatePrivateFile(options_.group_file, saved.dump() + "\n");
        !written.ok()) {  // only a crash's leftover group is at stake: the sync goes on
      std::fprintf(stderr, "%s: %s\n", options_.log_prefix.c_str(), written.ToString().c_str());
    }
  }
  std::fprintf(stderr, "%s: weight group %s formed: %d ranks (%s) on port %d\n",
               options_.log_prefix.c_str(), group_name_.c_str(), world_size_,
               cuda ? "NCCL" : "Gloo", port);
  return absl::OkStatus();
}

void WeightBroadcaster::DestroyEngineGroups(const std::string& name) {
  (void)ForEachEngine(options_.engines.size(), [&](size_t e) {
    const WeightSyncEngine& engine = options_.engines[e];
    if (engine.kind != EngineKind::kSglang) return absl::OkStatus();  // AReaL has no such route
    return Post(absl::StrCat(engine.url, "/destroy_weights_update_group"), {{"group_name", name}},
                options_.bearer_token, std::min(options_.timeout, std::chrono::milliseconds(5000)));
  });
}

void WeightBroadcaster::DestroyPredecessorGroup() {
  const std::string& file = options_.group_file;
  std::error_code missing;
  if (file.empty() || !std::filesystem::exists(file, missing)) return;
  // A state file: used only if it is this user's and private (core/base/private_files.h).
  const absl::StatusOr<std::string> text = ReadPrivateFile(file);
  const Json saved = text.ok() ? Json::parse(*text, nullptr, /*allow_exceptions=*/false) : Json();
  if (saved.is_object() && saved.contains("group_name") && saved["group_name"].is_string()) {
    const std::string name = saved["group_name"].get<std::string>();
    std::fprintf(stderr,
                 "%s: asking the engines to destroy weight group %s, left by a trainer "
                 "that did not tear it down (%s)\n",
                 options_.log_prefix.c_str(), name.c_str(), file.c_str());
    DestroyEngineGroups(name);
  } else {
    std::fprintf(stderr, "%s: ignoring %s: %s\n", options_.log_prefix.c_str(), file.c_str(),
                 text.ok() ? "not a weight group file" : text.status().ToString().c_str());
  }
  std::filesystem::remove(file, missing);
}

void WeightBroadcaster::Disconnect() {
  if (group_ != nullptr) {
    // NCCL: abort the communicator, so that nothing waits on a peer that is gone.
    (void)Collective([&] { group_->backend()->abort(); });
    retiring_.emplace_back([group = std::move(group_)]() mutable { group.reset(); });
  }
  if (store_ == nullptr) return;  // no rendezvous since the last teardown
  store_.reset();
  // Also after a failed rendezvous: the engines that joined hold a group of that name.
  DestroyEngineGroups(group_name_);
  std::error_code missing;
  if (!options_.group_file.empty()) std::filesystem::remove(options_.group_file, missing);
}

absl::Status WeightBroadcaster::Publish(const Decoder& model, int64_t policy_version) {
  const auto start = std::chrono::steady_clock::now();
  at::NoGradGuard no_grad;
  ParameterGathers gathers(model);
  absl::Status sent = group_ == nullptr ? Connect() : absl::OkStatus();
  if (sent.ok()) {
    try {
      sent = Broadcast(model, gathers, policy_version);
    } catch (const std::exception& e) {  // e.g. no memory for a bucket: the step goes on
      const c10::Error* error = dynamic_cast<const c10::Error*>(&e);
      sent = absl::UnavailableError(error != nullptr ? error->what_without_backtrace() : e.what());
    }
  }
  // The trainer's own group failed: a restart's matter, not the engines'.
  gathers.RethrowFailure();
  // The sync's outcome is this rank's alone: its peers gather every parameter whatever it is.
  gathers.Rest();
  if (!sent.ok()) {
    Disconnect();
    return sent;
  }
  std::fprintf(stderr, "%s: weights of policy version %lld sent to %zu engines in %.2f s\n",
               options_.log_prefix.c_str(), static_cast<long long>(policy_version),
               options_.engines.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return absl::OkStatus();
}

absl::Status WeightBroadcaster::Broadcast(const Decoder& model, ParameterGathers& gathers,
                                          int64_t policy_version) {
  const size_t engines = options_.engines.size();
  const std::string& token = options_.bearer_token;
  const auto timeout = options_.timeout;
  // SGLang's "retract" keeps running requests (recomputed after the update); AReaL's aborts them.
  const absl::Status paused = ForEachEngine(engines, [&](size_t e) {
    const WeightSyncEngine& engine = options_.engines[e];
    return Post(Route(engine, "/pause_generation", "/areal_pause_generation"),
                engine.kind == EngineKind::kSglang ? Json{{"mode", "retract"}} : Json::object(),
                token, timeout);
  });
  if (!paused.ok()) return absl::UnavailableError(absl::StrCat("pause: ", paused.message()));
  const std::vector<SyncedTensor> tensors = SyncedTensors(model);
  std::vector<int64_t> sizes;
  for (const SyncedTensor& tensor : tensors) sizes.push_back(Bytes(tensor.shape));
  const std::vector<size_t> starts = PackBuckets(sizes, options_.bucket_bytes);
  const size_t buckets = starts.size() - 1;

  // One bucket in flight: its requests' thread, its broadcasts and the bf16 tensors they read.
  struct InFlight {
    size_t bucket = 0;
    std::vector<at::Tensor> staged;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::thread requests;
    absl::Status answered;
  };
  std::unique_ptr<InFlight> in_flight;
  auto finish = [&](InFlight& flight) {
    const std::string what = absl::StrCat("weight bucket ", flight.bucket + 1, " of ", buckets,
                                          " (group ", group_name_, ")");
    absl::Status waited = Collective([&] {
      for (const auto& work : flight.works) group_->Wait(*work, what);
    });
    flight.requests.join();
    if (!flight.answered.ok())
      return absl::UnavailableError(absl::StrCat(what, ": ", flight.answered.message()));
    return waited;
  };
  absl::Status status;
  for (size_t b = 0; b < buckets && status.ok(); ++b) {
    auto next = std::make_unique<InFlight>();
    next->bucket = b;
    Json names = Json::array(), dtypes = Json::array(), shapes = Json::array();
    status = Collective([&] {
      for (size_t i = starts[b]; i < starts[b + 1]; ++i) {
        const SyncedTensor& tensor = tensors[i];
        at::Tensor whole = gathers.Whole(tensor.index);
        if (tensor.expert >= 0) whole = whole[tensor.expert];
        // A bf16 parameter is sent as it is; others are rounded as the checkpoint rounds them.
        next->staged.push_back(whole.to(options_.device, at::kBFloat16).contiguous());
        names.push_back(tensor.name);
        dtypes.push_back("bfloat16");
        shapes.push_back(tensor.shape);
      }
    });
    if (!status.ok()) break;
    if (in_flight != nullptr) {  // the previous bucket's broadcasts ran while this one was packed
      status = finish(*in_flight);
      in_flight.reset();
      if (!status.ok()) break;
    }
    const bool last = b + 1 == buckets;
    next->requests = std::thread([&, flight = next.get(), names, dtypes, shapes, last] {
      flight->answered = ForEachEngine(engines, [&](size_t e) {
        const WeightSyncEngine& engine = options_.engines[e];
        if (engine.kind == EngineKind::kSglang) {
          Json body = {{"names", names},
                       {"dtypes", dtypes},
                       {"shapes", shapes},
                       {"group_name", group_name_},
                       {"flush_cache", last}};
          if (last) body["weight_version"] = std::to_string(policy_version);
          return Post(absl::StrCat(engine.url, "/update_weights_from_distributed"), body, token,
                      timeout);
        }
        if (absl::Status meta = Post(absl::StrCat(engine.url, "/areal_set_update_weight_meta"),
                                     {{"names", names},
                                      {"dtypes", dtypes},
                                      {"shapes", shapes},
                                      {"group_name", group_name_}},
                                     token, timeout);
            !meta.ok()) {
          return meta;
        }
        return Post(absl::StrCat(engine.url, "/areal_update_weights_xccl"), Json::object(), token,
                    timeout);
      });
    });
    status = Collective([&] {
      for (at::Tensor& tensor : next->staged) {
        std::vector<at::Tensor> one = {tensor};
        c10d::BroadcastOptions broadcast;
        broadcast.rootRank = 0;
        broadcast.timeout = timeout;
        next->works.push_back(group_->backend()->broadcast(one, broadcast));
      }
    });
    if (!status.ok()) {
      next->requests.join();
      break;
    }
    in_flight = std::move(next);
  }
  if (in_flight != nullptr) {
    const absl::Status last = finish(*in_flight);
    if (status.ok()) status = last;
  }
  if (!status.ok()) return status;
  const absl::Status continued = ForEachEngine(engines, [&](size_t e) {
    return Post(Route(options_.engines[e], "/continue_generation", "/areal_continue_generation"),
                Json::object(), token, timeout);
  });
  if (!continued.ok())
    return absl::UnavailableError(absl::StrCat("continue: ", continued.message()));
  return absl::OkStatus();
}

void WeightBroadcaster::ReloadFromDisk(const std::string& model_path, int64_t policy_version) {
  (void)ForEachEngine(options_.engines.size(), [&](size_t e) {
    const WeightSyncEngine& engine = options_.engines[e];
    const EngineRequest reload =
        ReloadRequest({.kind = engine.kind, .url = engine.url}, model_path, policy_version);
    absl::Status status =
        Post(reload.url, Json::parse(reload.body), options_.bearer_token, options_.timeout);
    // Continue even after a failed reload: an engine left paused serves nobody.
    const absl::Status continued =
        Post(Route(engine, "/continue_generation", "/areal_continue_generation"), Json::object(),
             options_.bearer_token, options_.timeout);
    if (status.ok()) status = continued;
    const std::string line =
        status.ok() ? absl::StrCat("the engine at ", engine.url, " reloaded policy version ",
                                   policy_version, " from ", model_path)
                    : absl::StrCat("the engine at ", engine.url, ": ", status.message());
    std::fprintf(stderr, "%s: disk fallback: %s\n", options_.log_prefix.c_str(), line.c_str());
    return status;
  });
}

}  // namespace dta
