// Tensor parallelism: a checkpoint's optimizer state, saved by the ranks of one tp group (optimizer.tp-R-of-T
// .safetensors: each rank's slices of the split tensors, and the whole tensors), re-cut for a run at another tp. The
// slices' places come from the files themselves (the "shard.<name>" metadata AdamW::save writes: global shape,
// offset and sections; a box several ranks held is taken once), so nothing about the old layout needs to be known beyond T. Covered
// by tests/e2e/test_train_dp.cpp (TensorParallel.Qwen3EqualsOneProcessAndResumes: tp 2 resumed at tp 1, tp 1 at tp 2
// and tp 4 at tp 2, each on one process's curve).
#pragma once

#include <string>
#include <vector>

#include "core/parameter.h"

namespace lathe {

// The optimizer state file name of rank `rank` of `ranks` of the group that slices the weights: "tp", "ep" (each
// expert-parallel rank its experts), "pp" (each stage its layers) or those joined ("tp-ep", "tp-pp", ...).
std::string slice_state_name(const std::string& group, int rank, int ranks);

// Writes to `out_path` (AdamW::load's format) the masters and moments of `params` — this run's parameters, whole or
// this rank's tp slices (Parameter::shard) — assembled from the old state `files` (a tp group's, in rank order, or one
// whole optimizer.safetensors; a pipeline's stages each hold their own tensors): a tensor whole in the old files from
// the first that holds it, a slice from the boxes of the old files that overlap it. The step counts and
// hyper-parameters are the old files'. Errors name the file and tensor when a piece is missing or the old files do not
// cover a slice.
void reslice_tp_state(const std::vector<std::string>& files, const std::vector<Parameter>& params,
                      const std::string& out_path);

}  // namespace lathe
