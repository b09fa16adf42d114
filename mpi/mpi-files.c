/* SPDX-License-Identifier: MIT */
/*
 * `ape-run --mpi` (ape-run execs `ape-mpi-run --files ARGS`): APE attention on .npy files, the
 * sequence sharded over the ranks of MPI_COMM_WORLD. Every rank reads only its own rows of Q, K
 * and V (and of dO and dLSE with --backward) by file offset, computes with
 * ape_mpi_attention_forward() (and ape_mpi_attention_backward()), and writes its rows of O, LSE
 * (dQ, dK, dV) into the output files at their offsets; rank 0 writes the headers and dparams.
 * Outputs are written under temporary names next to their targets and renamed into place only
 * when every rank has written every row: a failed run leaves no output. Every failure is agreed
 * on by all ranks (one allgather of every rank's status), so every rank prints the same message
 * and exits with the same status: 2 bad arguments or input files (or parameters the library
 * refuses), 3 the backend or device is not available, 1 anything else.
 *
 * The files must be visible to every rank at the same path (one machine, or a shared file
 * system on a cluster).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ape/ape_mpi.h"
#include "common/cli.h"
#include "common/npy.h"
#include "common/seed.h"
#include "mpi_files.h"

#define MSG 512

enum { EXIT_USAGE = 2, EXIT_NODEV = 3, EXIT_FAIL = 1 };

enum {
	F_Q = 1, F_K, F_V, F_O, F_LSE, F_BACKEND, F_DEVICE, F_DELTA, F_BETA, F_GAMMA, F_LAMBDA,
	F_ROPE_BASE, F_SCALE, F_NO_CAUSAL, F_LAYOUT, F_Q_START, F_K_START, F_SKIP_TOL, F_STATS,
	F_CHUNK, F_MAX_MEM, F_SHARD, F_BACKWARD, F_DLSE, F_DQ, F_DK, F_DV, F_DPARAMS, F_HELP,
	F_UNSUPPORTED,
};

static const struct cli_option fopts[] = {
	{ "-q", NULL, true, F_Q },		  { "-k", NULL, true, F_K },
	{ "-v", NULL, true, F_V },		  { "-o", NULL, true, F_O },
	{ "--lse", NULL, true, F_LSE },		  { "--backend", NULL, true, F_BACKEND },
	{ "--device", NULL, true, F_DEVICE },	  { "--delta", NULL, true, F_DELTA },
	{ "--beta", NULL, true, F_BETA },	  { "--gamma", NULL, true, F_GAMMA },
	{ "--lambda", NULL, true, F_LAMBDA },	  { "--rope-base", NULL, true, F_ROPE_BASE },
	{ "--scale", NULL, true, F_SCALE },	  { "--no-causal", NULL, false, F_NO_CAUSAL },
	{ "--layout", NULL, true, F_LAYOUT },	  { "--q-start", NULL, true, F_Q_START },
	{ "--k-start", NULL, true, F_K_START },	  { "--skip-tol", NULL, true, F_SKIP_TOL },
	{ "--stats", NULL, false, F_STATS },	  { "--chunk", NULL, true, F_CHUNK },
	{ "--max-device-mem", NULL, true, F_MAX_MEM }, { "--shard", NULL, true, F_SHARD },
	{ "--backward", NULL, true, F_BACKWARD }, { "--dlse", NULL, true, F_DLSE },
	{ "--dq", NULL, true, F_DQ },		  { "--dk", NULL, true, F_DK },
	{ "--dv", NULL, true, F_DV },		  { "--dparams", NULL, true, F_DPARAMS },
	{ "--help", "-h", false, F_HELP },
	/* ape-run's options that --mpi does not take (yet): named in the message */
	{ "--dtype", NULL, true, F_UNSUPPORTED },   { "--trace", NULL, true, F_UNSUPPORTED },
	{ "--devices", NULL, true, F_UNSUPPORTED }, { "--kv-cache", NULL, true, F_UNSUPPORTED },
	{ "--kv-block", NULL, true, F_UNSUPPORTED }, { "--kv-capacity", NULL, true, F_UNSUPPORTED },
	{ "--kv-release", NULL, false, F_UNSUPPORTED },
	{ NULL, NULL, false, 0 },
};

struct fargs {
	const char *q, *k, *v, *o, *lse, *backend, *dout, *dlse, *dq, *dk, *dv, *dparams;
	int device;
	bool stats, help;
	ape_mpi_shard_kind kind;
	ape_attn_desc desc;
	ape_exec_options eo;
	float *prm[4];
	size_t nprm[4];
};

static void fusage(void)
{
	printf("usage: mpirun -np N ape-run --mpi -q Q.npy -k K.npy -v V.npy -o O.npy [--lse LSE.npy]\n"
	       "               [--shard contiguous|zigzag] [--stats] [ape-run's options]\n"
	       "               [--backward DO.npy [--dq F] [--dk F] [--dv F] [--dparams F] [--dlse F]]\n"
	       "\n"
	       "ape-run over MPI (docs/distributed.md): the sequence is sharded over the ranks;\n"
	       "every rank reads only its rows of the inputs by file offset and writes its rows\n"
	       "of the outputs at their offsets. Q and K must have the same length (one\n"
	       "sequence). Files as ape-run's ('<f4' or '<f2', 3-D [H, L, D] means B = 1), at the\n"
	       "same path on every rank. Outputs appear complete and together, or not at all.\n"
	       "  --shard S      contiguous (the default without causal masking) or zigzag\n"
	       "                 (the default with it: every rank gets about as many pairs)\n"
	       "  --stats        per rank: rows, bytes sent and received, messages, key blocks\n"
	       "                 sent, blocks and rows proved unneeded, the plan's note (stderr)\n"
	       "Taken as ape-run takes them: --delta --beta --gamma --lambda (one value or H\n"
	       "values), --rope-base --scale --no-causal --layout --q-start --k-start --skip-tol\n"
	       "--backend --device --chunk --max-device-mem, and the --backward group.\n"
	       "Not taken with --mpi: --dtype --trace --devices --kv-*.\n"
	       "Exit status: 0; 2 bad arguments or input files (on every rank); 3 no such\n"
	       "backend or device; 1 any other failure.\n");
}

/* Formats the message into err and returns code. */
static int __attribute__((format(printf, 3, 4))) fail(char *err, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(err, MSG, fmt, ap);
	va_end(ap);
	return code;
}

/* ------------------------------------------------------------ agreement */

static int rank, nranks;

struct verdict {
	int32_t status; /* exit status, 0 for fine */
	char msg[MSG];
};

/* Every rank's status, gathered: 0 everywhere, or the first failing rank's status, its message
 * (printed by every rank, naming that rank) in msg. */
static int agree(int status, const char *mine, char *msg)
{
	struct verdict v, *all = malloc((size_t)nranks * sizeof(*all));
	int out = 0;

	memset(&v, 0, sizeof(v));
	v.status = status;
	snprintf(v.msg, sizeof(v.msg), "%s", status ? mine : "");
	if (!all || MPI_Allgather(&v, (int)sizeof(v), MPI_BYTE, all, (int)sizeof(v), MPI_BYTE,
				  MPI_COMM_WORLD) != MPI_SUCCESS) {
		free(all);
		snprintf(msg, MSG, "rank %d: cannot gather the ranks' statuses", rank);
		return EXIT_FAIL;
	}
	for (int r = 0; r < nranks && !out; r++)
		if (all[r].status) {
			out = all[r].status;
			snprintf(msg, MSG, "rank %d: %.480s", r, all[r].msg);
		}
	free(all);
	return out;
}

/* ------------------------------------------------------------ arguments */

static int set_param(struct fargs *a, int i, const char *flag, const char *val, char *err)
{
	free(a->prm[i]);
	a->prm[i] = NULL;
	return cli_parse_float_list(flag, val, &a->prm[i], &a->nprm[i], err, MSG) ? EXIT_USAGE : 0;
}

static int parse_one(struct fargs *a, int id, const char *flag, const char *val, char *err)
{
	const char **str[] = { [F_Q] = &a->q, [F_K] = &a->k, [F_V] = &a->v, [F_O] = &a->o,
			       [F_LSE] = &a->lse, [F_BACKEND] = &a->backend,
			       [F_BACKWARD] = &a->dout, [F_DLSE] = &a->dlse, [F_DQ] = &a->dq,
			       [F_DK] = &a->dk, [F_DV] = &a->dv, [F_DPARAMS] = &a->dparams };
	ape_attn_desc *d = &a->desc;
	int64_t n;
	double x;
	uint64_t bytes;

	if (id < (int)(sizeof(str) / sizeof(str[0])) && str[id]) {
		*str[id] = val;
		return 0;
	}
	switch (id) {
	case F_DEVICE:
		if (cli_parse_int64(flag, val, 0, INT32_MAX, &n, err, MSG))
			return EXIT_USAGE;
		a->device = (int)n;
		return 0;
	case F_DELTA: case F_BETA: case F_GAMMA: case F_LAMBDA:
		return set_param(a, id - F_DELTA, flag, val, err);
	case F_ROPE_BASE: case F_SCALE: case F_SKIP_TOL:
		if (cli_parse_finite(flag, val, &x, err, MSG))
			return EXIT_USAGE;
		if (id == F_ROPE_BASE)
			d->rope_base = x;
		else if (id == F_SKIP_TOL)
			d->skip_tol = x;
		else {
			d->scale = (float)x;
			d->scale_set = true;
		}
		return 0;
	case F_NO_CAUSAL: d->causal = false; return 0;
	case F_LAYOUT:
		if (!strcmp(val, "half") || !strcmp(val, "interleaved")) {
			d->layout = !strcmp(val, "half") ? APE_ROPE_HALF : APE_ROPE_INTERLEAVED;
			return 0;
		}
		snprintf(err, MSG, "--layout: '%s' is not half or interleaved", val);
		return EXIT_USAGE;
	case F_Q_START: case F_K_START:
		if (cli_parse_int64(flag, val, INT64_MIN, INT64_MAX, &n, err, MSG))
			return EXIT_USAGE;
		if (id == F_K_START)
			d->k_start = n;
		else {
			d->q_start = n;
			d->q_start_set = true;
		}
		return 0;
	case F_CHUNK:
		if (cli_parse_int64(flag, val, 1, INT64_MAX, &n, err, MSG))
			return EXIT_USAGE;
		a->eo.chunk_q = a->eo.chunk_k = n;
		return 0;
	case F_MAX_MEM:
		if (cli_parse_bytes(flag, val, &bytes, err, MSG))
			return EXIT_USAGE;
		a->eo.max_device_bytes = bytes;
		return 0;
	case F_SHARD:
		if (!strcmp(val, "contiguous") || !strcmp(val, "zigzag")) {
			a->kind = !strcmp(val, "zigzag") ? APE_MPI_SHARD_ZIGZAG
							 : APE_MPI_SHARD_CONTIGUOUS;
			return 0;
		}
		snprintf(err, MSG, "--shard: '%s' is not contiguous or zigzag", val);
		return EXIT_USAGE;
	case F_STATS: a->stats = true; return 0;
	case F_HELP: a->help = true; return 0;
	case F_UNSUPPORTED:
		snprintf(err, MSG, "%s: not taken with --mpi (see ape-run --mpi --help)", flag);
		return EXIT_USAGE;
	}
	return 0;
}

static int parse(int argc, char **argv, struct fargs *a, char *err)
{
	const char *val;
	char flag[64];
	int i = 1, at = 1, id, kind_set = 0, ret;

	memset(a, 0, sizeof(*a));
	a->backend = "auto";
	a->device = -1;
	ape_attn_desc_init(&a->desc);
	ape_exec_options_init(&a->eo);
	a->desc.skip_tol = 0x1p-24;
	while ((id = cli_next(argc, argv, &i, fopts, &val, err, MSG)) > 0) {
		/* the option as written, without "=VALUE" */
		snprintf(flag, sizeof(flag), "%.*s", (int)strcspn(argv[at], "="), argv[at]);
		at = i;
		kind_set |= id == F_SHARD;
		if ((ret = parse_one(a, id, flag, val, err)))
			return ret;
	}
	if (id < 0)
		return EXIT_USAGE;
	if (a->help)
		return 0;
	if (!kind_set)
		a->kind = a->desc.causal ? APE_MPI_SHARD_ZIGZAG : APE_MPI_SHARD_CONTIGUOUS;
	if (!a->q || !a->k || !a->v || !a->o) {
		snprintf(err, MSG, "%s is required (see ape-run --mpi --help)",
			 !a->q ? "-q" : !a->k ? "-k" : !a->v ? "-v" : "-o");
		return EXIT_USAGE;
	}
	if (!a->dout && (a->dq || a->dk || a->dv || a->dparams || a->dlse)) {
		snprintf(err, MSG, "--dq, --dk, --dv, --dparams and --dlse need --backward DO.npy");
		return EXIT_USAGE;
	}
	if (a->dout && !a->dq && !a->dk && !a->dv && !a->dparams) {
		snprintf(err, MSG, "--backward: give at least one of --dq, --dk, --dv, --dparams");
		return EXIT_USAGE;
	}
	return 0;
}

/* ------------------------------------------------------------ input files */

/* An input file's header (parsed from a read-only mapping: only the pages read are loaded). */
struct in_file {
	const char *path;
	struct npy_info info;
	int fd;
	int64_t B, Hx, L, D; /* as [B, Hx, L, D]; LSE-like files have D = 1 */
};

static int open_input(struct in_file *f, const char *path, bool rows_only, char *err)
{
	struct stat st;
	void *map;
	char msg[MSG - 100];
	int ret;

	memset(f, 0, sizeof(*f));
	f->path = path;
	f->fd = open(path, O_RDONLY | O_CLOEXEC);
	if (f->fd < 0 || fstat(f->fd, &st) || !S_ISREG(st.st_mode)) {
		snprintf(err, MSG, "%.400s: cannot open as a regular file: %s", path,
			 f->fd < 0 ? strerror(errno) : "not a regular file");
		return EXIT_USAGE;
	}
	map = st.st_size ? mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, f->fd, 0)
			 : MAP_FAILED;
	if (map == MAP_FAILED) {
		snprintf(err, MSG, "%.400s: cannot map the header: %s", path,
			 st.st_size ? strerror(errno) : "empty file");
		return EXIT_USAGE;
	}
	ret = npy_parse(map, (size_t)st.st_size, &f->info, msg, sizeof(msg));
	munmap(map, (size_t)st.st_size);
	if (ret) {
		snprintf(err, MSG, "%.90s: %s", path, msg);
		return EXIT_USAGE;
	}
	if (rows_only) { /* [B, H, L] or [H, L] */
		if (f->info.ndim != 2 && f->info.ndim != 3)
			goto dims;
		f->B = f->info.ndim == 3 ? f->info.shape[0] : 1;
		f->Hx = f->info.shape[f->info.ndim - 2];
		f->L = f->info.shape[f->info.ndim - 1];
		f->D = 1;
		return 0;
	}
	if (f->info.ndim != 3 && f->info.ndim != 4)
		goto dims;
	f->B = f->info.ndim == 4 ? f->info.shape[0] : 1;
	f->Hx = f->info.shape[f->info.ndim - 3];
	f->L = f->info.shape[f->info.ndim - 2];
	f->D = f->info.shape[f->info.ndim - 1];
	return 0;
dims:
	snprintf(err, MSG, "%.400s: %d dimensions: expected %s", path, f->info.ndim,
		 rows_only ? "[B, H, L] or [H, L]" : "[B, H, L, D] or [H, L, D]");
	return EXIT_USAGE;
}

static int io_at(int fd, bool wr, void *buf, size_t n, off_t off, const char *path, char *err)
{
	char *p = buf;

	while (n) {
		ssize_t r = wr ? pwrite(fd, p, n, off) : pread(fd, p, n, off);

		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			snprintf(err, MSG, "%.400s: %s failed: %s", path, wr ? "write" : "read",
				 r < 0 ? strerror(errno) : "the file shrank");
			return EXIT_FAIL;
		}
		p += r;
		off += r;
		n -= (size_t)r;
	}
	return 0;
}

/*
 * This rank's rows of a [B, Hx, L, D] array in a file whose data start at data_offset: for each
 * (b, h) and each block of the shard, one contiguous run of count * D elements, read into (or
 * written from) buf, which holds [B, Hx, rows, D].
 */
static int rows_io(int fd, bool wr, const char *path, size_t data_offset, size_t es, int64_t B,
		   int64_t Hx, int64_t L, int64_t D, const ape_mpi_shard_info *sh, void *buf,
		   char *err)
{
	for (int64_t bh = 0; bh < B * Hx; bh++)
		for (int lb = 0, ret; lb < sh->nblocks; lb++) {
			const int64_t off = lb ? sh->count[0] : 0, n = sh->count[lb];
			char *p = (char *)buf + (size_t)((bh * sh->rows + off) * D) * es;
			const off_t at = (off_t)(data_offset +
						 (size_t)((bh * L + sh->start[lb]) * D) * es);

			if (n && (ret = io_at(fd, wr, p, (size_t)(n * D) * es, at, path, err)))
				return ret;
		}
	return 0;
}

/* Reads this rank's rows of f into a new buffer. */
static int read_rows(const struct in_file *f, const ape_mpi_shard_info *sh, void **out,
		     char *err)
{
	const size_t es = ape_dtype_size(f->info.dtype);

	*out = malloc((size_t)(f->B * f->Hx * sh->rows * f->D) * es + 1);
	if (!*out) {
		snprintf(err, MSG, "%.400s: out of memory for this rank's rows", f->path);
		return EXIT_FAIL;
	}
	return rows_io(f->fd, false, f->path, f->info.data_offset, es, f->B, f->Hx, f->L, f->D, sh,
		       *out, err);
}

/* ------------------------------------------------------------ output files */

struct out_file {
	const char *path;
	char tmp[PATH_MAX];
	ape_dtype dt;
	int ndim;
	int64_t shape[4];
	int64_t B, Hx, D; /* rows as [B, Hx, L, D]; 0: written whole by rank 0 (dparams) */
	size_t data_offset;
	const void *data; /* this rank's rows ([B, Hx, rows, D]), or the whole array */
};

/* Rank 0: a temporary file next to each target, with its header, at its full size. */
static int create_outputs(struct out_file *of, int n, char *err)
{
	for (int i = 0; i < n; i++) {
		char head[4096];
		size_t hlen, bytes = ape_dtype_size(of[i].dt);
		mode_t um = umask(0);
		int fd, ret;

		umask(um);
		for (int d = 0; d < of[i].ndim; d++)
			bytes *= (size_t)of[i].shape[d];
		if (npy_format_header(head, sizeof(head), of[i].dt, of[i].ndim, of[i].shape, 0,
				      &hlen, err, MSG))
			return EXIT_FAIL;
		snprintf(of[i].tmp, sizeof(of[i].tmp), "%s.ape-mpi-XXXXXX", of[i].path);
		fd = mkstemp(of[i].tmp);
		if (fd < 0) {
			snprintf(err, MSG, "%.400s: cannot create a temporary file next to it: %s",
				 of[i].path, strerror(errno));
			of[i].tmp[0] = 0;
			return EXIT_FAIL;
		}
		of[i].data_offset = hlen;
		ret = fchmod(fd, 0666 & ~um) || ftruncate(fd, (off_t)(hlen + bytes)) ? EXIT_FAIL
			: io_at(fd, true, head, hlen, 0, of[i].tmp, err);
		if (ret == EXIT_FAIL && !err[0])
			snprintf(err, MSG, "%.400s: %s", of[i].tmp, strerror(errno));
		if (!ret && !of[i].B)
			ret = io_at(fd, true, (void *)of[i].data, bytes, (off_t)hlen, of[i].tmp, err);
		if (close(fd) && !ret) {
			snprintf(err, MSG, "%.400s: %s", of[i].tmp, strerror(errno));
			ret = EXIT_FAIL;
		}
		if (ret)
			return ret;
	}
	return 0;
}

/* Every rank: its rows into each temporary file, flushed to disk. */
static int write_rows(struct out_file *of, int n, const ape_mpi_shard_info *sh, char *err)
{
	for (int i = 0; i < n; i++) {
		int fd, ret;

		if (!of[i].B)
			continue;
		fd = open(of[i].tmp, O_WRONLY | O_CLOEXEC);
		if (fd < 0) {
			snprintf(err, MSG, "%.400s: cannot open: %s", of[i].tmp, strerror(errno));
			return EXIT_FAIL;
		}
		ret = rows_io(fd, true, of[i].tmp, of[i].data_offset, ape_dtype_size(of[i].dt),
			      of[i].B, of[i].Hx, sh->L, of[i].D, sh, (void *)of[i].data, err);
		if (!ret && fsync(fd)) {
			snprintf(err, MSG, "%.400s: fsync: %s", of[i].tmp, strerror(errno));
			ret = EXIT_FAIL;
		}
		close(fd);
		if (ret)
			return ret;
	}
	return 0;
}

/* Writes every output (every rank its rows), then renames them all into place, or removes
 * them all; the same outcome on every rank. */
static int write_outputs(struct out_file *of, int n, const ape_mpi_shard_info *sh, char *msg)
{
	char err[MSG] = "";
	int ret = 0;

	if (rank == 0)
		ret = create_outputs(of, n, err);
	if ((ret = agree(ret, err, msg)))
		goto out;
	for (int i = 0; i < n; i++) { /* where rank 0 put each file, and its header's length */
		uint64_t off = of[i].data_offset;

		MPI_Bcast(of[i].tmp, (int)sizeof(of[i].tmp), MPI_CHAR, 0, MPI_COMM_WORLD);
		MPI_Bcast(&off, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
		of[i].data_offset = (size_t)off;
	}
	ret = write_rows(of, n, sh, err);
	if ((ret = agree(ret, err, msg)))
		goto out;
	for (int i = 0; rank == 0 && i < n && !ret; i++) {
		if (rename(of[i].tmp, of[i].path)) {
			snprintf(err, MSG, "%.200s: cannot rename %.200s into place: %s", of[i].path,
				 of[i].tmp, strerror(errno));
			ret = EXIT_FAIL;
		} else {
			of[i].tmp[0] = 0;
		}
	}
	ret = agree(ret, err, msg);
out:
	for (int i = 0; rank == 0 && i < n; i++)
		if (of[i].tmp[0])
			unlink(of[i].tmp);
	return ret;
}

/* ------------------------------------------------------------ the run */

static void stats_line(const char *what, const ape_mpi_stats *st, const ape_mpi_shard_info *sh)
{
	char line[1024], *all = rank == 0 ? malloc((size_t)nranks * sizeof(line)) : NULL;

	snprintf(line, sizeof(line),
		 "ape-run --mpi: %s: rank %d: rows %" PRId64 ", bytes sent %" PRIu64
		 ", received %" PRIu64 ", messages sent %" PRIu64 ", received %" PRIu64
		 ", key blocks sent %" PRIu64 ", received %" PRIu64 ", blocks proved unneeded %"
		 PRIu64 ", rows proved unneeded %" PRIu64 ", gradient bytes sent %" PRIu64
		 ", received %" PRIu64 ", peers %d, %.1f ms; %s",
		 what, rank, sh->rows, st->bytes_sent, st->bytes_received, st->messages_sent,
		 st->messages_received, st->blocks_sent, st->blocks_received, st->blocks_unneeded,
		 st->rows_unneeded, st->grad_bytes_sent, st->grad_bytes_received, st->peers,
		 st->total_ms, st->note);
	MPI_Gather(line, (int)sizeof(line), MPI_CHAR, all, (int)sizeof(line), MPI_CHAR, 0,
		   MPI_COMM_WORLD);
	for (int r = 0; all && r < nranks; r++)
		fprintf(stderr, "%s\n", all + (size_t)r * sizeof(line));
	free(all);
}

/* The parameters: one value for every head or H of them. */
static int apply_params(struct fargs *a, int64_t H, char *err)
{
	static const char *const names[4] = { "--delta", "--beta", "--gamma", "--lambda" };
	ape_param *p[4] = { &a->desc.delta, &a->desc.beta, &a->desc.gamma, &a->desc.lambda };
	const float def[4] = SEED_PARAMS; /* ape-run's defaults */

	for (int i = 0; i < 4; i++) {
		p[i]->value = def[i];
		p[i]->per_head = NULL;
		if (!a->prm[i])
			continue;
		if (a->nprm[i] == 1) {
			p[i]->value = a->prm[i][0];
		} else if ((int64_t)a->nprm[i] == H) {
			p[i]->per_head = a->prm[i];
		} else {
			snprintf(err, MSG, "%s: %zu values, but Q has H = %" PRId64 " heads",
				 names[i], a->nprm[i], H);
			return EXIT_USAGE;
		}
	}
	return 0;
}

/* Exit status of a library failure: arguments the library refuses are the user's (2). */
static int lib_status(int ret)
{
	return ret == APE_EINVAL || ret == APE_EOVERFLOW ? EXIT_USAGE : EXIT_FAIL;
}

static int run(struct fargs *a, char *msg)
{
	struct in_file in[5];
	const char *names[5] = { a->q, a->k, a->v, a->dout, a->dlse };
	void *buf[5] = { NULL, NULL, NULL, NULL, NULL };
	void *o = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
	float *lse = NULL, dparams[4 * 1024];
	ape_tensor t[5], to, tdq, tdk, tdv;
	ape_mpi_shard_info sh;
	ape_mpi_stats st;
	struct out_file of[6];
	ape_context *ctx = NULL;
	ape_selection sel;
	char err[MSG] = "";
	int ret = 0, nout = 0, nin = a->dout ? (a->dlse ? 5 : 4) : 3;
	int64_t B = 0, H = 0, Hkv = 0, L = 0, D = 0;
	ape_dtype dt = APE_F32;
	const void *g[3];
	const char *gp[3] = { a->dq, a->dk, a->dv };

	memset(in, 0, sizeof(in));
	for (int i = 0; i < 5; i++)
		in[i].fd = -1;
	/* headers, on every rank (the same files: the same verdict) */
	for (int i = 0; i < nin && !ret; i++)
		ret = open_input(&in[i], names[i], i == 4, err);
	if (!ret) {
		B = in[0].B, H = in[0].Hx, Hkv = in[1].Hx, L = in[0].L, D = in[0].D;
		dt = in[0].info.dtype;
		if (in[1].L != L || in[2].L != L)
			ret = fail(err, EXIT_USAGE, "-q has %" PRId64 " rows, but -k %" PRId64
				       " and -v %" PRId64 ": --mpi shards one sequence (Lq = Lk)",
				       L, in[1].L, in[2].L);
		else if (in[0].info.ndim != in[1].info.ndim || in[0].info.ndim != in[2].info.ndim ||
			 in[1].B != B || in[2].B != B || in[2].Hx != Hkv || in[1].D != D ||
			 in[2].D != D)
			ret = fail(err, EXIT_USAGE, "-q, -k and -v: shapes do not fit (Q [B, H, L, D], "
				       "K and V [B, Hkv, L, D], all 3-D or all 4-D)");
		else if (in[1].info.dtype != dt || in[2].info.dtype != dt)
			ret = fail(err, EXIT_USAGE, "-q, -k and -v must have the same dtype");
		else if (a->dout && (in[3].B != B || in[3].Hx != H || in[3].L != L ||
				     in[3].D != D || in[3].info.ndim != in[0].info.ndim))
			ret = fail(err, EXIT_USAGE, "--backward %s: dO must have Q's shape", a->dout);
		else if (a->dlse && (in[4].B != B || in[4].Hx != H || in[4].L != L ||
				     in[4].info.dtype != APE_F32 ||
				     in[4].info.ndim != in[0].info.ndim - 1))
			ret = fail(err, EXIT_USAGE, "--dlse %s: '<f4' of LSE's shape expected",
				       a->dlse);
		else if (4 * H > 4 * 1024)
			ret = fail(err, EXIT_USAGE, "H = %" PRId64 ": at most 1024 heads", H);
		else
			ret = apply_params(a, H, err);
	}
	if (!ret && ape_mpi_shard(L, nranks, rank, a->kind, &sh))
		ret = fail(err, EXIT_USAGE, "%s", ape_mpi_last_error());
	/* this rank's rows only, by offset */
	for (int i = 0; i < nin && !ret; i++)
		ret = read_rows(&in[i], &sh, &buf[i], err);
	if ((ret = agree(ret, err, msg)))
		goto out;
	for (int i = 0; i < 4 && i < nin; i++)
		ape_tensor_init(&t[i], buf[i], in[i].info.dtype, B, i == 1 || i == 2 ? Hkv : H,
				sh.rows, D);
	o = malloc((size_t)(B * H * sh.rows * D) * ape_dtype_size(dt) + 1);
	lse = malloc((size_t)(B * H * sh.rows) * sizeof(float) + 1);
	ret = !o || !lse ? fail(err, EXIT_FAIL, "out of memory") : 0;
	if (!ret && (ape_context_create(&ctx, NULL) ||
		     ape_device_select(ctx, a->backend, a->device, &sel)))
		ret = fail(err, EXIT_NODEV, "%s", ape_last_error());
	if ((ret = agree(ret, err, msg)))
		goto out;
	ape_tensor_init(&to, o, dt, B, H, sh.rows, D);
	ape_mpi_stats_init(&st);
	ret = ape_mpi_attention_forward(MPI_COMM_WORLD, sel.device, &a->eo, &a->desc, &sh, &t[0],
					&t[1], &t[2], &to, lse, &st);
	if (ret) { /* the same on every rank */
		snprintf(msg, MSG, "%s", ape_mpi_last_error());
		ret = lib_status(ret);
		goto out;
	}
	if (a->stats)
		stats_line("forward", &st, &sh);
	of[nout++] = (struct out_file){ .path = a->o, .dt = dt, .ndim = in[0].info.ndim,
					.B = B, .Hx = H, .D = D, .data = o };
	memcpy(of[0].shape, in[0].info.shape, sizeof(of[0].shape));
	if (a->lse) {
		of[nout] = (struct out_file){ .path = a->lse, .dt = APE_F32,
					      .ndim = in[0].info.ndim - 1, .B = B, .Hx = H, .D = 1,
					      .data = lse };
		memcpy(of[nout++].shape, in[0].info.shape, 3 * sizeof(int64_t));
	}
	if (a->dout) {
		dq = a->dq ? malloc((size_t)(B * H * sh.rows * D) * ape_dtype_size(dt) + 1) : NULL;
		dk = a->dk ? malloc((size_t)(B * Hkv * sh.rows * D) * ape_dtype_size(dt) + 1) : NULL;
		dv = a->dv ? malloc((size_t)(B * Hkv * sh.rows * D) * ape_dtype_size(dt) + 1) : NULL;
		ret = (a->dq && !dq) || (a->dk && !dk) || (a->dv && !dv) ? EXIT_FAIL : 0;
		if ((ret = agree(ret, "out of memory for the gradients", msg)))
			goto out;
		g[0] = dq;
		g[1] = dk;
		g[2] = dv;
		ape_tensor_init(&tdq, dq, dt, B, H, sh.rows, D);
		ape_tensor_init(&tdk, dk, dt, B, Hkv, sh.rows, D);
		ape_tensor_init(&tdv, dv, dt, B, Hkv, sh.rows, D);
		ape_mpi_stats_init(&st);
		ret = ape_mpi_attention_backward(MPI_COMM_WORLD, sel.device, &a->eo, &a->desc, &sh,
						 &t[0], &t[1], &t[2], &to, lse, &t[3],
						 a->dlse ? buf[4] : NULL, dq ? &tdq : NULL,
						 dk ? &tdk : NULL, dv ? &tdv : NULL,
						 a->dparams ? dparams : NULL, &st);
		if (ret) {
			snprintf(msg, MSG, "%s", ape_mpi_last_error());
			ret = lib_status(ret);
			goto out;
		}
		if (a->stats)
			stats_line("backward", &st, &sh);
		for (int i = 0; i < 3; i++)
			if (gp[i]) {
				of[nout] = (struct out_file){ .path = gp[i], .dt = dt,
							      .ndim = in[i].info.ndim, .B = B,
							      .Hx = i ? Hkv : H, .D = D,
							      .data = g[i] };
				memcpy(of[nout++].shape, in[i].info.shape, sizeof(of[0].shape));
			}
		if (a->dparams)
			of[nout++] = (struct out_file){ .path = a->dparams, .dt = APE_F32, .ndim = 2,
							.shape = { H, 4 }, .data = dparams };
	}
	ret = write_outputs(of, nout, &sh, msg);
out:
	for (int i = 0; i < 5; i++) {
		free(buf[i]);
		if (in[i].fd >= 0)
			close(in[i].fd);
	}
	free(o);
	free(lse);
	free(dq);
	free(dk);
	free(dv);
	for (int i = 0; i < 4; i++)
		free(a->prm[i]);
	ape_context_destroy(ctx);
	return ret;
}

int ape_mpi_files_main(int argc, char **argv)
{
	struct fargs a;
	char msg[MSG] = "";
	int ret;

	/* arguments first (--help needs no MPI); every rank reads the same ones, so every rank
	 * says the same, after MPI_Init so that all of them can */
	ret = parse(argc, argv, &a, msg);
	if (!ret && a.help) {
		fusage();
		return 0;
	}
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &nranks);
	if (!ret)
		ret = run(&a, msg);
	else
		for (int i = 0; i < 4; i++)
			free(a.prm[i]);
	if (ret)
		fprintf(stderr, "ape-run --mpi: %s\n", msg);
	/* every rank has said it before any exits (mpirun ends the job at the first non-zero
	 * exit status) */
	MPI_Barrier(MPI_COMM_WORLD);
	MPI_Finalize();
	return ret;
}
