// The main() of the tests that run under mpirun (tests/parallel): MPI for the whole run, and GoogleTest's report
// printed by rank 0 only; every rank's failures still fail the job through the exit code.
#include <gtest/gtest.h>

#include "comm/mpi_communicator.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  lathe::MpiSession mpi;
  if (mpi.rank() != 0)
    delete ::testing::UnitTest::GetInstance()->listeners().Release(
        ::testing::UnitTest::GetInstance()->listeners().default_result_printer());
  return RUN_ALL_TESTS();
}
