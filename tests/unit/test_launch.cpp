// comm/launch.h launch_env: rank, world size, rank on the node and rendezvous from each launcher's environment —
// `lathe --nproc` (LATHE_*), mpirun (OMPI_COMM_WORLD_*), srun (SLURM_*, with the job and step ids), PMIx — in that
// order of precedence; an salloc shell (SLURM_NTASKS without SLURM_PROCID) is a world of one; bad values are errors
// naming the variable.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>

#include "comm/launch.h"
#include "core/error.h"
#include "support/error_of.h"

using lathe::LaunchEnv;
using lathe::launch_env;
using lathe::test_support::error_of;

namespace {

// Sets exactly `vars` among the variables launch_env reads (the others unset) for the test's scope.
class Env {
 public:
  explicit Env(const std::map<std::string, std::string>& vars) {
    for (const char* name : kAll) unsetenv(name);
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~Env() {
    for (const char* name : kAll) unsetenv(name);
  }

 private:
  static constexpr const char* kAll[] = {"LATHE_WORLD", "LATHE_RANK", "LATHE_LOCAL_RANK", "LATHE_RENDEZVOUS",
                                         "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                         "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID",
                                         "SLURM_STEP_ID", "PMIX_SIZE", "PMIX_RANK", "PMIX_LOCAL_RANK", "PMI_SIZE"};
};

}  // namespace

TEST(LaunchEnv, ReadsEachLauncher) {
  struct Case {
    std::map<std::string, std::string> vars;
    LaunchEnv want;
  };
  const Case cases[] = {
      {{}, {0, 1, 0, "none", "", ""}},
      {{{"LATHE_WORLD", "4"}, {"LATHE_RANK", "2"}, {"LATHE_LOCAL_RANK", "2"}, {"LATHE_RENDEZVOUS", "/tmp/r"}},
       {2, 4, 2, "lathe --nproc", "/tmp/r", ""}},
      {{{"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}},
       {5, 8, 1, "mpirun", "", ""}},
      {{{"SLURM_NTASKS", "16"}, {"SLURM_PROCID", "9"}, {"SLURM_LOCALID", "1"}, {"SLURM_JOB_ID", "4711"},
        {"SLURM_STEP_ID", "3"}, {"LATHE_RENDEZVOUS", "/shared/rdv"}},
       {9, 16, 1, "srun", "/shared/rdv", "4711.3"}},
      {{{"PMIX_RANK", "3"}, {"PMI_SIZE", "4"}, {"PMIX_LOCAL_RANK", "0"}}, {3, 4, 0, "pmix", "", ""}},
  };
  for (const Case& c : cases) {
    const Env env(c.vars);
    const LaunchEnv e = launch_env();
    EXPECT_EQ(e.launcher, c.want.launcher);
    EXPECT_EQ(e.world, c.want.world) << c.want.launcher;
    EXPECT_EQ(e.rank, c.want.rank) << c.want.launcher;
    EXPECT_EQ(e.local_rank, c.want.local_rank) << c.want.launcher;
    EXPECT_EQ(e.rendezvous, c.want.rendezvous) << c.want.launcher;
    EXPECT_EQ(e.job, c.want.job) << c.want.launcher;
  }
}

TEST(LaunchEnv, PrecedenceAndAnAllocationShell) {
  {
    const Env env({{"LATHE_WORLD", "2"}, {"LATHE_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"SLURM_NTASKS", "4"},
                   {"SLURM_PROCID", "3"}});
    EXPECT_EQ(launch_env().launcher, "lathe --nproc");
  }
  {
    const Env env({{"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_PROCID", "3"}});
    EXPECT_EQ(launch_env().launcher, "mpirun");  // mpirun inside a Slurm allocation
  }
  {
    const Env env(std::map<std::string, std::string>{{"SLURM_NTASKS", "4"}});  // salloc's shell: an allocation, not a task of srun
    EXPECT_EQ(launch_env().world, 1);
  }
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  {
    const Env env({{"SLURM_NTASKS", "4"}, {"SLURM_PROCID", "abc"}});
    EXPECT_NE(error_of([] { launch_env(); }).find("SLURM_PROCID=abc is not a rank or size"), std::string::npos);
  }
  {
    const Env env({{"SLURM_NTASKS", "4"}, {"SLURM_PROCID", "4"}});
    EXPECT_NE(error_of([] { launch_env(); }).find("rank 4 is not in a world of 4 (srun)"), std::string::npos);
  }
  {
    const Env env(std::map<std::string, std::string>{{"LATHE_WORLD", "-2"}});
    EXPECT_NE(error_of([] { launch_env(); }).find("LATHE_WORLD=-2"), std::string::npos);
  }
}
