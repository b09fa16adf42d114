/* SPDX-License-Identifier: MIT */
/*
 * The APE seed's suggested initial parameters (README.md, "Tools"), the defaults of every tool
 * that needs APE parameters without being told (ape-run, ape-bench, ape-check, ape-curve, and
 * ape-mpi-run with ape-run's options on files): delta = 2^(-4/3), ALiBi's slope; beta = gamma =
 * delta / 10; lambda = 0.1. The library has no preference: ape_attn_desc_init() sets all four to
 * 0, plain RoPE attention. Help texts print these constants, not a copy of their digits.
 */
#ifndef APE_TOOLS_SEED_H
#define APE_TOOLS_SEED_H

/* 2^(-4/3) to the last bit of a double: pow(2, -4.0 / 3) gives this same value */
#define SEED_DELTA 0.3968502629920499
#define SEED_BETA (SEED_DELTA / 10)
#define SEED_GAMMA (SEED_DELTA / 10)
#define SEED_LAMBDA 0.1

/* The four in the order of ape_attn_desc and of --dparams' columns (delta, beta, gamma,
 * lambda): an initializer for a float[4] or double[4]. */
#define SEED_PARAMS { SEED_DELTA, SEED_BETA, SEED_GAMMA, SEED_LAMBDA }

#endif
