// lathe: the one binary. Library code throws lathe::Error; this is the only place that catches, prints
// one clear message and exits non-zero. Exit codes: 0 success, 1 an error (lathe::Error, or a file-system error
// naming its path), 2 a usage error (no subcommand, an unknown option, a bad option value), 3 an unexpected internal
// error; `lathe train` exits 4 when some tenants failed.
#include <cstdio>
#include <filesystem>

#include "commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"lathe: post-training for Qwen-family models", "lathe"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "lathe 0.1.0");
  int exit_code = 0;
  lathe::cli::add_kernels_command(app, exit_code);
  lathe::cli::add_op_check_command(app, exit_code);
  lathe::cli::add_logprobs_command(app, exit_code);
  lathe::cli::add_convert_command(app, exit_code);
  lathe::cli::add_train_command(app, exit_code);
  lathe::cli::add_rl_command(app, exit_code);
  lathe::cli::add_generate_command(app, exit_code);
  lathe::cli::add_tokenize_command(app, exit_code);
  lathe::cli::add_prepare_command(app, exit_code);
  lathe::cli::add_export_command(app, exit_code);
  lathe::cli::add_bench_command(app, exit_code);
  lathe::cli::add_plan_command(app, exit_code);
  if (argc < 2) {  // no subcommand: the usage, as a usage error
    std::fputs(app.help().c_str(), stderr);
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help and --version exit 0; every other parse error is a usage error
  } catch (const lathe::Error& e) {
    std::fprintf(stderr, "lathe: error: %s\n", e.what());
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {
    // A file-system call outside the paths checked up front: name the operation's paths and the system's reason.
    std::fprintf(stderr, "lathe: error: %s%s%s: %s\n", e.path1().c_str(), e.path2().empty() ? "" : " -> ",
                 e.path2().c_str(), e.code().message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lathe: unexpected error: %s\n", e.what());
    return 3;
  }
  return exit_code;
}
