// The supervised fine-tuning loop behind `lathe train`: model (loaded or from scratch), packed data,
// AdamW with fp32 masters, LR schedule, clipping, NaN/Inf guard, periodic evaluation, atomic checkpoints
// with automatic resume, metrics.jsonl + TensorBoard, a progress line, and a final HF export.
// Checkpoint layout: OUTPUT/checkpoints/step-NNNNNNNN/{model/, optimizer.safetensors, trainer_state.json};
// a checkpoint is written under a temporary name and renamed when complete, so any step-* folder is whole.
// Covered by tests/e2e/test_train.cpp (loss falls, kill -9 and resume reproduce the losses bitwise on CPU,
// crash during save, bad configs).
#pragma once

#include <string>

#include "train/config.h"

namespace lathe {

struct TrainSummary {
  int64_t steps_run = 0;      // steps run by this invocation
  int64_t final_step = 0;
  double first_loss = 0, last_loss = 0;
  double final_eval_accuracy = -1;  // -1 when no final_eval.file
};

TrainSummary run_training(const TrainConfig& config);

// Newest complete checkpoint folder in `output_dir`, or "" when there is none.
std::string latest_checkpoint(const std::string& output_dir);

}  // namespace lathe
