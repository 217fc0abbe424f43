// The files an inference engine reads beside a model's weights and config.json: the tokenizer's
// and generation_config.json (stop tokens, sampling defaults). A published checkpoint copies them
// from the Hugging Face directory the model was loaded from, so SGLang, vLLM and transformers load
// it as they would load the original.
//
//   ASSIGN_OR_RETURN(std::vector<std::string> copied,
//                    CopyModelCompanionFiles("/models/Qwen3-8B", "/ckpt/step-7/model"));
#pragma once

#include <array>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dta {

// The tokenizer files transformers' tokenizers read and save (fast and slow tokenizers, chat
// templates); every other file of a model directory is left behind.
inline constexpr std::array<const char*, 9> kTokenizerFiles = {
    "tokenizer.json",  "tokenizer_config.json",   "vocab.json",
    "merges.txt",      "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "chat_template.jinja",     "chat_template.json"};

inline constexpr char kGenerationConfigFile[] = "generation_config.json";

// Copies into `destination` (which must exist) each of kTokenizerFiles that `source` has, and its
// generation_config.json. When there is no source (empty) or it has no generation_config.json, one
// is written as transformers derives it from a model config: {"_from_model_config": true} plus
// bos_token_id / eos_token_id / pad_token_id where the source's config.json names them. Returns the
// names written, sorted. UNAVAILABLE naming the file that cannot be read or written; NOT_FOUND if
// `source` is given but is not a directory.
absl::StatusOr<std::vector<std::string>> CopyModelCompanionFiles(const std::string& source,
                                                                 const std::string& destination);

}  // namespace dta
