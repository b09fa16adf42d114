/* SPDX-License-Identifier: MIT */
/* `ape-run --mpi` inside ape-mpi-run (mpi/mpi-files.c): ape-run's options on .npy files, every
 * rank reading and writing only its own rows. */
#ifndef APE_MPI_FILES_H
#define APE_MPI_FILES_H

/* The whole program for `ape-mpi-run --files ARGS` (argv[0] the program, ARGS from argv[1]):
 * MPI_Init to MPI_Finalize; returns the exit status. */
int ape_mpi_files_main(int argc, char **argv);

#endif
