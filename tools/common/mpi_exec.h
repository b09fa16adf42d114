/* SPDX-License-Identifier: MIT */
/*
 * `ape-run --mpi` and `ape-bench --mpi`: libape never depends on MPI, so neither do the tools;
 * with --mpi they replace themselves with the MPI driver, ape-mpi-run (built next to them when
 * libape_mpi is: WITH_MPI), which takes their options (docs/distributed.md, "Tools").
 */
#ifndef APE_TOOLS_MPI_EXEC_H
#define APE_TOOLS_MPI_EXEC_H

/**
 * When argv holds "--mpi", execs ape-mpi-run from this program's directory with \p mode
 * ("--files" for ape-run, "--bench" for ape-bench) and every other argument, in the same process (so under mpirun each rank
 * becomes a rank of the driver). Returns -1 when there is no "--mpi"; otherwise only on failure,
 * with the exit status (3: this build has no MPI driver) after a message on stderr.
 */
int tools_mpi_exec(const char *tool, int argc, char **argv, const char *mode);

#endif
