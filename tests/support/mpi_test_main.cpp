// The main() of the tests that run under mpirun (tests/parallel): MPI for the whole run, and GoogleTest's report
// printed by rank 0 only (every rank's with LATHE_TEST_ALL_RANKS=1 in the environment, to see another rank's failure);
// every rank's failures still fail the job through the exit code.
#include <gtest/gtest.h>

#include <cstdlib>

#include "comm/mpi_communicator.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  lathe::MpiSession mpi;
  if (mpi.rank() != 0 && !std::getenv("LATHE_TEST_ALL_RANKS"))
    delete ::testing::UnitTest::GetInstance()->listeners().Release(
        ::testing::UnitTest::GetInstance()->listeners().default_result_printer());
  return RUN_ALL_TESTS();
}
