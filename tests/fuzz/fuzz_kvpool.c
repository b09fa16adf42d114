/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the KV pool (ape_kv_pool_*, include/ape/ape.h "KV pool") on the reference
 * device. The input is a pool's options (page_tokens, capacity_tokens, Hkv, H, D, dtype,
 * max_batch_tokens, attend_chunk, max_device_bytes, sometimes a wrong struct_size) and then a
 * sequence of calls with fuzzed arguments:
 *
 * - ape_kv_pool_add_sequence() at k_start anywhere, the ends of int64 and +-2^62 included;
 * - ape_kv_pool_remove_sequence(), ape_kv_pool_fork(), ape_kv_pool_sequence_info() of ids
 *   handed out, removed, or raw (negative, past the last, the ends of int64);
 * - ape_kv_pool_append() and ape_kv_pool_append_batch() of host tensors of fuzzed shape (one
 *   entry raw), dtype and strides (contiguous, packed [n, Hkv, D], padded, raw), the batch's
 *   ids unknown, removed or named twice, its cu_seqlens short, decreasing, not from 0, past the
 *   total or raw, NULL arrays, a negative count;
 * - ape_kv_pool_attend() likewise, with pos_q absent, near the sequences' keys, or raw int64
 *   values (distances that overflow), a fuzzed desc (causal, decay, skip_tol, k_start,
 *   q_start_set, struct_size), O of the pool's dtype or float32, LSE and stats wanted or not,
 *   and the diagnostics (ape_kv_pool_attend_diag(), entropy and mean distance each wanted or
 *   not);
 * - ape_kv_pool_release_unreachable() of ids handed out, removed or raw, with a fuzzed desc
 *   (steep, mild, no or negative decay; skip_tol), in pools made with or without
 *   max_query_norm (sometimes negative or NaN: refused at creation);
 *
 * Promises checked:
 * - every call returns 0 or one of its documented codes (APE_EINVAL, APE_EOVERFLOW, APE_ENOMEM),
 *   with a message naming the function, and never crashes, reads outside its arrays or tensors
 *   (ASan: tensors lie over blocks exactly as large as they address; a tensor too large to
 *   back lies over memory not mapped, and must be refused) or overflows (UBSan);
 * - a refused call changes nothing: ape_kv_pool_get_info() and every id's
 *   ape_kv_pool_sequence_info() are the same before and after, and a refused attend writes no
 *   byte of O or LSE; a refused append is refused for want of pages only when the pages the
 *   append needs (a copy on write included) are more than the free ones;
 * - an accepted call does what it says: the counts of sequences and tokens move as the shadow
 *   kept here says (a fork holds its source's tokens at its positions; an append adds its
 *   tokens, a batch every sequence its own), new ids are never ids seen before, the pages used
 *   stay within what the live sequences' tokens need; and a call the shadow knows is valid
 *   (known distinct ids, well-formed tensors, pages to spare) is not refused;
 * - an accepted attend writes every row: O finite, within the largest |V| its sequence was given
 *   (a convex combination of its values), exactly 0 and LSE -inf for rows that see no key,
 *   LSE finite for the others; entropy in [0, ln(keys) + 1e-3] and mean distance >= 0 where a
 *   key is seen, both 0 elsewhere;
 * - a release frees whole pages only, never more than the sequence's tokens, and the shadow's
 *   token and page counts follow it; attends of a sequence after a release may be refused (the
 *   release's terms), never mis-answered.
 */
#define FUZZ_NAME "fuzz_kvpool"
#include "fuzz_input.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

enum { MAXOPS = 24, MAXB = 8, MAXIDS = 64 };

/* Every tensor a pool fuzzed here may accept holds at most LIMIT elements (the options are
 * filtered so); larger ones lie over memory not mapped. */
#define LIMIT (1u << 16)
#define UNBACKED ((void *)(uintptr_t)0x7f0000000000ull)

/* What the harness knows of each id handed out. */
struct seq {
	int64_t id, n, k_start;
	int64_t rel; /* tokens released (ape_kv_pool_release_unreachable()) */
	bool live;
	float vmax; /* the largest |value| any of its tokens may have */
};

static struct seq ids[MAXIDS];
static int nids;
static ape_kv_pool_options opt; /* as created, defaults resolved */
static int64_t npages;

static struct seq *find(int64_t id)
{
	for (int i = 0; i < nids; i++)
		if (ids[i].id == id)
			return &ids[i];
	return NULL;
}

/* An id: one handed out (live or removed), or raw. */
static int64_t take_id(struct in *in)
{
	const unsigned c = (unsigned)take(in, 1);

	if (!nids || c % 8 == 7)
		return take_int(in);
	return ids[(c / 8) % (unsigned)nids].id;
}

/* ---------------------------------------------------------------- tensors */

/* a * b * c * d when all are in 0..2^20 and the product is at most 2^40, else UINT64_MAX */
static uint64_t elems4(const int64_t d[4])
{
	uint64_t n = 1;

	for (int i = 0; i < 4; i++) {
		if (d[i] < 0 || d[i] > (1 << 20))
			return UINT64_MAX;
		n *= (uint64_t)d[i];
		if (n > (1ull << 40))
			return UINT64_MAX;
	}
	return n;
}

struct blk {
	void *p; /* the block (NULL: the tensor lies over memory not backed) */
	size_t bytes;
	float vmax; /* the largest |value| in it */
};

/*
 * A host tensor d[0..3] of type dt over a block exactly as large as it addresses, filled with
 * small finite values from the input: contiguous (mode 0), packed [n, heads, D] (1), packed
 * with padded rows (2) or raw strides (3, contiguous again when those address more than
 * 4 * LIMIT elements). Past LIMIT elements it lies over memory not backed. Without `fill`
 * (an output) it reads no value from the input.
 */
static void take_tensor(struct in *in, ape_tensor *t, struct blk *b, ape_dtype dt,
			const int64_t d[4], unsigned mode, bool fill)
{
	const size_t esz = ape_dtype_size(dt) ? ape_dtype_size(dt) : 4;
	const uint64_t n = elems4(d);
	uint64_t span = n;
	float *f;

	memset(b, 0, sizeof(*b));
	ape_tensor_init(t, UNBACKED, dt, d[0], d[1], d[2], d[3]);
	if (n > LIMIT)
		return;
	mode &= 3;
	if (mode == 1 || mode == 2) {
		const int64_t row = d[1] * d[3] + (mode == 2 ? (int64_t)(take(in, 1) % 5) : 0);

		t->strides[0] = d[2] * row;
		t->strides[1] = d[3];
		t->strides[2] = row;
		t->strides[3] = 1;
	} else if (mode == 3) {
		for (int i = 0; i < 4; i++)
			t->strides[i] = take_int(in);
	}
	if (mode && (t->strides[0] || t->strides[1] || t->strides[2] || t->strides[3])) {
		span = span_elems(t->shape, t->strides, 4);
		if (n == 0 || span == 0 || span > 4 * LIMIT) { /* contiguous after all */
			memset(t->strides, 0, sizeof(t->strides));
			span = n;
		}
	}
	b->bytes = (size_t)span * esz + 1;
	b->p = malloc(b->bytes);
	f = malloc(sizeof(float) * ((size_t)span + 1));
	check(b->p && f, "malloc");
	for (uint64_t i = 0; i < span; i++) {
		f[i] = fill ? (float)((int)take(in, 1) - 128) / 32 : 0;
		b->vmax = fmaxf(b->vmax, fabsf(f[i]));
	}
	if (ape_dtype_size(dt))
		ape_convert(b->p, dt, f, APE_F32, (size_t)span);
	else
		memcpy(b->p, f, (size_t)span * 4);
	((uint8_t *)b->p)[b->bytes - 1] = 0;
	free(f);
	t->data = b->p;
}

/* One entry of d raw now and then (flag set), the dtype now and then another. */
static void fuzz_dims(struct in *in, bool raw, int64_t d[4], ape_dtype *dt, bool other_dt)
{
	if (raw)
		d[take(in, 1) & 3] = take_int(in);
	if (other_dt)
		*dt = (ape_dtype)(take(in, 1) % 4); /* 3: not a type */
}

/* ---------------------------------------------------------------- the pool's state */

struct state {
	ape_kv_pool_info info;
	int64_t n[MAXIDS], k_start[MAXIDS];
	int rc[MAXIDS];
};

static void snapshot(const ape_kv_pool *pool, struct state *s)
{
	check(ape_kv_pool_get_info(pool, &s->info) == 0, "ape_kv_pool_get_info");
	for (int i = 0; i < nids; i++) {
		s->n[i] = s->k_start[i] = -7;
		s->rc[i] = ape_kv_pool_sequence_info(pool, ids[i].id, &s->n[i], &s->k_start[i]);
	}
}

static bool same_state(const struct state *a, const struct state *b)
{
	if (memcmp(&a->info, &b->info, sizeof(a->info)))
		return false;
	for (int i = 0; i < nids; i++)
		if (a->rc[i] != b->rc[i] || a->n[i] != b->n[i] || a->k_start[i] != b->k_start[i])
			return false;
	return true;
}

static int64_t pages_of(int64_t n)
{
	return (n + opt.page_tokens - 1) / opt.page_tokens;
}

/* The pool agrees with the shadow: its counts, and each id live or unknown as it should be. */
static void agrees(const ape_kv_pool *pool)
{
	struct state s;
	int64_t live = 0, tokens = 0, most = 0, least = 0;

	snapshot(pool, &s);
	for (int i = 0; i < nids; i++) {
		if (!ids[i].live) {
			check(s.rc[i] == APE_EINVAL, "a removed id is unknown");
			continue;
		}
		check(s.rc[i] == 0 && s.n[i] == ids[i].n && s.k_start[i] == ids[i].k_start,
		      "a sequence holds the tokens given it, at its k_start");
		live++;
		tokens += ids[i].n - ids[i].rel;
		most += pages_of(ids[i].n) - ids[i].rel / opt.page_tokens;
		least = pages_of(ids[i].n) - ids[i].rel / opt.page_tokens > least
				? pages_of(ids[i].n) - ids[i].rel / opt.page_tokens
				: least;
	}
	check(s.info.sequences == live, "info.sequences counts the live sequences");
	check(s.info.tokens == tokens, "info.tokens counts their tokens");
	check(s.info.page_tokens == opt.page_tokens && s.info.pages_total == npages,
	      "info.page_tokens, pages_total as created");
	check(s.info.pages_used + s.info.pages_free == s.info.pages_total,
	      "pages used and free make the pool");
	check(s.info.pages_shared >= 0 && s.info.pages_shared <= s.info.pages_used,
	      "shared pages are used pages");
	check(s.info.pages_used >= least && s.info.pages_used <= most,
	      "the pages used are what the live sequences' tokens need (no page lost)");
}

/* ret is 0 or one of the codes `fn` may refuse with, naming it. */
static void refused_or_done(int ret, const char *fn, bool overflow_ok, bool nomem_ok)
{
	char what[160];

	if (!ret)
		return;
	snprintf(what, sizeof(what), "%s returns 0, EINVAL%s%s", fn,
		 overflow_ok ? ", EOVERFLOW" : "", nomem_ok ? ", ENOMEM" : "");
	check(ret == APE_EINVAL || (overflow_ok && ret == APE_EOVERFLOW) ||
		      (nomem_ok && ret == APE_ENOMEM),
	      what);
	snprintf(what, sizeof(what), "the message names %s", fn);
	check(strstr(ape_last_error(), fn) != NULL, what);
}

/* ---------------------------------------------------------------- the calls */

static void op_add(struct in *in, ape_kv_pool *pool)
{
	const unsigned c = (unsigned)take(in, 1);
	int64_t k_start, id = -9;
	int ret;

	if (c & 1) /* near the ends of the range taken */
		k_start = (c & 2 ? ((int64_t)1 << 62) : -((int64_t)1 << 62)) +
			  (int64_t)(int8_t)take(in, 1);
	else
		k_start = take_int(in);
	if (nids == MAXIDS)
		return;
	ret = ape_kv_pool_add_sequence(pool, k_start, c & 4 && c & 8 ? NULL : &id);
	refused_or_done(ret, "ape_kv_pool_add_sequence", true, false);
	if (k_start >= -((int64_t)1 << 62) && k_start < ((int64_t)1 << 62) && !(c & 4 && c & 8))
		check(ret == 0, "add_sequence takes any k_start in [-2^62, 2^62)");
	else
		check(ret != 0, "add_sequence refuses k_start outside [-2^62, 2^62) or no seq_id");
	if (ret)
		return;
	check(id >= 0 && !find(id), "a new id is >= 0 and never one handed out before");
	ids[nids++] = (struct seq){ .id = id, .k_start = k_start, .live = true };
}

static void op_remove(struct in *in, ape_kv_pool *pool)
{
	const int64_t id = take_id(in);
	struct seq *s = find(id);
	int ret = ape_kv_pool_remove_sequence(pool, id);

	refused_or_done(ret, "ape_kv_pool_remove_sequence", false, false);
	check(!ret == (s && s->live), "remove takes exactly the live ids");
	if (!ret)
		s->live = false;
}

static void op_fork(struct in *in, ape_kv_pool *pool)
{
	const int64_t id = take_id(in);
	struct seq *s = find(id);
	int64_t nid = -9;
	int ret;

	if (nids == MAXIDS)
		return;
	ret = ape_kv_pool_fork(pool, id, &nid);
	refused_or_done(ret, "ape_kv_pool_fork", false, true);
	check(!ret == (s && s->live), "fork takes exactly the live ids");
	if (ret)
		return;
	check(nid >= 0 && !find(nid), "a fork's id is >= 0 and never one handed out before");
	ids[nids] = *s;
	ids[nids].id = nid;
	nids++;
}

static void op_info(struct in *in, ape_kv_pool *pool)
{
	const int64_t id = take_id(in);
	const struct seq *s = find(id);
	int64_t n = -9, ks = -9;
	const unsigned c = (unsigned)take(in, 1);
	int ret = ape_kv_pool_sequence_info(pool, id, c & 1 ? NULL : &n, c & 2 ? NULL : &ks);

	refused_or_done(ret, "ape_kv_pool_sequence_info", false, false);
	check(!ret == (s && s->live), "sequence_info knows exactly the live ids");
	check(ret || ((c & 1 || n == s->n) && (c & 2 || ks == s->k_start)),
	      "sequence_info says the tokens and k_start");
}

/* A release. Bits of c: 1, 2: decay (steep 8, mild 0.3, none, negative); 4, 8: skip_tol
 * (1e-3, 0, the default); 16: a bad desc size; 32: desc NULL. */
static void op_release(struct in *in, ape_kv_pool *pool)
{
	static const char fn[] = "ape_kv_pool_release_unreachable";
	static const float decay[4] = { 8.0f, 0.3f, 0.0f, -0.1f };
	const int64_t id = take_id(in);
	const unsigned c = (unsigned)take(in, 1);
	struct seq *s = find(id);
	struct state before, after;
	ape_attn_desc desc;
	int64_t n = -9;
	int ret;

	ape_attn_desc_init(&desc);
	desc.delta.value = decay[c & 3];
	desc.skip_tol = c & 4 ? 1e-3 : c & 8 ? 0.0 : desc.skip_tol;
	if (c & 16)
		desc.struct_size = (size_t)take(in, 1);
	snapshot(pool, &before);
	ret = ape_kv_pool_release_unreachable(pool, id, c & 32 ? NULL : &desc, &n);
	refused_or_done(ret, fn, false, true);
	if (ret) {
		snapshot(pool, &after);
		check(same_state(&before, &after), "a refused release changes nothing");
		check(!(s && s->live && opt.max_query_norm > 0 && !(c & 48)) || ret == APE_ENOMEM,
		      "a release of a live sequence in a pool with max_query_norm is not refused");
		return;
	}
	check(s && s->live && opt.max_query_norm > 0, "release takes live ids of pools that allow it");
	check(n >= 0 && n % opt.page_tokens == 0 && s->rel + n <= s->n,
	      "a release frees whole pages of the sequence's tokens");
	check(n == 0 || decay[c & 3] > 0, "only a decay releases anything");
	s->rel += n;
}

/* A batch's ids and offsets. *clean: live, distinct ids and offsets from 0 up. */
struct batch {
	int64_t nb, idv[MAXB], cu[MAXB + 1], total;
	const int64_t *ids, *cup;
	bool clean;
};

static void take_batch(struct in *in, struct batch *b, unsigned most_each)
{
	const unsigned f = (unsigned)take(in, 1);

	memset(b, 0, sizeof(*b));
	b->nb = (int64_t)(take(in, 1) % (MAXB + 1));
	b->clean = true;
	for (int64_t j = 0; j < b->nb; j++) {
		const struct seq *s;

		b->idv[j] = take_id(in);
		s = find(b->idv[j]);
		b->clean &= s && s->live;
		for (int64_t i = 0; i < j; i++)
			b->clean &= b->idv[i] != b->idv[j];
		b->cu[j + 1] = f & 1 ? take_int(in) : b->cu[j] + (int64_t)(take(in, 1) % most_each);
	}
	if (f & 1)
		b->clean = false;
	if (f & 2) {
		b->cu[0] = take_int(in);
		b->clean &= b->cu[0] == 0;
	}
	b->total = b->cu[b->nb];
	b->ids = b->idv;
	b->cup = b->cu;
	if (f & 4) { /* one array NULL, or a negative count */
		switch (take(in, 1) % 3) {
		case 0:
			b->ids = NULL;
			break;
		case 1:
			b->cup = NULL;
			break;
		default:
			b->nb = -1 - (int64_t)take(in, 1);
		}
		b->clean = false;
	}
	if (f & 8 && b->nb > 0) { /* short: the tensors hold fewer or more rows */
		b->total = (int64_t)(take(in, 1) % 48);
		b->clean &= b->total == b->cu[b->nb];
	}
	if (b->total < 0 || b->total > (1 << 20))
		b->total = 0;
}

/* Tokens, appended to s, need at most this many pages (a copy on write included). */
static int64_t pages_needed_most(const struct seq *s, int64_t n)
{
	return n ? pages_of(s->n + n) - pages_of(s->n) + (s->n % opt.page_tokens != 0) : 0;
}

static void op_append(struct in *in, ape_kv_pool *pool, bool batch)
{
	static const char *const fns[2] = { "ape_kv_pool_append", "ape_kv_pool_append_batch" };
	const char *fn = fns[batch];
	const unsigned f = (unsigned)take(in, 1);
	struct state before, after;
	struct batch b;
	struct blk bk, bv;
	ape_tensor k, v;
	int64_t dk[4], dv[4], need = 0;
	ape_dtype kt = opt.dtype, vt = opt.dtype;
	bool clean;
	int ret;

	if (batch) {
		take_batch(in, &b, 6);
	} else {
		memset(&b, 0, sizeof(b));
		b.nb = 1;
		b.idv[0] = take_id(in);
		b.total = b.cu[1] = (int64_t)(take(in, 1) % 40);
		b.clean = find(b.idv[0]) && find(b.idv[0])->live;
		b.ids = b.idv;
		b.cup = b.cu;
	}
	dk[0] = dv[0] = 1;
	dk[1] = dv[1] = opt.Hkv;
	dk[2] = dv[2] = b.total;
	dk[3] = dv[3] = opt.D;
	fuzz_dims(in, f & 1, dk, &kt, f & 2);
	fuzz_dims(in, f & 4, dv, &vt, f & 8);
	clean = b.clean && !memcmp(dk, dv, sizeof(dk)) && dk[0] == 1 && dk[1] == opt.Hkv &&
		dk[2] == b.total && dk[3] == opt.D && kt == opt.dtype && vt == opt.dtype &&
		((f >> 4) & 3) != 3 && (f >> 6) != 3;
	take_tensor(in, &k, &bk, kt, dk, f >> 4, true);
	take_tensor(in, &v, &bv, vt, dv, f >> 6, true);
	for (int64_t j = 0; clean && j < b.nb; j++)
		need += pages_needed_most(find(b.idv[j]), b.cu[j + 1] - b.cu[j]);
	snapshot(pool, &before);
	ret = batch ? ape_kv_pool_append_batch(pool, b.nb, b.ids, b.cup, &k, &v)
		    : ape_kv_pool_append(pool, b.idv[0], &k, &v);
	refused_or_done(ret, fn, true, true);
	if (ret) {
		snapshot(pool, &after);
		check(same_state(&before, &after), "a refused append changes nothing");
		if (ret == APE_ENOMEM && clean)
			check(need > before.info.pages_free,
			      "an append is refused for want of pages only when they lack");
		if (clean)
			check(ret == APE_ENOMEM, "a valid append is refused only for want of pages");
	} else {
		check(b.nb >= 0, "a negative count is refused");
		for (int64_t j = 0; j < b.nb; j++) {
			struct seq *s = find(b.idv[j]);

			check(s && s->live, "an append names live sequences");
			s->n += batch ? b.cu[j + 1] - b.cu[j] : k.shape[2];
			s->vmax = fmaxf(s->vmax, bv.vmax);
		}
	}
	free(bk.p);
	free(bv.p);
}

/* Element (0, h, i, d) of t as a float. */
static float get(const ape_tensor *t, int64_t h, int64_t i, int64_t d)
{
	const bool compact = !t->strides[0] && !t->strides[1] && !t->strides[2] && !t->strides[3];
	const int64_t s1 = compact ? t->shape[2] * t->shape[3] : t->strides[1];
	const int64_t s2 = compact ? t->shape[3] : t->strides[2];
	const int64_t s3 = compact ? 1 : t->strides[3];
	float x;

	ape_convert(&x, APE_F32,
		    (const char *)t->data + (size_t)(h * s1 + i * s2 + d * s3) *
						    ape_dtype_size(t->dtype),
		    t->dtype, 1);
	return x;
}

/*
 * An attend. Bits of f: 1, 2: q's shape (one entry raw), dtype; 4: explicit positions; 8:
 * stats; 16: o's shape fuzzed; 32: LSE wanted; 64, 128: q's strides mode. Of g: 1: O float32;
 * 2: causal; 4, 8: decay (0.3, or -0.1: no skipping); 16: lambda; 32, 64: skip_tol (1e-3, 0);
 * 128: a field the pool refuses (q_start_set, k_start), a bad desc size, or the first layout.
 */
static void op_attend(struct in *in, ape_kv_pool *pool)
{
	static const char fn[] = "ape_kv_pool_attend";
	const unsigned f = (unsigned)take(in, 1), g = (unsigned)take(in, 1);
	const unsigned omode = (unsigned)take(in, 1);
	const int64_t H = opt.H;
	struct state before, after;
	struct batch b;
	struct blk bq, bo;
	ape_tensor q, o;
	ape_attn_desc desc;
	ape_stats st;
	int64_t dq[4], *posq = NULL;
	ape_dtype qt = opt.dtype, ot = g & 1 ? APE_F32 : opt.dtype;
	float *lse = NULL, *ent = NULL, *md = NULL;
	size_t lse_bytes = 0, diag_bytes = 0;
	bool clean, lse_unbacked = false;
	int ret;

	take_batch(in, &b, 5);
	dq[0] = 1;
	dq[1] = H;
	dq[2] = b.total;
	dq[3] = opt.D;
	fuzz_dims(in, f & 1, dq, &qt, f & 2);
	clean = b.clean && qt == opt.dtype && dq[0] == 1 && dq[1] == H && dq[2] == b.total &&
		dq[3] == opt.D && b.total <= opt.max_batch_tokens && (f >> 6) != 3 &&
		(omode & 3) != 3 && !(f & 16);
	if (f & 4) { /* every row's position: near its sequence's keys, or raw */
		const bool raw = take(in, 1) & 1;
		const int64_t rows = b.total < LIMIT ? b.total : LIMIT;

		posq = malloc(sizeof(int64_t) * (size_t)(rows + 1));
		check(posq != NULL, "malloc");
		for (int64_t i = 0, j = 0; i < rows; i++) {
			const struct seq *s;

			while (j < b.nb && b.cu[j + 1] <= i)
				j++;
			s = j < b.nb ? find(b.idv[j]) : NULL;
			posq[i] = raw ? take_int(in)
				      : (s ? s->k_start + s->n : 0) - 8 + (int64_t)(take(in, 1) % 12);
		}
		clean &= !raw;
	}
	ape_attn_desc_init(&desc);
	desc.causal = g & 2;
	desc.delta.value = g & 4 ? 0.3f : g & 8 ? -0.1f : 0.0f;
	desc.lambda.value = g & 16 ? 0.2f : 0.0f;
	desc.skip_tol = g & 32 ? 1e-3 : g & 64 ? 0.0 : desc.skip_tol;
	if (g & 128) {
		switch (take(in, 1) % 4) {
		case 0:
			desc.q_start_set = true;
			desc.q_start = take_int(in);
			clean = false;
			break;
		case 1:
			desc.k_start = take_int(in);
			clean &= desc.k_start == 0;
			break;
		case 2:
			desc.struct_size = (size_t)take(in, 1);
			clean = false;
			break;
		default: /* a caller of the first layout */
			desc.struct_size = APE_ATTN_DESC_V1_SIZE;
			if (take(in, 1) & 1) {
				desc.skip_tol = -1.0;
				clean = false;
			}
			break;
		}
	}
	take_tensor(in, &q, &bq, qt, dq, f >> 6, true);
	if (f & 16)
		fuzz_dims(in, true, dq, &ot, true);
	clean &= ot == opt.dtype || ot == APE_F32;
	take_tensor(in, &o, &bo, ot, dq, omode, false);
	if (bo.p)
		memset(bo.p, 0x5a, bo.bytes);
	if (f & 32) { /* LSE [total_q, H], total_q = q->shape[2] */
		if (q.shape[2] >= 0 && q.shape[2] <= LIMIT && q.shape[2] * H <= LIMIT) {
			lse_bytes = sizeof(float) * (size_t)(q.shape[2] * H) + 1;
			lse = malloc(lse_bytes);
			check(lse != NULL, "malloc");
			memset(lse, 0x5a, lse_bytes);
		} else {
			lse = UNBACKED; /* the call must refuse the tensors first */
			lse_unbacked = true;
		}
	}
	ape_stats_init(&st);
	if (f & 8 && g & 128 && omode & 4) {
		st.struct_size = 3;
		clean = false;
	}
	if (omode & 8 && q.shape[2] >= 0 && q.shape[2] <= LIMIT && q.shape[2] * H <= LIMIT) {
		/* the diagnostics: each wanted or not, poisoned to see what is written */
		diag_bytes = sizeof(float) * (size_t)(q.shape[2] * H) + 1;
		ent = omode & 16 ? NULL : malloc(diag_bytes);
		md = omode & 32 ? NULL : malloc(diag_bytes);
		if (ent)
			memset(ent, 0x5a, diag_bytes);
		if (md)
			memset(md, 0x5a, diag_bytes);
	}
	for (int64_t j = 0; j < b.nb; j++) { /* a release's terms may refuse the attend */
		const struct seq *s = find(b.idv[j]);

		clean &= !(s && s->rel);
	}
	snapshot(pool, &before);
	if (omode & 8)
		ret = ape_kv_pool_attend_diag(pool, &desc, b.nb, b.ids, b.cup, posq, &q, &o, lse,
					      ent, md, f & 8 ? &st : NULL);
	else
		ret = ape_kv_pool_attend(pool, &desc, b.nb, b.ids, b.cup, posq, &q, &o, lse,
					 f & 8 ? &st : NULL);
	refused_or_done(ret, omode & 8 ? "ape_kv_pool_attend_diag" : fn, true, false);
	snapshot(pool, &after);
	check(same_state(&before, &after), "an attend changes nothing in the pool");
	if (ret) {
		if (clean)
			fprintf(stderr, "fuzz_kvpool: valid attend refused: %s\n", ape_last_error());
		check(!clean, "a valid attend is not refused");
		for (size_t i = 0; bo.p && i < bo.bytes; i++)
			check(((uint8_t *)bo.p)[i] == 0x5a, "a refused attend writes no O");
		for (size_t i = 0; !lse_unbacked && i < lse_bytes; i++)
			check(((uint8_t *)lse)[i] == 0x5a, "a refused attend writes no LSE");
		for (size_t i = 0; ent && i < diag_bytes; i++)
			check(((uint8_t *)ent)[i] == 0x5a, "a refused attend writes no entropy");
		for (size_t i = 0; md && i < diag_bytes; i++)
			check(((uint8_t *)md)[i] == 0x5a, "a refused attend writes no distance");
	} else {
		check(!lse_unbacked && bo.p != NULL, "an attend over memory it cannot have is refused");
		check(!(f & 8) || st.pairs_computed <= st.pairs_visible,
		      "pairs computed are visible pairs");
		for (int64_t j = 0; j < b.nb; j++) {
			const struct seq *s = find(b.idv[j]);
			const int64_t lq = b.cu[j + 1] - b.cu[j];

			check(s && s->live, "an attend names live sequences");
			for (int64_t i = b.cu[j]; i < b.cu[j + 1]; i++) {
				const int64_t p = posq ? posq[i] : s->k_start + s->n - lq + (i - b.cu[j]);
				const bool seen = s->n > 0 && (!desc.causal || p >= s->k_start);
				const float tol = s->vmax * 1e-2f + 1e-4f;

				for (int64_t h = 0; h < H; h++) {
					const float l = lse ? lse[i * H + h] : 0;
					const float e = ent ? ent[i * H + h] : 0;
					const float dm = md ? md[i * H + h] : 0;

					check(seen ? e >= -1e-3f && e <= logf((float)s->n) + 1e-3f
						   : e == 0,
					      "entropy in [0, ln(keys)] where a key is seen, else 0");
					check(seen ? dm >= 0 : dm == 0,
					      "mean distance >= 0 where a key is seen, else 0");

					check(!lse || (seen ? isfinite(l) : isinf(l) && l < 0),
					      "LSE finite where a key is seen, -inf elsewhere");
					for (int64_t d = 0; d < opt.D; d++) {
						const float x = get(&o, h, i, d);

						check(isfinite(x) && fabsf(x) <= s->vmax + tol,
						      "O a convex combination of the sequence's V");
						check(seen || x == 0, "O = 0 where no key is seen");
					}
				}
			}
		}
	}
	free(posq);
	free(bq.p);
	free(bo.p);
	free(ent);
	free(md);
	if (!lse_unbacked)
		free(lse);
}

/* ---------------------------------------------------------------- the pool */

/* Options whose pools keep every tensor a call may accept within LIMIT elements, and the host
 * tables and device memory of a create small. */
static bool small_enough(const ape_kv_pool_options *o)
{
	const int64_t P = o->page_tokens ? o->page_tokens : 16;
	const int64_t mb = o->max_batch_tokens ? o->max_batch_tokens : 256;
	const int64_t H = o->H > 0 ? o->H : o->Hkv;
	int64_t pages, d[4];

	if (o->Hkv < 1 || o->D < 2 || o->capacity_tokens < 1 || P < 1 || mb < 1 || H < 1 ||
	    o->capacity_tokens > ((int64_t)1 << 40) || P > 65536 || mb > (1 << 20))
		return true; /* refused before anything is allocated */
	pages = (o->capacity_tokens + P - 1) / P;
	d[0] = pages, d[1] = P, d[2] = o->Hkv, d[3] = o->D;
	if (elems4(d) > LIMIT)
		return false;
	d[0] = mb, d[1] = H, d[2] = o->D, d[3] = 1;
	return elems4(d) <= LIMIT && o->attend_chunk <= (1 << 12);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct in in = { data, size };
	const unsigned f = (unsigned)take(&in, 1);
	ape_kv_pool *pool = (ape_kv_pool *)(uintptr_t)1; /* must be NULL after a failure */
	ape_kv_pool_options o;
	int ret;

	ape_kv_pool_options_init(&o);
	o.Hkv = take_int(&in);
	o.H = f & 1 ? take_int(&in) : 0;
	o.D = (int64_t)((uint64_t)take_int(&in) * 2);
	o.dtype = (ape_dtype)(take(&in, 1) % 4); /* 3: not a type */
	o.page_tokens = f & 2 ? take_int(&in) : (int64_t)(take(&in, 1) % 9);
	o.capacity_tokens = take_int(&in);
	o.max_batch_tokens = f & 4 ? take_int(&in) : (int64_t)(take(&in, 1) % 40);
	o.attend_chunk = f & 8 ? take_int(&in) : (int64_t)(take(&in, 1) % 80);
	o.max_device_bytes = f & 16 ? take(&in, 3) % (8u << 20) : 0;
	if (f & 32)
		o.struct_size = (size_t)take(&in, 1);
	if (f & 64) { /* releases allowed; sometimes a bound refused */
		const unsigned m = (unsigned)take(&in, 1);

		o.max_query_norm = m == 255 ? NAN : m == 254 ? -1.0 : (double)(m % 40);
	}
	if (!small_enough(&o))
		return 0;
	ret = ape_kv_pool_create(ref, &o, &pool);
	refused_or_done(ret, "ape_kv_pool_create", true, true);
	if (ret) {
		check(pool == NULL, "a failed create leaves *out NULL");
		return 0;
	}
	opt = o;
	opt.H = o.H ? o.H : o.Hkv;
	opt.page_tokens = o.page_tokens ? o.page_tokens : 16;
	opt.max_batch_tokens = o.max_batch_tokens ? o.max_batch_tokens : 256;
	npages = (o.capacity_tokens + opt.page_tokens - 1) / opt.page_tokens;
	nids = 0;
	agrees(pool);
	for (int i = 0; i < MAXOPS && in.n; i++) {
		switch (take(&in, 1) % 9) {
		case 0:
		case 7:
			op_add(&in, pool);
			break;
		case 8:
			op_release(&in, pool);
			break;
		case 1:
			op_remove(&in, pool);
			break;
		case 2:
			op_fork(&in, pool);
			break;
		case 3:
			op_append(&in, pool, false);
			break;
		case 4:
			op_append(&in, pool, true);
			break;
		case 5:
			op_attend(&in, pool);
			break;
		default:
			op_info(&in, pool);
		}
		agrees(pool);
	}
	ape_kv_pool_destroy(pool);
	return 0;
}
