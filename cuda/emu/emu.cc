/* SPDX-License-Identifier: MIT */
/*
 * The CPU runtime of the kernel emulator (see emu.h): a block's threads are fibers (ucontext)
 * of the calling OS thread, run one at a time; a fiber runs until it reaches a collective
 * (barrier, shuffle, ldmatrix, mma), which completes when all of its participants have arrived.
 * Blocks of a grid run one after the other. Everything a launch needs lives on the launching
 * thread, so several threads may launch at once.
 *
 * The warp-level matrix instructions follow the PTX ISA ("Matrix Fragments for mma.m16n8k16",
 * "ldmatrix"): with g = lane / 4 and q = lane % 4,
 *   A (16x16, row): a0 = A[g][2q..2q+1], a1 = A[g+8][2q..], a2 = A[g][2q+8..], a3 = A[g+8][2q+8..]
 *   B (16x8, col):  b0 = B[2q..2q+1][g], b1 = B[2q+8..2q+9][g]
 *   C/D (16x8):     c0, c1 = C[g][2q], C[g][2q+1]; c2, c3 = C[g+8][2q], C[g+8][2q+1]
 *   ldmatrix x4: lanes 8m..8m+7 address the 8 rows (16 bytes each) of matrix m; lane t receives
 *   in register m the elements (t/4, 2(t%4)) and (t/4, 2(t%4)+1), or with .trans (2(t%4), t/4)
 *   and (2(t%4)+1, t/4); the lower-indexed element goes to the low 16 bits.
 */
#include "emu.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "emu_api.h"

namespace ape_emu {

namespace {

struct copy {
	void *dst;
	const void *src;
	unsigned bytes;
};

enum fstate { F_RUN, F_WAIT, F_DONE };

struct fiber {
	ucontext_t ctx;
	thread_info ti;
	int lane, warp;
	fstate state;
	unsigned wait_gen;
	bool wait_block; /* waiting at the block barrier (else at a warp collective) */
	std::vector<copy> open;
	std::deque<std::vector<copy>> committed;
};

struct warp_state {
	int arrived = 0;
	wop op = W_SYNC;
	unsigned gen = 0;
	unsigned char in[32][48];
	unsigned char out[32][16];
};

struct block_state {
	std::vector<fiber> fibers;
	std::vector<warp_state> warps;
	unsigned char *smem = nullptr;
	int nthreads = 0;
	int bar_arrived = 0, bar_or = 0, bar_and = 1, bar_mode = 0;
	int bar_res = 0;
	unsigned bar_gen = 0;
	ucontext_t sched;
	fiber *current = nullptr;
	kernel_fn fn = nullptr;
	const void *params = nullptr;
	std::string error;
};

thread_local block_state *tls_block;

std::map<std::string, std::pair<kernel_fn, size_t>> &registry()
{
	static std::map<std::string, std::pair<kernel_fn, size_t>> r;
	return r;
}

void fail(block_state *b, const std::string &why)
{
	if (b->error.empty())
		b->error = why;
}

/* Gives control back to the scheduler until this fiber is runnable again. */
void park(block_state *b, fiber *f)
{
	f->state = F_WAIT;
	swapcontext(&f->ctx, &b->sched);
}

float mma_el(wop op, uint32_t w, int hi)
{
	const uint16_t h = (uint16_t)(hi ? w >> 16 : w & 0xffffu);

	return op == W_MMA_F16 ? ape__f16_to_f32(h) : ape__bf16_to_f32(h);
}

void do_mma(warp_state *w)
{
	float A[16][16], B[16][8], C[16][8];

	for (int t = 0; t < 32; t++) {
		uint32_t r[10];
		const int g = t / 4, q = t % 4;

		memcpy(r, w->in[t], sizeof(r));
		for (int e = 0; e < 2; e++) {
			A[g][2 * q + e] = mma_el(w->op, r[0], e);
			A[g + 8][2 * q + e] = mma_el(w->op, r[1], e);
			A[g][2 * q + 8 + e] = mma_el(w->op, r[2], e);
			A[g + 8][2 * q + 8 + e] = mma_el(w->op, r[3], e);
			B[2 * q + e][g] = mma_el(w->op, r[4], e);
			B[2 * q + 8 + e][g] = mma_el(w->op, r[5], e);
		}
		C[g][2 * q] = __uint_as_float(r[6]);
		C[g][2 * q + 1] = __uint_as_float(r[7]);
		C[g + 8][2 * q] = __uint_as_float(r[8]);
		C[g + 8][2 * q + 1] = __uint_as_float(r[9]);
	}
	for (int t = 0; t < 32; t++) {
		const int g = t / 4, q = t % 4;
		const int rows[4] = { g, g, g + 8, g + 8 }, cols[4] = { 2 * q, 2 * q + 1, 2 * q, 2 * q + 1 };
		float d[4];

		for (int e = 0; e < 4; e++) {
			float s = C[rows[e]][cols[e]];

			for (int k = 0; k < 16; k++)
				s += A[rows[e]][k] * B[k][cols[e]];
			d[e] = s;
		}
		memcpy(w->out[t], d, sizeof(d));
	}
}

void do_ldsm(warp_state *w, bool trans)
{
	uint16_t M[4][8][8];

	for (int m = 0; m < 4; m++)
		for (int r = 0; r < 8; r++) {
			const unsigned char *p;

			memcpy(&p, w->in[8 * m + r], sizeof(p));
			memcpy(M[m][r], p, 16);
		}
	for (int t = 0; t < 32; t++) {
		uint32_t reg[4];

		for (int m = 0; m < 4; m++) {
			uint16_t lo, hi;

			if (!trans) {
				lo = M[m][t / 4][2 * (t % 4)];
				hi = M[m][t / 4][2 * (t % 4) + 1];
			} else {
				lo = M[m][2 * (t % 4)][t / 4];
				hi = M[m][2 * (t % 4) + 1][t / 4];
			}
			reg[m] = (uint32_t)lo | (uint32_t)hi << 16;
		}
		memcpy(w->out[t], reg, sizeof(reg));
	}
}

void complete(warp_state *w)
{
	switch (w->op) {
	case W_SHFL_XOR:
	case W_SHFL_IDX:
		for (int t = 0; t < 32; t++) {
			int v[2], src;

			memcpy(v, w->in[t], sizeof(v));
			src = w->op == W_SHFL_XOR ? (t ^ v[1]) & 31 : v[1] & 31;
			memcpy(w->out[t], w->in[src], 4);
		}
		break;
	case W_SYNC:
		break;
	case W_LDSM:
	case W_LDSM_T:
		do_ldsm(w, w->op == W_LDSM_T);
		break;
	case W_MMA_F16:
	case W_MMA_BF16:
		do_mma(w);
		break;
	}
}

void flush_copies(fiber *f, size_t keep)
{
	while (f->committed.size() > keep) {
		for (const copy &c : f->committed.front()) {
			unsigned char tmp[16] = { 0 };

			memcpy(tmp, c.src, c.bytes);
			memcpy(c.dst, tmp, 16);
		}
		f->committed.pop_front();
	}
}

void fiber_main(unsigned lo, unsigned hi)
{
	block_state *b = (block_state *)(((uintptr_t)hi << 32) | lo);
	fiber *f = b->current;

	b->fn(b->params);
	if (!f->open.empty() || !f->committed.empty())
		fail(b, "a thread exited with cp.async copies it never waited for");
	flush_copies(f, 0);
	f->state = F_DONE;
	swapcontext(&f->ctx, &b->sched);
}

/* Fiber stacks: the kernels use about 6 KB (15 KB under ASan at -O1), measured. Small stacks
 * matter: ASan clears the shadow of the whole stack at every switch. A PROT_NONE page below each
 * turns an overflow into a clean SIGSEGV instead of a write into the neighbouring stack. */
const size_t STACK = 64 * 1024;
const size_t GUARD = 4096;

struct stacks {
	std::vector<void *> mem;
	~stacks()
	{
		for (void *p : mem)
			munmap((unsigned char *)p - GUARD, STACK + GUARD);
	}
};

thread_local stacks tls_stacks;

void *stack_for(size_t i)
{
	while (tls_stacks.mem.size() <= i) {
		unsigned char *p = (unsigned char *)mmap(nullptr, STACK + GUARD,
							 PROT_READ | PROT_WRITE,
							 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

		if (p == MAP_FAILED)
			return nullptr;
		if (mprotect(p, GUARD, PROT_NONE)) {
			munmap(p, STACK + GUARD);
			return nullptr;
		}
		tls_stacks.mem.push_back(p + GUARD);
	}
	return tls_stacks.mem[i];
}

/* The context of a fiber that starts in fiber_main(b) on stack stk. A function of its own:
 * getcontext returns twice as far as the compiler knows, which would make every local of a
 * larger caller suspect (-Wclobbered). */
__attribute__((noinline)) void make_fiber(ucontext_t *ctx, void *stk, block_state *b)
{
	getcontext(ctx);
	ctx->uc_stack.ss_sp = stk;
	ctx->uc_stack.ss_size = STACK;
	ctx->uc_link = nullptr;
	makecontext(ctx, (void (*)())fiber_main, 2, (unsigned)(uintptr_t)b,
		    (unsigned)((uintptr_t)b >> 32));
}

/* Runs one block to completion; false with b->error set when it cannot. */
bool run_block(block_state *b, idx3 bid, idx3 bdim, idx3 gdim, size_t smem_bytes)
{
	const int n = (int)(bdim.x * bdim.y * bdim.z);

	b->nthreads = n;
	b->fibers.assign(n, fiber());
	b->warps.assign((n + 31) / 32, warp_state());
	b->bar_arrived = 0;
	free(b->smem);
	b->smem = (unsigned char *)malloc(smem_bytes ? smem_bytes : 1);
	if (!b->smem) {
		fail(b, "out of memory for shared memory");
		return false;
	}
	/* uninitialised shared memory reads as NaN, so a kernel that uses it shows */
	memset(b->smem, 0xff, smem_bytes);
	for (int i = 0; i < n; i++) {
		fiber &f = b->fibers[i];
		void *stk = stack_for((size_t)i);

		if (!stk) {
			fail(b, "out of memory for fiber stacks");
			return false;
		}
		f.ti.tid = { (unsigned)(i % bdim.x), (unsigned)(i / bdim.x % bdim.y),
			     (unsigned)(i / (bdim.x * bdim.y)) };
		f.ti.bid = bid;
		f.ti.bdim = bdim;
		f.ti.gdim = gdim;
		f.lane = i % 32;
		f.warp = i / 32;
		f.state = F_RUN;
		make_fiber(&f.ctx, stk, b);
	}
	for (;;) {
		bool progress = false, all_done = true;

		for (int i = 0; i < n && b->error.empty(); i++) {
			fiber &f = b->fibers[i];

			if (f.state == F_DONE)
				continue;
			all_done = false;
			if (f.state != F_RUN)
				continue;
			b->current = &f;
			swapcontext(&b->sched, &f.ctx);
			progress = true;
		}
		if (!b->error.empty())
			return false;
		if (all_done)
			return true;
		if (!progress) {
			int at_bar = 0, at_warp = 0, done = 0;

			for (const fiber &f : b->fibers) {
				done += f.state == F_DONE;
				at_bar += f.state == F_WAIT && f.wait_block;
				at_warp += f.state == F_WAIT && !f.wait_block;
			}
			fail(b, "deadlock: " + std::to_string(at_bar) + " threads at a barrier, " +
					std::to_string(at_warp) + " at a warp collective, " +
					std::to_string(done) + " exited (a barrier some threads cannot reach?)");
			return false;
		}
	}
}

} /* namespace */

const thread_info *cur()
{
	return &tls_block->current->ti;
}

unsigned char *smem()
{
	return tls_block->smem;
}

void warp_op(wop op, const void *in, size_t n, void *out, size_t outn)
{
	block_state *b = tls_block;
	fiber *f = b->current;
	warp_state *w = &b->warps[f->warp];
	const int lanes = b->nthreads - 32 * f->warp < 32 ? b->nthreads - 32 * f->warp : 32;
	unsigned gen;

	if (lanes != 32)
		fail(b, "warp collective in a partial warp");
	if (w->arrived == 0)
		w->op = op;
	else if (w->op != op)
		fail(b, "divergent warp: lanes at different collectives (" + std::to_string(w->op) +
				" and " + std::to_string(op) + ")");
	if (n > sizeof(w->in[0]))
		fail(b, "warp collective input too large");
	if (!b->error.empty()) {
		park(b, f); /* the launch is over */
		return;
	}
	if (n) /* a collective without input (a bare warp sync) may pass none */
		memcpy(w->in[f->lane], in, n);
	gen = w->gen;
	if (++w->arrived == lanes) {
		complete(w);
		w->arrived = 0;
		w->gen++;
		for (int t = 0; t < 32; t++) {
			fiber &o = b->fibers[32 * f->warp + t];

			if (o.state == F_WAIT && !o.wait_block && o.wait_gen == gen)
				o.state = F_RUN;
		}
	} else {
		f->wait_gen = gen;
		f->wait_block = false;
		while (w->gen == gen && b->error.empty())
			park(b, f);
	}
	if (outn)
		memcpy(out, w->out[f->lane], outn);
}

int block_bar(int pred, int mode)
{
	block_state *b = tls_block;
	fiber *f = b->current;
	unsigned gen = b->bar_gen;
	int res;

	if (b->bar_arrived == 0) {
		b->bar_mode = mode;
		b->bar_or = 0;
		b->bar_and = 1;
	} else if (b->bar_mode != mode) {
		fail(b, "threads at different kinds of barrier");
	}
	b->bar_or |= pred != 0;
	b->bar_and &= pred != 0;
	if (++b->bar_arrived == b->nthreads) {
		b->bar_res = mode == 1 ? b->bar_or : mode == 2 ? b->bar_and : 0;
		b->bar_arrived = 0;
		b->bar_gen++;
		for (fiber &o : b->fibers)
			if (o.state == F_WAIT && o.wait_block && o.wait_gen == gen)
				o.state = F_RUN;
		return b->bar_res;
	}
	f->wait_gen = gen;
	f->wait_block = true;
	while (b->bar_gen == gen && b->error.empty())
		park(b, f);
	res = b->bar_res; /* read before anyone can complete the next barrier */
	return res;
}

void cp_async(void *dst, const void *src, unsigned src_bytes)
{
	block_state *b = tls_block;

	if (((uintptr_t)dst & 15) || ((uintptr_t)src & 15))
		fail(b, "cp.async with an address not aligned to 16 bytes");
	if (src_bytes > 16)
		fail(b, "cp.async src-size above 16");
	if ((unsigned char *)dst < b->smem)
		fail(b, "cp.async destination outside shared memory");
	b->current->open.push_back(copy{ dst, src, src_bytes });
}

void cp_commit()
{
	fiber *f = tls_block->current;

	f->committed.push_back(std::move(f->open));
	f->open.clear();
}

void cp_wait(int n)
{
	flush_copies(tls_block->current, (size_t)n);
}

reg::reg(const char *name, kernel_fn fn, size_t param_bytes)
{
	registry()[name] = std::make_pair(fn, param_bytes);
}

} /* namespace ape_emu */

/* runtime/core/half.c comes with ape_convert(), which reports errors through libape's ape__error();
 * the emulated driver does not link libape and never calls ape_convert(). */
extern "C" __attribute__((visibility("hidden"))) int ape__error(int err, const char *fmt, ...)
{
	(void)fmt;
	return err;
}

/* ------------------------------------------------------------------ the C interface */

extern "C" void *ape_emu_find(const char *name)
{
	auto &r = ape_emu::registry();
	auto it = r.find(name);

	return it == r.end() ? nullptr : (void *)&it->second;
}

extern "C" int ape_emu_launch(void *kernel, const unsigned grid[3], const unsigned block[3],
			      size_t smem_bytes, void **params, char *err, size_t errlen)
{
	auto *k = (std::pair<ape_emu::kernel_fn, size_t> *)kernel;
	ape_emu::block_state b;
	ape_emu::block_state *saved = ape_emu::tls_block;
	std::vector<unsigned char> p(k->second);
	int ret = 0;

	if (!params || !params[0]) {
		snprintf(err, errlen, "kernel parameters missing");
		return -1;
	}
	memcpy(p.data(), params[0], k->second);
	if ((size_t)block[0] * block[1] * block[2] > 1024 || block[0] * block[1] * block[2] == 0) {
		snprintf(err, errlen, "bad block size");
		return -1;
	}
	b.fn = k->first;
	b.params = p.data();
	ape_emu::tls_block = &b;
	for (unsigned z = 0; z < grid[2] && !ret; z++)
		for (unsigned y = 0; y < grid[1] && !ret; y++)
			for (unsigned x = 0; x < grid[0] && !ret; x++) {
				const ape_emu::idx3 bid = { x, y, z }, bd = { block[0], block[1], block[2] },
						    gd = { grid[0], grid[1], grid[2] };

				if (!ape_emu::run_block(&b, bid, bd, gd, smem_bytes)) {
					snprintf(err, errlen, "block (%u,%u,%u): %s", x, y, z,
						 b.error.c_str());
					ret = -1;
				}
			}
	free(b.smem);
	ape_emu::tls_block = saved;
	return ret;
}
