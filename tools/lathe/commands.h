// The lathe CLI's subcommands: each file cmd_<name>.cpp adds one subcommand to the CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

namespace lathe::cli {

// Each add_* registers its subcommand; the callback runs it and sets the exit code.
void add_kernels_command(CLI::App& app, int& exit_code);
void add_op_check_command(CLI::App& app, int& exit_code);
void add_logprobs_command(CLI::App& app, int& exit_code);
void add_convert_command(CLI::App& app, int& exit_code);
void add_train_command(CLI::App& app, int& exit_code);
void add_generate_command(CLI::App& app, int& exit_code);
void add_tokenize_command(CLI::App& app, int& exit_code);
void add_prepare_command(CLI::App& app, int& exit_code);
void add_export_command(CLI::App& app, int& exit_code);
void add_bench_command(CLI::App& app, int& exit_code);
void add_rl_command(CLI::App& app, int& exit_code);
void add_plan_command(CLI::App& app, int& exit_code);

}  // namespace lathe::cli
