// lathe: the one binary. Library code throws lathe::Error; this is the only place that catches, prints
// one clear message and exits non-zero.
#include <cstdio>

#include "commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"lathe: post-training for Qwen-family models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "lathe 0.1.0");
  int exit_code = 0;
  lathe::cli::add_kernels_command(app, exit_code);
  lathe::cli::add_op_check_command(app, exit_code);
  lathe::cli::add_logprobs_command(app, exit_code);
  lathe::cli::add_convert_command(app, exit_code);
  lathe::cli::add_train_command(app, exit_code);
  lathe::cli::add_generate_command(app, exit_code);
  lathe::cli::add_tokenize_command(app, exit_code);
  lathe::cli::add_prepare_command(app, exit_code);
  lathe::cli::add_export_command(app, exit_code);
  lathe::cli::add_bench_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const lathe::Error& e) {
    std::fprintf(stderr, "lathe: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lathe: unexpected error: %s\n", e.what());
    return 2;
  }
  return exit_code;
}
