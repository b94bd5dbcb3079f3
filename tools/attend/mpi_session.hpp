// mpi_session.hpp: MPI for the CLI's commands: initialized by the first command that needs it
// (a program may run several commands in-process) and finalized when the process exits.
// Without mpirun, MPI starts as a single rank.
#pragma once

#include <mpi.h>

#include <cstdlib>

#include "attend/error.hpp"

namespace attend::cli {

inline void ensure_mpi() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) throw Error("MPI was finalized already in this process");
  if (initialized) return;
  if (MPI_Init(nullptr, nullptr) != MPI_SUCCESS) throw Error("MPI_Init failed");
  std::atexit([] {
    int done = 0;
    MPI_Finalized(&done);
    if (!done) MPI_Finalize();
  });
}

}  // namespace attend::cli
