#include "train/run_folder.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "core/error.h"
#include "core/files.h"
#include "train/trainer.h"

namespace lathe {

namespace fs = std::filesystem;

namespace {

// The metrics of the run: its first and last step losses and the final evaluation at `step`, if any.
void read_metrics(const fs::path& file, int64_t step, RunFolder& f) {
  if (!fs::is_regular_file(file)) return;
  std::istringstream in(read_text_file(file.string(), "train"));
  bool first = true;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;
    if (j.contains("loss") && j["loss"].is_number() && !j.contains("skipped")) {
      if (first) f.first_loss = j["loss"].get<double>();
      f.last_loss = j["loss"].get<double>();
      first = false;
    }
    if (j.contains("final_eval_accuracy") && j["step"].get<int64_t>() == step) {
      f.has_final_eval = true;
      f.final_eval_accuracy = j["final_eval_accuracy"].is_number() ? j["final_eval_accuracy"].get<double>() : -1;
    }
  }
}

int64_t checkpoint_step(const std::string& checkpoint) {
  std::ifstream f(fs::path(checkpoint) / "trainer_state.json");
  const nlohmann::json state = nlohmann::json::parse(f, nullptr, false);
  LATHE_CHECK(!state.is_discarded() && state.is_object() && state.contains("step") && state["step"].is_number_integer(),
              "train: {}/trainer_state.json is not a trainer state (no integer \"step\")", checkpoint);
  return state["step"].get<int64_t>();
}

bool inside(const fs::path& path, const fs::path& dir) {
  const fs::path p = fs::weakly_canonical(fs::absolute(path)), d = fs::weakly_canonical(fs::absolute(dir));
  const auto [end, _] = std::mismatch(d.begin(), d.end(), p.begin(), p.end());
  return end == d.end();
}

std::string describe(const RunFolder& f) {
  if (!f.is_run) return "files that are not a Lathe run's";
  std::string s = "a run";
  if (!f.latest.empty()) s += fmt::format(" with checkpoints up to step {}", f.latest_step);
  if (f.has_final) s += f.latest.empty() ? " with a final model" : " and a final model";
  return s;
}

}  // namespace

RunFolder inspect_run_folder(const fs::path& dir, const std::string& who) {
  RunFolder f;
  f.dir = dir;
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (!fs::exists(st)) return f;
  LATHE_CHECK(fs::is_directory(st), "{}: output_dir {} exists and is not a folder", who, dir.string());
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    f.holds_files = true;
    const std::string name = e.path().filename().string();
    if (name == "config.resolved.json" || name == "metrics.jsonl" || name == "checkpoints") f.is_run = true;
  }
  LATHE_CHECK(!ec, "{}: cannot list output_dir {}: {}", who, dir.string(), ec.message());
  f.latest = latest_checkpoint(dir.string());
  if (!f.latest.empty()) f.latest_step = checkpoint_step(f.latest);
  f.has_final = fs::exists(dir / "final/config.json") || fs::exists(dir / "final/adapter_config.json");
  read_metrics(dir / "metrics.jsonl", f.latest_step, f);
  return f;
}

StartPlan plan_start(const RunFolder& f, const std::string& resume, bool overwrite, int64_t max_steps,
                     const std::string& who) {
  const std::string dir = f.dir.string();
  const std::string ways = "set resume: auto to continue it, overwrite: true to delete it and start again, or choose "
                           "another output_dir";
  StartPlan p;
  const bool explicit_checkpoint = resume != "auto" && resume != "none";
  if (overwrite) {
    LATHE_CHECK(!f.holds_files || f.is_run, "{}: overwrite: output_dir {} holds files that are not a Lathe run's; "
                "refusing to delete them (choose an empty or new folder)", who, dir);
    LATHE_CHECK(!explicit_checkpoint || !inside(resume, f.dir), "{}: overwrite: true would delete the checkpoint that "
                "resume names ({})", who, resume);
    p.clear = f.holds_files;
    if (explicit_checkpoint) p.resume_from = resume;
  } else if (resume == "none") {
    LATHE_CHECK(!f.holds_files, "{}: resume: none, but output_dir {} already holds {}: {}", who, dir, describe(f), ways);
  } else if (resume == "auto") {
    LATHE_CHECK(!f.holds_files || f.is_run, "{}: output_dir {} is not empty and holds no Lathe run: choose an empty or "
                "new folder", who, dir);
    p.resume_from = f.latest;
  } else if (inside(resume, f.dir / "checkpoints")) {
    // Rewind: the checkpoints after this one and the final model belong to the run being abandoned.
    p.resume_from = resume;
    const int64_t step = checkpoint_step(resume);
    for (const auto& e : fs::directory_iterator(f.dir / "checkpoints")) {
      const std::string name = e.path().filename().string();
      if (std::regex_match(name, std::regex("step-[0-9]{8}")) && std::stoll(name.substr(5)) > step) p.remove.push_back(e.path());
    }
    if (step < f.latest_step) p.remove.push_back(f.dir / "final");
  } else {
    LATHE_CHECK(!f.holds_files, "{}: resume: {} starts a new run from that checkpoint, but output_dir {} already "
                "holds {}: choose an empty or new output_dir, or set overwrite: true", who, resume, dir, describe(f));
    p.resume_from = resume;
  }
  if (!p.resume_from.empty()) {
    LATHE_CHECK(fs::exists(fs::path(p.resume_from) / "trainer_state.json"),
                "{}: resume: {} is not a complete checkpoint (no trainer_state.json)", who, p.resume_from);
    const int64_t step = checkpoint_step(p.resume_from);
    if (max_steps > 0) {
      LATHE_CHECK(step <= max_steps, "{}: the run in {} is at step {}, past train.max_steps ({}): raise train.max_steps "
                  "to continue it, or set overwrite: true to start again", who, dir, step, max_steps);
      p.training_done = step == max_steps;
    }
  }
  return p;
}

void apply_start(const RunFolder& f, const StartPlan& p, const std::string& who) {
  std::error_code ec;
  if (p.clear && fs::is_directory(f.dir))  // (a tenant's folder inside the run's may be gone already)
    for (const auto& e : fs::directory_iterator(f.dir)) {
      fs::remove_all(e.path(), ec);
      LATHE_CHECK(!ec, "{}: overwrite: cannot delete {}: {}", who, e.path().string(), ec.message());
    }
  for (const fs::path& r : p.remove) {
    fs::remove_all(r, ec);
    LATHE_CHECK(!ec, "{}: cannot delete {}: {}", who, r.string(), ec.message());
  }
  make_dirs(f.dir, who);
  // Temporaries of saves a crash interrupted.
  for (const fs::path& d : {f.dir, f.dir / "checkpoints"}) {
    if (!fs::is_directory(d)) continue;
    for (const auto& e : fs::directory_iterator(d))
      if (e.path().filename().string().find(".tmp-") != std::string::npos) fs::remove_all(e.path(), ec);
  }
}

}  // namespace lathe
