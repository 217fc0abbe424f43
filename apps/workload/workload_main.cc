// dta-workload: writes a synthetic rollout batch shaped like one of the papers' workloads (see
// core/workload/workload.h for the presets) as JSON Lines, one rollout per line, readable by
// dta-tree and ReadRolloutsJsonl.
//
//   dta-workload --preset=tau2 --seed=1 --out=FILE.jsonl [--scale=1.0] [--vocab_size=151936]
//
// Prints a one-line summary (rollouts, tokens, C) to stderr. The same flags always write the same
// file. Exit status: 0 on success, 1 if the file cannot be written, 2 on a bad flag value
// (unknown preset, scale <= 0, no --out, stray arguments). Malformed flags Abseil itself rejects
// (an unknown flag, --scale=abc) exit with Abseil's status 1.
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "core/base/exit_codes.h"
#include "core/cli/usage.h"
#include "core/io/rollout_jsonl.h"
#include "core/tree/prefix_tree.h"
#include "core/tree/tree_stats.h"
#include "core/workload/workload.h"

ABSL_FLAG(
    std::string, preset, "tau2",
    "tau2, gsm8k, aime, modified-prefix, branch-low, branch-mid, branch-high or long-agentic");
ABSL_FLAG(uint64_t, seed, 1, "random seed: the same seed always gives the same batch");
ABSL_FLAG(double, scale, 1.0, "multiplies the number of groups (tasks, prompts, trees); > 0");
ABSL_FLAG(int32_t, vocab_size, dta::WorkloadOptions{}.vocab_size,
          "token ids are drawn from [0, vocab_size)");
ABSL_FLAG(std::string, out, "", "the JSON Lines file to write (required)");

namespace dta {
namespace {

int Run() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::cerr << "dta-workload: --out is required\n" << absl::ProgramUsageMessage() << "\n";
    return kExitBadInput;
  }
  absl::StatusOr<WorkloadPreset> preset = ParseWorkloadPreset(absl::GetFlag(FLAGS_preset));
  if (!preset.ok()) {
    std::cerr << "dta-workload: --preset: " << preset.status().message() << "\n";
    return kExitBadInput;
  }
  const WorkloadOptions options = {.preset = *preset,
                                   .seed = absl::GetFlag(FLAGS_seed),
                                   .scale = absl::GetFlag(FLAGS_scale),
                                   .vocab_size = absl::GetFlag(FLAGS_vocab_size)};
  // Every way GenerateWorkload can fail is a bad option value.
  absl::StatusOr<std::vector<Rollout>> rollouts = GenerateWorkload(options);
  if (!rollouts.ok()) {
    std::cerr << "dta-workload: " << rollouts.status().message() << "\n";
    return kExitBadInput;
  }
  if (absl::Status written = WriteRolloutsJsonl(out, *rollouts); !written.ok()) {
    std::cerr << "dta-workload: " << written.message() << "\n";
    return kExitError;
  }

  std::vector<std::vector<TokenId>> tokens;
  tokens.reserve(rollouts->size());
  for (const Rollout& r : *rollouts) tokens.push_back(r.tokens);
  absl::StatusOr<PrefixTree> tree = PrefixTree::FromRollouts(tokens);
  if (!tree.ok()) {  // cannot happen for generated rollouts; report rather than crash
    std::cerr << "dta-workload: " << tree.status().message() << "\n";
    return kExitError;
  }
  const TreeStats s = ComputeTreeStats(*tree);
  std::cerr << absl::StrFormat(
      "dta-workload: %s seed %d scale %g: %d rollouts, %d tokens, %d tree tokens, C %.3f, "
      "leaf-only C %.3f, POR %.3f, longest %d -> %s\n",
      WorkloadPresetName(*preset), options.seed, options.scale, s.num_rollouts, s.rollout_tokens,
      s.tree_tokens, s.compression, s.leaf_compression, s.potential_overlap_ratio,
      s.longest_rollout, out);
  return 0;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) {
  dta::SetProgramUsage(
      "dta-workload --preset=tau2 --seed=1 --out=FILE.jsonl [--scale=1.0] [--vocab_size=N]");
  const std::vector<char*> args = dta::ParseCommandLine(argc, argv);
  if (args.size() > 1) {
    std::cerr << "dta-workload: unexpected argument '" << args[1] << "'\n"
              << absl::ProgramUsageMessage() << "\n";
    return dta::kExitBadInput;
  }
  return dta::Run();
}
