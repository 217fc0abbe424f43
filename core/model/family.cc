#include "core/model/family.h"

#include <algorithm>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/base/absl_string_view.h"
#include "core/model/families/families.h"

namespace dta {
namespace {

// The registry: one line per family, in the order ModelPresetNames lists their presets.
constexpr const ModelFamily* kBuiltInFamilies[] = {
    &kQwen3Family,     &kQwen2Family,       &kLlamaFamily,          &kQwen3MoeFamily,
    &kQwen3NextFamily, &kQwen3_5TextFamily, &kQwen3_5MoeTextFamily,
};

class Registry {
 public:
  std::vector<const ModelFamily*> All() const ABSL_LOCKS_EXCLUDED(mutex_) {
    absl::ReaderMutexLock lock(&mutex_);
    return families_;
  }

  // The family whose `type` field is `model_type`.
  const ModelFamily* Find(std::string_view ModelFamily::*type, std::string_view model_type) const
      ABSL_LOCKS_EXCLUDED(mutex_) {
    absl::ReaderMutexLock lock(&mutex_);
    for (const ModelFamily* family : families_) {
      if (!model_type.empty() && family->*type == model_type) return family;
    }
    return nullptr;
  }

  absl::Status Add(const ModelFamily* family) ABSL_LOCKS_EXCLUDED(mutex_) {
    absl::MutexLock lock(&mutex_);
    for (const ModelFamily* known : families_) {
      if (known->model_type == family->model_type) {
        return absl::AlreadyExistsError(
            absl::StrCat("model_type '", AsAbsl(family->model_type), "' is already registered"));
      }
      for (const ModelPresetShape& ours : family->presets) {
        for (const ModelPresetShape& theirs : known->presets) {
          if (std::string_view(ours.name) == theirs.name) {
            return absl::AlreadyExistsError(
                absl::StrCat("preset '", ours.name, "' of ", AsAbsl(family->model_type),
                             " is already one of ", AsAbsl(known->model_type)));
          }
        }
      }
    }
    families_.push_back(family);
    return absl::OkStatus();
  }

 private:
  mutable absl::Mutex mutex_;
  std::vector<const ModelFamily*> families_ ABSL_GUARDED_BY(mutex_) = {std::begin(kBuiltInFamilies),
                                                                       std::end(kBuiltInFamilies)};
};

Registry& TheRegistry() {
  static Registry* registry = new Registry();  // never destroyed: used until exit
  return *registry;
}

std::vector<const ModelFamily*> SortedByModelType() {
  std::vector<const ModelFamily*> families = TheRegistry().All();
  std::sort(families.begin(), families.end(), [](const ModelFamily* a, const ModelFamily* b) {
    return a->model_type < b->model_type;
  });
  return families;
}

}  // namespace

const ModelFamily* FindModelFamily(std::string_view model_type) {
  return TheRegistry().Find(&ModelFamily::model_type, model_type);
}

const ModelFamily* FindModelFamilyByMultimodalType(std::string_view model_type) {
  return TheRegistry().Find(&ModelFamily::multimodal_model_type, model_type);
}

std::vector<const ModelFamily*> ModelFamilies() { return TheRegistry().All(); }

std::vector<std::string> ModelFamilyTypes() {
  std::vector<std::string> types;
  for (const ModelFamily* family : SortedByModelType()) types.emplace_back(family->model_type);
  return types;
}

std::string DescribeModelFamilies() {
  std::string out;
  for (const ModelFamily* family : SortedByModelType()) {
    if (!out.empty()) out += ", ";
    out += std::string(family->model_type) + " (" + std::string(family->name) + ")";
  }
  return out;
}

absl::Status RegisterModelFamily(const ModelFamily* family) {
  if (family == nullptr || family->model_type.empty()) {
    return absl::InvalidArgumentError("RegisterModelFamily: a family needs a model_type");
  }
  return TheRegistry().Add(family);
}

}  // namespace dta
