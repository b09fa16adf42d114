/* SPDX-License-Identifier: MIT */
/*
 * One case of ape-mpi-run on every rank (mpi/driver/driver.h): set up, corrupted on one rank
 * when asked, run, with --check compared with the single-process call over the whole sequence,
 * one line per rank gathered to rank 0.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

#define LINE 1024

/* ---------------------------------------------------------------- the check */

static double tol_o(ape_dtype dt)
{
	return dt == APE_F32 ? 1e-4 : dt == APE_F16 ? 5e-3 : 2e-2;
}

static double tol_lse(ape_dtype dt)
{
	return dt == APE_F32 ? 1e-4 : dt == APE_F16 ? 1e-3 : 5e-3;
}

/*
 * This rank's rows as one single-process call over the whole sequence computes them (each block
 * of rows with its own q_start), against the distributed result. err_o in units of the spec's
 * tolerance times max|V|; err_lse in units of its tolerance times max(1, |LSE|): pass <= 1.
 */
static int check(const struct cfg *c, struct run *r, ape_device *dev, double *err_o,
		 double *err_lse)
{
	ape_tensor K, V, o1;
	void *kb, *vb, *ob = NULL;
	float *l1 = NULL;
	double M = 0;
	int ret = APE_ENOMEM;

	*err_o = *err_lse = 0;
	kb = driver_alloc_tensor(&K, c->dt, c->B, c->Hkv, c->L, c->D, false);
	vb = driver_alloc_tensor(&V, c->dt, c->B, c->Hkv, c->L, c->D, false);
	if (!kb || !vb)
		goto out;
	driver_fill(c, &K, 1, NULL);
	driver_fill(c, &V, 2, NULL);
	for (int64_t i = 0; i < c->B * c->Hkv * c->L * c->D; i++)
		M = fmax(M, fabs(driver_get(&V, 0, 0, 0, i)));
	for (int lb = 0; lb < r->sh.nblocks; lb++) {
		const int64_t n = r->sh.count[lb], off = lb ? r->sh.count[0] : 0;
		ape_attn_desc d = r->desc;
		ape_tensor qv;

		if (n == 0)
			continue;
		free(ob);
		free(l1);
		ob = driver_alloc_tensor(&o1, c->odt, c->B, c->H, n, c->D, false);
		l1 = calloc((size_t)(c->B * c->H * n), sizeof(float));
		ret = APE_ENOMEM;
		if (!ob || !l1)
			goto out;
		d.q_start_set = true;
		d.q_start = (c->q_start_set ? c->q_start : c->k_start) + r->sh.start[lb];
		ape_tensor_rows(&r->tq, off, n, &qv);
		if ((ret = ape_attention_forward(dev, &d, &qv, &K, &V, &o1, l1, NULL)))
			goto out;
		for (int64_t b = 0; b < c->B; b++)
			for (int64_t h = 0; h < c->H; h++)
				for (int64_t i = 0; i < n; i++) {
					double a = l1[(b * c->H + h) * n + i];
					double z = r->lse[(b * c->H + h) * r->sh.rows + off + i];
					double e = a == z ? 0 : fabs(a - z); /* two -inf agree */

					e = e == e ? e : INFINITY;
					*err_lse = fmax(*err_lse,
							e / (tol_lse(c->dt) * fmax(1, fabs(a))));
					for (int64_t dd = 0; dd < c->D; dd++) {
						e = fabs(driver_get(&o1, b, h, i, dd) -
							 driver_get(&r->to, b, h, off + i, dd));
						e = e == e ? e : INFINITY;
						*err_o = fmax(*err_o,
							      e / (tol_o(c->dt) * fmax(M, 1e-30)));
					}
				}
	}
	ret = 0;
out:
	free(kb);
	free(vb);
	free(ob);
	free(l1);
	return ret;
}

/* ---------------------------------------------------------------- one run */

static void corrupt(const char *what, struct run *r)
{
	static const int64_t bad[4] = { 1, 1, -1, 1 };

	if (!strcmp(what, "delta"))
		r->desc.delta.value += 0.25f;
	else if (!strcmp(what, "causal"))
		r->desc.causal = !r->desc.causal;
	else if (!strcmp(what, "k_start"))
		r->desc.k_start += 1;
	else if (!strcmp(what, "kind"))
		ape_mpi_shard(r->sh.L, driver_nranks, driver_rank, !r->sh.kind, &r->sh);
	else if (!strcmp(what, "rank"))
		r->sh.rank = (driver_rank + 1) % driver_nranks;
	else if (!strcmp(what, "stride"))
		memcpy(r->tk.strides, bad, sizeof(bad));
	else if (!strcmp(what, "null"))
		r->tq.data = NULL;
	else if (!strcmp(what, "L"))
		r->sh.L += 1;
	else if (!strcmp(what, "table")) { /* a distance-bias table: not taken yet */
		static const float table[2] = { 0.5f, -0.25f };

		r->desc.bias_table = table;
		r->desc.bias_table_len = 2;
		r->desc.bias_table_heads = 1;
	}
}

static void describe(const struct cfg *c, char *buf, size_t len)
{
	snprintf(buf, len,
		 "%s L=%" PRId64 " B=%" PRId64 " H=%" PRId64 " Hkv=%" PRId64 " D=%" PRId64
		 " %s->%s %s %s delta=%g%s%s q_start=%s%" PRId64 " k_start=%" PRId64 "%s%s ndev=%d chunk=%" PRId64,
		 c->what ? c->what : "", c->L, c->B, c->H, c->Hkv, c->D, ape_dtype_name(c->dt),
		 ape_dtype_name(c->odt), c->kind ? "zigzag" : "contiguous",
		 c->causal ? "causal" : "non-causal", c->delta, c->per_head ? " per-head" : "",
		 c->strided ? " strided" : "", c->q_start_set ? "" : "default:",
		 c->q_start_set ? c->q_start : c->k_start, c->k_start, c->backward ? " backward" : "",
		 c->backward && c->with_dlse ? " dlse" : "", c->ndev, c->chunk);
}

/* Runs one case on every rank; rank 0 prints every rank's line. Returns 1 when the case passed
 * on every rank (ret 0, within tolerance when checked), 0 otherwise. */
int driver_run_case(const struct cfg *c, ape_device *dev, const char *corrupt_what,
		    int corrupt_rank, bool print_ranks)
{
	char line[LINE], *all = NULL, desc[256];
	struct run r;
	ape_mpi_stats st;
	ape_exec_options eo;
	double err_o = 0, err_lse = 0, err_g[4] = { 0, 0, 0, 0 };
	int ret, ok, all_ok, same = 1;
	uint64_t hash = 0;
	ape_device *devs[8];
	const char *mine = corrupt_what && driver_rank == corrupt_rank ? corrupt_what : NULL;

	for (int i = 0; i < 8; i++)
		devs[i] = dev;

	ret = driver_setup(c, &r);
	if (!ret && corrupt_what && driver_rank == corrupt_rank)
		corrupt(corrupt_what, &r);
	ape_mpi_stats_init(&st);
	/* a budget too small for any chunk: the rank's arguments are valid, its computation fails */
	ape_exec_options_init(&eo);
	eo.chunk_q = eo.chunk_k = c->chunk;
	if (corrupt_what && driver_rank == corrupt_rank && !strcmp(corrupt_what, "budget"))
		eo.max_device_bytes = 1000;
	if (!ret && c->ndev > 1)
		ret = ape_mpi_attention_forward_ex(MPI_COMM_WORLD, devs, c->ndev, &eo, &r.desc,
						   &r.sh, &r.tq, &r.tk, &r.tv, &r.to, r.lse, &st);
	else if (!ret)
		ret = ape_mpi_attention_forward(MPI_COMM_WORLD, dev, &eo, &r.desc, &r.sh, &r.tq,
						&r.tk, &r.tv, &r.to, r.lse, &st);
	driver_last_ret = ret;
	ok = ret == 0;
	if (ok && c->check) {
		int cr = check(c, &r, dev, &err_o, &err_lse);

		ok = !cr && err_o <= 1 && err_lse <= 1;
	}
	/* every rank that got here calls the backward (a collective), after a forward that
	 * succeeded everywhere (ret is the same on every rank) */
	if (!ret && c->backward) {
		ret = driver_backward_case(c, &r, dev, &eo, mine, &st, err_g, &same, &hash);
		driver_last_ret = ret;
		ok = ok && !ret && same && (!c->check || (err_g[0] <= 1 && err_g[1] <= 1 &&
							  err_g[2] <= 1 && err_g[3] <= 1));
	}
	snprintf(line, sizeof(line),
		 "rank=%d rows=%" PRId64 " ret=%s ok=%d err_o=%.3g err_lse=%.3g bytes_sent=%" PRIu64
		 " bytes_received=%" PRIu64 " messages_sent=%" PRIu64 " messages_received=%" PRIu64
		 " blocks_sent=%" PRIu64 " rows_sent=%" PRIu64 " blocks_received=%" PRIu64
		 " blocks_unneeded=%" PRIu64 " rows_unneeded=%" PRIu64 " peers=%d full_exchange=%d"
		 " local_calls=%" PRIu64 " pairs_visible=%" PRIu64 " pairs_computed=%" PRIu64
		 " grad_bytes_sent=%" PRIu64 " grad_bytes_received=%" PRIu64 " err_dq=%.3g"
		 " err_dk=%.3g err_dv=%.3g err_dp=%.3g dp_same=%d dp_hash=%" PRIu64
		 " total_ms=%.1f wait_ms=%.1f note=\"%s\" msg=\"%s\"",
		 driver_rank, r.sh.rows, ape_err_name(ret), ok, err_o, err_lse, st.bytes_sent,
		 st.bytes_received, st.messages_sent, st.messages_received, st.blocks_sent, st.rows_sent,
		 st.blocks_received, st.blocks_unneeded, st.rows_unneeded, st.peers,
		 st.full_exchange, st.local_calls, st.pairs_visible, st.pairs_computed,
		 st.grad_bytes_sent, st.grad_bytes_received, err_g[0], err_g[1], err_g[2], err_g[3],
		 same, hash, st.total_ms,
		 st.wait_ms, st.note, ret ? ape_mpi_last_error() : "");
	driver_teardown(&r);
	if (driver_bench && ret) /* every rank says why (the same message on every rank) */
		fprintf(stderr, "ape-bench --mpi: rank %d: %s\n", driver_rank,
			ape_mpi_last_error());
	if (driver_rank == 0)
		all = malloc((size_t)driver_nranks * LINE);
	MPI_Gather(line, LINE, MPI_CHAR, all, LINE, MPI_CHAR, 0, MPI_COMM_WORLD);
	MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
	if (driver_rank == 0) {
		describe(c, desc, sizeof(desc));
		printf("%s %s\n", all_ok ? "pass" : "FAIL", desc);
		for (int i = 0; all && i < driver_nranks && (print_ranks || !all_ok); i++)
			printf("  %s\n", all + (size_t)i * LINE);
		fflush(stdout);
	}
	free(all);
	return all_ok;
}
