// The families dta ships, one file each (core/model/families/<model_type>.cc; Qwen3.5's two
// language models share qwen3_5.cc, named for their vision-language model); the registry
// (core/model/family.cc) lists them. Only the registry includes this header: everything else finds
// a family by model_type (FindModelFamily).
#pragma once

#include "core/model/family.h"

namespace dta {

extern const ModelFamily kQwen3Family;
extern const ModelFamily kQwen2Family;
extern const ModelFamily kLlamaFamily;
extern const ModelFamily kQwen3MoeFamily;
extern const ModelFamily kQwen3NextFamily;
extern const ModelFamily kQwen3_5TextFamily;
extern const ModelFamily kQwen3_5MoeTextFamily;

}  // namespace dta
