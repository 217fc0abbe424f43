#include "core/checkpoint/model_files.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/checkpoint/atomic_file.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// What transformers' GenerationConfig.from_model_config keeps of a config.json.
absl::StatusOr<std::string> DerivedGenerationConfig(const std::string& source) {
  Json generation = {{"_from_model_config", true}};
  const fs::path config = fs::path(source) / "config.json";
  if (!source.empty() && fs::exists(config)) {
    ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(config.string()));
    const Json json = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (json.is_object()) {
      for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
        if (auto it = json.find(key); it != json.end() && !it->is_null()) generation[key] = *it;
      }
    }
  }
  return generation.dump(2) + "\n";
}

}  // namespace

absl::StatusOr<std::vector<std::string>> CopyModelCompanionFiles(const std::string& source,
                                                                 const std::string& destination) {
  std::error_code error;
  if (!source.empty() && !fs::is_directory(source, error)) {
    return absl::NotFoundError(
        absl::StrCat(source, ": not a model directory (its tokenizer files are copied)"));
  }
  std::vector<std::string> written;
  std::vector<const char*> names(kTokenizerFiles.begin(), kTokenizerFiles.end());
  names.push_back(kGenerationConfigFile);
  for (const char* name : names) {
    const fs::path from = fs::path(source) / name;
    if (source.empty() || !fs::is_regular_file(from, error)) continue;
    ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(from.string()));
    RETURN_IF_ERROR(WriteTextAtomically((fs::path(destination) / name).string(), text));
    written.push_back(name);
  }
  if (std::find(written.begin(), written.end(), kGenerationConfigFile) == written.end()) {
    ASSIGN_OR_RETURN(const std::string text, DerivedGenerationConfig(source));
    RETURN_IF_ERROR(
        WriteTextAtomically((fs::path(destination) / kGenerationConfigFile).string(), text));
    written.push_back(kGenerationConfigFile);
  }
  std::sort(written.begin(), written.end());
  return written;
}

}  // namespace dta
