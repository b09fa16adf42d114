/* SPDX-License-Identifier: MIT */
/* ape-mpi-run's command line (mpi/driver/driver.h): the options, also under ape-bench's names,
 * and --help. */
#include <stdio.h>
#include <string.h>

#include "common/cli.h"
#include "common/seed.h"
#include "driver.h"

enum {
	OPT_SUITE = 1, OPT_L, OPT_B, OPT_H, OPT_HKV, OPT_D, OPT_DTYPE, OPT_OUT_F32, OPT_SHARD,
	OPT_NONCAUSAL, OPT_DECAY, OPT_Q_START, OPT_K_START, OPT_SKIP_TOL, OPT_BACKEND, OPT_CHECK,
	OPT_SEED, OPT_CORRUPT, OPT_CORRUPT_RANK, OPT_QUIET, OPT_HELP, OPT_BACKWARD, OPT_DLSE,
	OPT_NDEV, OPT_DELTA, OPT_BETA, OPT_GAMMA, OPT_LAMBDA, OPT_CHUNK
};

static const struct cli_option options[] = {
	/* the second names are ape-bench's: ape-bench --mpi execs ape-mpi-run with its arguments */
	{ "--suite", NULL, true, OPT_SUITE },	      { "-L", "--len", true, OPT_L },
	{ "-B", "--batch", true, OPT_B },	      { "-H", "--heads", true, OPT_H },
	{ "--hkv", "--kv-heads", true, OPT_HKV },     { "-D", "--head-dim", true, OPT_D },
	{ "--dtype", NULL, true, OPT_DTYPE },	      { "--out-f32", NULL, false, OPT_OUT_F32 },
	{ "--shard", NULL, true, OPT_SHARD },	      { "--noncausal", "--no-causal", false, OPT_NONCAUSAL },
	{ "--decay", NULL, true, OPT_DECAY },	      { "--q-start", NULL, true, OPT_Q_START },
	{ "--k-start", NULL, true, OPT_K_START },     { "--skip-tol", NULL, true, OPT_SKIP_TOL },
	{ "--backend", NULL, true, OPT_BACKEND },     { "--check", NULL, false, OPT_CHECK },
	{ "--seed", NULL, true, OPT_SEED },	      { "--corrupt", NULL, true, OPT_CORRUPT },
	{ "--corrupt-rank", NULL, true, OPT_CORRUPT_RANK },
	{ "--quiet", NULL, false, OPT_QUIET },	      { "--help", "-h", false, OPT_HELP },
	{ "--backward", NULL, false, OPT_BACKWARD },  { "--dlse", NULL, false, OPT_DLSE },
	{ "--ndev", NULL, true, OPT_NDEV },
	{ "--delta", NULL, true, OPT_DELTA },	      { "--beta", NULL, true, OPT_BETA },
	{ "--gamma", NULL, true, OPT_GAMMA },	      { "--lambda", NULL, true, OPT_LAMBDA },
	{ "--chunk", NULL, true, OPT_CHUNK },
	{ NULL, NULL, false, 0 },
};

static const char *const corruptions[] = { "delta", "causal", "k_start", "kind", "rank",
					    "stride", "null", "L", "budget", "bwd-delta",
					    "bwd-dout", "bwd-want", "table" };

void driver_usage(FILE *f)
{
	fprintf(f, "usage: mpirun -np N ape-mpi-run [--suite N | options]\n"
		   "  -L N -B N -H N --hkv N -D N --dtype f32|f16|bf16 --out-f32\n"
		   "  --shard contiguous|zigzag --noncausal --decay seed|zero|DELTA\n"
		   "  --q-start N --k-start N --skip-tol X --backend ref|opencl|auto\n"
		   "  --check --seed N --corrupt delta|causal|k_start|kind|rank|stride|null|L|budget|\n"
		   "                             bwd-delta|bwd-dout|bwd-want|table\n"
		   "  --corrupt-rank R --quiet --help --version\n"
		   "  --backward (the distributed backward after the forward) --dlse (with dL/dLSE)\n"
		   "  --ndev N (the forward on the selected device N times, 1..8)\n"
		   "  --delta X --beta X --gamma X --lambda X (after --decay, which sets all four)\n"
		   "  --chunk N (most rows per chunk of each local call; the backward's sub-blocks)\n"
		   "ape-bench --mpi runs this with ape-bench's arguments (--len, --heads, --kv-heads,\n"
		   "--head-dim, --batch, --no-causal are the names above); ape-run --mpi runs\n"
		   "'ape-mpi-run --files ARGS' (ape-run's options on .npy files: --files --help).\n");
}

/* --decay: the seed's parameters, none, or a delta with the seed's ratios */
static int parse_decay(const char *v, struct cfg *c, char *err, size_t len)
{
	double d;

	if (!strcmp(v, "seed"))
		d = SEED_DELTA;
	else if (!strcmp(v, "zero"))
		d = 0;
	else if (cli_parse_finite("--decay", v, &d, err, len))
		return APE_EINVAL;
	c->delta = d;
	c->beta = c->gamma = d / 10;
	c->lambda = !strcmp(v, "zero") ? 0 : SEED_LAMBDA;
	return 0;
}

static int parse_word(const char *flag, const char *v, const char *const *words, size_t n,
		      int *out, char *err, size_t len)
{
	for (size_t i = 0; i < n; i++)
		if (!strcmp(v, words[i])) {
			*out = (int)i;
			return 0;
		}
	snprintf(err, len, "%s: '%s' is not one of the choices (see --help)", flag, v);
	return APE_EINVAL;
}

static int parse_one(int id, const char *v, struct cfg *c, struct args *a, char *err, size_t len)
{
	static const char *const shards[] = { "contiguous", "zigzag" };
	int64_t *dims[] = { [OPT_L] = &c->L, [OPT_B] = &c->B, [OPT_H] = &c->H,
			    [OPT_HKV] = &c->Hkv, [OPT_D] = &c->D };
	int64_t x;
	int w;

	switch (id) {
	case OPT_L: case OPT_B: case OPT_H: case OPT_HKV: case OPT_D:
		return cli_parse_int64(options[id - 1].name, v, id == OPT_L ? 0 : 1, INT64_MAX,
				       dims[id], err, len);
	case OPT_CHUNK:
		return cli_parse_int64("--chunk", v, 1, INT64_MAX, &c->chunk, err, len);
	case OPT_NDEV:
		if (cli_parse_int64("--ndev", v, 1, 8, &x, err, len))
			return APE_EINVAL;
		c->ndev = (int)x;
		return 0;
	case OPT_SUITE:
	case OPT_CORRUPT_RANK:
		if (cli_parse_int64(options[id - 1].name, v, 0, INT32_MAX, &x, err, len))
			return APE_EINVAL;
		*(id == OPT_SUITE ? &a->suite : &a->corrupt_rank) = (int)x;
		return 0;
	case OPT_DTYPE:
		if (cli_parse_name("--dtype", v, ape_dtype_from_name, &w, err, len))
			return APE_EINVAL;
		c->dt = c->odt = (ape_dtype)w;
		return 0;
	case OPT_SHARD:
		if (parse_word("--shard", v, shards, 2, &w, err, len))
			return APE_EINVAL;
		c->kind = w ? APE_MPI_SHARD_ZIGZAG : APE_MPI_SHARD_CONTIGUOUS;
		return 0;
	case OPT_DECAY:
		return parse_decay(v, c, err, len);
	case OPT_DELTA: case OPT_BETA: case OPT_GAMMA: case OPT_LAMBDA: {
		double *p[] = { &c->delta, &c->beta, &c->gamma, &c->lambda };

		return cli_parse_finite(options[id - 1].name, v, p[id - OPT_DELTA], err, len);
	}
	case OPT_Q_START:
		c->q_start_set = true;
		return cli_parse_int64("--q-start", v, INT64_MIN, INT64_MAX, &c->q_start, err, len);
	case OPT_K_START:
		return cli_parse_int64("--k-start", v, INT64_MIN, INT64_MAX, &c->k_start, err, len);
	case OPT_SKIP_TOL:
		return cli_parse_finite("--skip-tol", v, &c->skip_tol, err, len);
	case OPT_SEED:
		if (cli_parse_int64("--seed", v, 0, INT64_MAX, &x, err, len))
			return APE_EINVAL;
		c->seed = (uint64_t)x;
		return 0;
	case OPT_CORRUPT:
		if (parse_word("--corrupt", v, corruptions, sizeof(corruptions) /
			       sizeof(corruptions[0]), &w, err, len))
			return APE_EINVAL;
		a->corrupt_what = corruptions[w];
		return 0;
	case OPT_BACKEND: a->backend = v; return 0;
	case OPT_OUT_F32: c->odt = APE_F32; return 0;
	case OPT_NONCAUSAL: c->causal = false; return 0;
	case OPT_CHECK: c->check = true; return 0;
	case OPT_BACKWARD: c->backward = true; return 0;
	case OPT_DLSE: c->with_dlse = true; return 0;
	case OPT_QUIET: a->quiet = true; return 0;
	case OPT_HELP: a->help = true; return 0;
	}
	return 0;
}

/* Every option through the tools' shared walker (--version answered there). 0, or APE_EINVAL
 * with the message in err. */
int driver_parse(int argc, char **argv, struct cfg *c, struct args *a, char *err, size_t len)
{
	const char *v;
	int i = 1, id;

	while ((id = cli_next(argc, argv, &i, options, &v, err, len)) > 0)
		if (parse_one(id, v, c, a, err, len))
			return APE_EINVAL;
	return id;
}
