// A run's output folder before the run touches it: what it holds, and what this start will do with it. The rule
// (docs/training.md, "Re-running into an output folder"):
// - a new or empty folder: a fresh run;
// - overwrite: true deletes the earlier run first (refused for a folder that holds files but no Lathe run);
// - resume: auto continues the run from its newest complete checkpoint; a run at train.max_steps whose final model
//   (and final evaluation, when configured) is written is finished, and nothing is done;
// - resume: none into a folder that holds anything is refused, naming the ways out;
// - resume: PATH inside the folder's checkpoints rewinds the run to that checkpoint (newer checkpoints and the final
//   model are removed, so every later command sees one run); PATH elsewhere needs an empty folder, or overwrite.
// inspect_run_folder and plan_start only read; apply_start makes the changes. Covered by tests/e2e/test_train.cpp
// (the Rerun* tests).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace lathe {

struct RunFolder {
  std::filesystem::path dir;
  bool holds_files = false;  // anything at all in it
  bool is_run = false;       // a Lathe run's files: config.resolved.json, metrics.jsonl or checkpoints/
  std::string latest;        // newest complete checkpoint ("" when none)
  int64_t latest_step = 0;
  bool has_final = false;       // final/ holds a model or an adapter
  bool has_final_eval = false;  // metrics.jsonl records a final evaluation at latest_step
  // From metrics.jsonl, for the summary of a finished run.
  double first_loss = 0, last_loss = 0, final_eval_accuracy = -1;
};

// Reads what `dir` holds (nothing when it does not exist); an error names a path that is not a folder.
RunFolder inspect_run_folder(const std::filesystem::path& dir, const std::string& who);

struct StartPlan {
  std::string resume_from;                    // checkpoint to continue from ("" = a fresh start)
  bool clear = false;                         // overwrite: the folder's contents go first
  std::vector<std::filesystem::path> remove;  // rewind: checkpoints newer than resume_from, and final/
  bool training_done = false;                 // resume_from is at max_steps
};

// The start this folder allows under `resume` and `overwrite`, or an error naming the folder and the ways out.
// `max_steps` <= 0 skips the finished-run checks (a shared folder of several tenants).
StartPlan plan_start(const RunFolder& folder, const std::string& resume, bool overwrite, int64_t max_steps,
                     const std::string& who);

// Deletes what the plan deletes and the temporaries of interrupted saves; creates the folder.
void apply_start(const RunFolder& folder, const StartPlan& plan, const std::string& who);

}  // namespace lathe
