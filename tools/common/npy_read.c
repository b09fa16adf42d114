/* SPDX-License-Identifier: MIT */
/*
 * .npy reader. The format: 6 magic bytes "\x93NUMPY", a major and a minor version byte, the header
 * length (little-endian u16 in version 1, u32 in versions 2 and 3), then the header, a Python dict
 * literal padded with spaces and ended by '\n', then the raw data.
 *
 * The reader is written for hostile input: every length is checked before it is used, no C
 * string function ever runs on file bytes (they hold no terminating NUL), and nothing is
 * allocated on the strength of a number in the file alone.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "npy_internal.h"

/* ------------------------------------------------------------------ header dictionary */

struct cursor {
	const unsigned char *s;
	size_t len;
	size_t pos;
	bool allow_long; /* Python 2 wrote shapes as (3L, 4L): versions 1 and 2 only */
	bool ints; /* '<i8' and '<i4' accepted instead of the floats (npy_load_int64()) */
	char *err;
	size_t errlen;
};

static int __attribute__((format(printf, 2, 3))) bad(struct cursor *c, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	npy__failv(APE_EFORMAT, c->err, c->errlen, fmt, ap);
	va_end(ap);
	return APE_EFORMAT;
}

/* "expected X at byte N of the header, found Y" */
static int expected(struct cursor *c, const char *what)
{
	char found[200];

	if (c->pos >= c->len)
		snprintf(found, sizeof(found), "the end of the header");
	else {
		char q[180];

		npy__quote_bytes(c->s + c->pos, c->len - c->pos, q, sizeof(q));
		snprintf(found, sizeof(found), "'%s'", q);
	}
	return bad(c, "malformed header: expected %s at byte %zu of the header, found %s", what,
		   c->pos, found);
}

static bool is_space(int ch)
{
	return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\f' || ch == '\v';
}

static bool is_digit(int ch)
{
	return ch >= '0' && ch <= '9';
}

static int peek(struct cursor *c)
{
	while (c->pos < c->len && is_space(c->s[c->pos]))
		c->pos++;
	return c->pos < c->len ? c->s[c->pos] : -1;
}

static int expect_char(struct cursor *c, int ch, const char *what)
{
	if (peek(c) != ch)
		return expected(c, what);
	c->pos++;
	return 0;
}

/* A quoted Python string without escapes (NumPy never writes any). */
static int parse_string(struct cursor *c, const char *what, const unsigned char **str, size_t *n)
{
	size_t start;
	int q = peek(c);

	if (q != '\'' && q != '"')
		return expected(c, what);
	start = ++c->pos;
	for (; c->pos < c->len && c->s[c->pos] != q; c->pos++) {
		if (c->s[c->pos] == '\\')
			return bad(c, "malformed header: escape sequence in a string at byte "
				      "%zu of the header (NumPy writes none)", c->pos);
		if (c->s[c->pos] == '\n')
			break;
	}
	if (c->pos >= c->len || c->s[c->pos] != q)
		return bad(c, "malformed header: unterminated string starting at byte %zu of the "
			      "header", start - 1);
	*str = c->s + start;
	*n = c->pos - start;
	c->pos++;
	return 0;
}

static bool bytes_are(const unsigned char *s, size_t n, const char *lit)
{
	return n == strlen(lit) && !memcmp(s, lit, n);
}

/* A bare word: True, False, None, or the start of something else we will refuse. */
static size_t word_len(struct cursor *c)
{
	size_t n = 0;

	peek(c);
	while (c->pos + n < c->len) {
		int ch = c->s[c->pos + n];

		if (!(is_digit(ch) || ch == '_' || (ch >= 'a' && ch <= 'z') ||
		      (ch >= 'A' && ch <= 'Z')))
			break;
		n++;
	}
	return n;
}

/* The integer arrays npy_load_int64() reads. */
static int parse_int_descr(struct cursor *c, const unsigned char *d, size_t n,
			   struct npy_info *info)
{
	char q[180];

	if (bytes_are(d, n, "<i8") || bytes_are(d, n, "<i4")) {
		info->int_bytes = d[2] - '0';
		return 0;
	}
	npy__quote_bytes(d, n, q, sizeof(q));
	if (n == 3 && (d[0] == '>' || d[0] == '=') && d[1] == 'i' && (d[2] == '8' || d[2] == '4'))
		return bad(c, "dtype '%s' is not supported: only little-endian ('<') integers are "
			      "accepted, save with arr.astype('<i%c'); " NPY_ACCEPTED_INT, q, d[2]);
	return bad(c, "dtype '%s' is not supported; " NPY_ACCEPTED_INT
		      " (convert with arr.astype(np.int64))", q);
}

static int parse_descr(struct cursor *c, struct npy_info *info)
{
	const unsigned char *d;
	char q[180];
	size_t n;
	int ret;

	if (peek(c) == '[')
		return bad(c, "structured dtype (a list 'descr') is not supported; " NPY_ACCEPTED);
	ret = parse_string(c, "a string for 'descr'", &d, &n);
	if (ret)
		return ret;
	if (c->ints)
		return parse_int_descr(c, d, n, info);
	if (bytes_are(d, n, "<f4")) {
		info->dtype = APE_F32;
		return 0;
	}
	if (bytes_are(d, n, "<f2")) {
		info->dtype = APE_F16;
		return 0;
	}
	npy__quote_bytes(d, n, q, sizeof(q));
	if (n == 3 && (d[1] == 'f') && (d[2] == '4' || d[2] == '2'))
		return bad(c, "dtype '%s' is not supported: only little-endian ('<') floats are "
			      "accepted, save with arr.astype('<f%c'); " NPY_ACCEPTED, q, d[2]);
	return bad(c, "dtype '%s' is not supported; " NPY_ACCEPTED
		      " (convert with arr.astype(np.float32))", q);
}

static int parse_fortran(struct cursor *c)
{
	size_t n = word_len(c);

	if (bytes_are(c->s + c->pos, n, "False")) {
		c->pos += n;
		return 0;
	}
	if (bytes_are(c->s + c->pos, n, "True"))
		return bad(c, "Fortran order is not supported; save with np.ascontiguousarray");
	return expected(c, "True or False for 'fortran_order'");
}

/* A dimension: a decimal integer, optionally signed, so that "-1" is refused by name. */
static int parse_dim(struct cursor *c, int64_t *out)
{
	const unsigned char *digits;
	bool neg = false, big = false;
	uint64_t v = 0;
	size_t n = 0;
	char q[180];
	int sign;

	sign = peek(c);
	if (sign == '-' || sign == '+') {
		neg = sign == '-';
		c->pos++;
	}
	if (!is_digit(peek(c)))
		return expected(c, "an integer dimension in 'shape'");
	digits = c->s + c->pos;
	for (; c->pos < c->len && is_digit(c->s[c->pos]); c->pos++, n++) {
		unsigned dgt = c->s[c->pos] - '0';

		if (v > (UINT64_MAX - dgt) / 10)
			big = true;
		else
			v = v * 10 + dgt;
	}
	if (c->allow_long && c->pos < c->len && (c->s[c->pos] == 'L' || c->s[c->pos] == 'l'))
		c->pos++;
	npy__quote_bytes(digits, n, q, sizeof(q));
	if (n > 1 && digits[0] == '0')
		return bad(c, "malformed header: dimension %s in 'shape' has a leading zero", q);
	if (neg && (v || big))
		return bad(c, "negative dimension -%s in 'shape'", q);
	if (big || v > INT64_MAX)
		return bad(c, "dimension %s in 'shape' is too large (the limit is %" PRId64 ")", q,
			   INT64_MAX);
	*out = (int64_t)v;
	return 0;
}

static int parse_shape(struct cursor *c, struct npy_info *info)
{
	bool trailing_comma = false;
	int n = 0, ret;

	if (peek(c) == '[')
		return bad(c, "'shape' is a list; a .npy header holds a tuple such as (2, 3)");
	ret = expect_char(c, '(', "a tuple for 'shape'");
	if (ret)
		return ret;
	for (;;) {
		if (peek(c) == ')')
			break;
		if (n == NPY_MAX_DIMS)
			return bad(c, "'shape' has more than %d dimensions", NPY_MAX_DIMS);
		ret = parse_dim(c, &info->shape[n++]);
		if (ret)
			return ret;
		trailing_comma = peek(c) == ',';
		if (!trailing_comma)
			break;
		c->pos++;
	}
	ret = expect_char(c, ')', "',' or ')' in 'shape'");
	if (ret)
		return ret;
	/* In Python "(3)" is the integer 3, not a tuple: NumPy refuses it too. */
	if (n == 1 && !trailing_comma)
		return bad(c, "'shape' is (%" PRId64 "), an integer in parentheses; a 1-D shape is "
			      "written (%" PRId64 ",)", info->shape[0], info->shape[0]);
	info->ndim = n;
	return 0;
}

enum { KEY_DESCR = 1, KEY_FORTRAN = 2, KEY_SHAPE = 4, KEY_ALL = 7 };

static int parse_item(struct cursor *c, struct npy_info *info, unsigned *seen)
{
	const unsigned char *key;
	unsigned which;
	size_t n;
	char q[180];
	int ret;

	ret = parse_string(c, "a quoted key or '}'", &key, &n);
	if (ret)
		return ret;
	npy__quote_bytes(key, n, q, sizeof(q));
	if (bytes_are(key, n, "descr"))
		which = KEY_DESCR;
	else if (bytes_are(key, n, "fortran_order"))
		which = KEY_FORTRAN;
	else if (bytes_are(key, n, "shape"))
		which = KEY_SHAPE;
	else
		return bad(c, "unexpected key '%s' in the header (a .npy header has exactly "
			      "'descr', 'fortran_order' and 'shape')", q);
	if (*seen & which)
		return bad(c, "key '%s' appears twice in the header", q);
	*seen |= which;
	ret = expect_char(c, ':', "':' after a key");
	if (ret)
		return ret;
	if (which == KEY_DESCR)
		return parse_descr(c, info);
	if (which == KEY_FORTRAN)
		return parse_fortran(c);
	return parse_shape(c, info);
}

static int parse_dict(struct cursor *c, struct npy_info *info)
{
	unsigned seen = 0;
	int ret;

	ret = expect_char(c, '{', "'{' (a Python dict)");
	if (ret)
		return ret;
	while (peek(c) != '}') {
		ret = parse_item(c, info, &seen);
		if (ret)
			return ret;
		if (peek(c) != ',')
			break;
		c->pos++;
	}
	ret = expect_char(c, '}', "',' or '}' after a value");
	if (ret)
		return ret;
	if (peek(c) >= 0)
		return expected(c, "only padding after the dict");
	if (seen != KEY_ALL)
		return bad(c, "the header has no '%s' key",
			   !(seen & KEY_DESCR) ? "descr" : !(seen & KEY_SHAPE) ? "shape" :
			   "fortran_order");
	return 0;
}

/* ------------------------------------------------------------------ preamble and sizes */

static uint32_t le32(const unsigned char *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int check_magic(const unsigned char *b, size_t len, char *err, size_t errlen)
{
	size_t m = len < NPY_MAGIC_LEN ? len : NPY_MAGIC_LEN;
	char q[180];

	if (len == 0)
		return npy__fail(APE_EFORMAT, err, errlen, "the file is empty: not a .npy file");
	if (!memcmp(b, NPY_MAGIC, m))
		return 0;
	npy__quote_bytes(b, m, q, sizeof(q));
	if (len >= 2 && b[0] == 'P' && b[1] == 'K')
		return npy__fail(APE_EFORMAT, err, errlen,
			    "not a .npy file (bad magic '%s'): this looks like a .npz (zip) "
			    "archive; save one array with np.save", q);
	return npy__fail(APE_EFORMAT, err, errlen,
		    "not a .npy file (bad magic: starts with '%s', expected '\\x93NUMPY')", q);
}

/* Checks the preamble; sets the version and where the header lies. */
static int parse_preamble(const unsigned char *b, size_t len, struct npy_info *info,
			  size_t *hdr_len, char *err, size_t errlen)
{
	size_t pre;
	int ret;

	ret = check_magic(b, len, err, errlen);
	if (ret)
		return ret;
	if (len < NPY_MAGIC_LEN + 2)
		return npy__fail(APE_EFORMAT, err, errlen,
			    "truncated .npy preamble: the file has only %zu bytes", len);
	if (b[6] < 1 || b[6] > 3 || b[7] != 0)
		return npy__fail(APE_EFORMAT, err, errlen,
			    "unsupported .npy format version %u.%u (supported: 1.0, 2.0, 3.0)",
			    b[6], b[7]);
	info->version = b[6];
	pre = info->version == 1 ? 10 : 12;
	if (len < pre)
		return npy__fail(APE_EFORMAT, err, errlen,
			    "truncated .npy preamble: the file has only %zu bytes, version %d.0 "
			    "needs %zu", len, info->version, pre);
	*hdr_len = info->version == 1 ? (size_t)(b[8] | b[9] << 8) : le32(b + 8);
	if (*hdr_len > NPY_MAX_HEADER_LEN)
		return npy__fail(APE_EFORMAT, err, errlen,
			    "header length %zu is absurd (the limit is %u bytes)", *hdr_len,
			    NPY_MAX_HEADER_LEN);
	if (*hdr_len > len - pre)
		return npy__fail(APE_EFORMAT, err, errlen,
			    "truncated header: its length is %zu bytes, but only %zu follow the "
			    "preamble", *hdr_len, len - pre);
	info->data_offset = pre + *hdr_len;
	return 0;
}

/* count and nbytes from the shape, refusing what NumPy could not hold either. */

/* Everything up to the data: preamble, header dict, sizes. buf holds at least the header. */
static int parse_header(const unsigned char *b, size_t len, struct npy_info *info, bool ints,
			char *err, size_t errlen)
{
	struct cursor c;
	size_t hlen = 0;
	int ret;

	memset(info, 0, sizeof(*info));
	ret = parse_preamble(b, len, info, &hlen, err, errlen);
	if (ret)
		return ret;
	if (hlen == 0 || b[info->data_offset - 1] != '\n')
		return npy__fail(APE_EFORMAT, err, errlen,
			    "malformed header: it does not end with '\\n' (NumPy pads the header "
			    "with spaces and a final newline)");
	c = (struct cursor){ .s = b + info->data_offset - hlen, .len = hlen - 1,
			     .allow_long = info->version < 3, .ints = ints, .err = err,
			     .errlen = errlen };
	ret = parse_dict(&c, info);
	if (ret)
		return ret;
	return npy__compute_size(info, err, errlen);
}

static int check_data_size(const struct npy_info *info, uint64_t have, char *err, size_t errlen)
{
	char shp[256];

	if (have == info->nbytes)
		return 0;
	npy_format_shape(info->shape, info->ndim, shp, sizeof(shp));
	if (have < info->nbytes)
		return npy__fail(APE_EFORMAT, err, errlen,
			    "truncated data: shape %s of '%s' needs %zu bytes, but only %" PRIu64
			    " follow the header", shp, npy__info_descr(info), info->nbytes, have);
	return npy__fail(APE_EFORMAT, err, errlen,
		    "the file has %" PRIu64 " extra bytes after the data (shape %s of '%s' needs "
		    "%zu bytes)", have - info->nbytes, shp, npy__info_descr(info), info->nbytes);
}

int npy_parse(const void *buf, size_t len, struct npy_info *info, char *err, size_t errlen)
{
	int ret;

	if (!buf && len)
		return npy__fail(APE_EINVAL, err, errlen, "npy_parse: buf = NULL");
	ret = parse_header(buf, len, info, false, err, errlen);
	if (ret)
		return ret;
	return check_data_size(info, len - info->data_offset, err, errlen);
}

/* ------------------------------------------------------------------ loading */

/* Reads exactly n bytes at off; a file that ends early is reported as having changed. */
static int read_at(int fd, void *buf, size_t n, off_t off, const char *path, char *err,
		   size_t errlen)
{
	unsigned char *p = buf;

	while (n) {
		ssize_t r = pread(fd, p, n > (1u << 30) ? (1u << 30) : n, off);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return npy__fail(APE_EIO, err, errlen, "%s: read failed: %s", path,
				    strerror(errno));
		if (r == 0)
			return npy__fail(APE_EIO, err, errlen, "%s: the file shrank while being read",
				    path);
		p += r;
		off += r;
		n -= (size_t)r;
	}
	return 0;
}

/* The header (at most the preamble plus NPY_MAX_HEADER_LEN bytes), checked against the size. */
static int load_header(int fd, uint64_t size, struct npy_info *info, bool ints, const char *path,
		       char *err, size_t errlen)
{
	size_t cap = size < 12 + (uint64_t)NPY_MAX_HEADER_LEN ? (size_t)size
							       : 12 + NPY_MAX_HEADER_LEN;
	unsigned char *head = malloc(cap ? cap : 1);
	char msg[512];
	int ret;

	if (!head)
		return npy__fail(APE_ENOMEM, err, errlen, "%s: out of memory reading the header", path);
	ret = read_at(fd, head, cap, 0, path, err, errlen);
	if (ret)
		goto out_free_head;
	ret = parse_header(head, cap, info, ints, msg, sizeof(msg));
	if (!ret)
		ret = check_data_size(info, size - info->data_offset, msg, sizeof(msg));
	if (ret)
		npy__fail(ret, err, errlen, "%s: %s", path, msg);
out_free_head:
	free(head);
	return ret;
}

/* npy_load(), of float arrays or (ints) of '<i8' and '<i4' ones. */
static int load(const char *path, struct npy_array *arr, bool ints, char *err, size_t errlen)
{
	struct stat st;
	int fd, ret;

	memset(arr, 0, sizeof(*arr));
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return npy__fail(APE_EIO, err, errlen, "%s: cannot open: %s", path, strerror(errno));
	if (fstat(fd, &st)) {
		ret = npy__fail(APE_EIO, err, errlen, "%s: cannot stat: %s", path, strerror(errno));
		goto out_close;
	}
	if (!S_ISREG(st.st_mode)) {
		ret = npy__fail(APE_EIO, err, errlen, "%s: not a regular file", path);
		goto out_close;
	}
	ret = load_header(fd, (uint64_t)st.st_size, &arr->info, ints, path, err, errlen);
	if (ret)
		goto out_close;
	/* The size now matches the header exactly, so this allocation is what the file holds. */
	arr->data = malloc(arr->info.nbytes ? arr->info.nbytes : 1);
	if (!arr->data) {
		ret = npy__fail(APE_ENOMEM, err, errlen, "%s: out of memory for %zu bytes of data", path,
			   arr->info.nbytes);
		goto out_close;
	}
	ret = read_at(fd, arr->data, arr->info.nbytes, (off_t)arr->info.data_offset, path, err,
		      errlen);
	if (ret)
		npy_free(arr);
out_close:
	close(fd);
	if (ret)
		memset(arr, 0, sizeof(*arr));
	return ret;
}

int npy_load(const char *path, struct npy_array *arr, char *err, size_t errlen)
{
	return load(path, arr, false, err, errlen);
}

int npy_load_int64(const char *path, bool allow_i4, int64_t **vals, int64_t *n, char *err,
		   size_t errlen)
{
	struct npy_array arr;
	char shp[256];
	int64_t *v;
	int ret;

	*vals = NULL;
	*n = 0;
	ret = load(path, &arr, true, err, errlen);
	if (ret)
		return ret;
	if (arr.info.ndim != 1) {
		npy_format_shape(arr.info.shape, arr.info.ndim, shp, sizeof(shp));
		npy_free(&arr);
		return npy__fail(APE_EFORMAT, err, errlen, "%s: shape %s: must be 1-D", path, shp);
	}
	if (arr.info.int_bytes == 4 && !allow_i4) {
		npy_free(&arr);
		return npy__fail(APE_EFORMAT, err, errlen,
			    "%s: dtype '<i4' (int32) is not accepted here: save it as '<i8' (int64), "
			    "arr.astype(np.int64)", path);
	}
	if (arr.info.int_bytes == 8) {
		*vals = arr.data; /* malloc'ed: aligned for int64 */
		*n = arr.info.shape[0];
		return 0;
	}
	v = malloc(arr.info.count ? arr.info.count * sizeof(int64_t) : 1);
	if (!v) {
		npy_free(&arr);
		return npy__fail(APE_ENOMEM, err, errlen, "%s: out of memory", path);
	}
	for (uint64_t i = 0; i < arr.info.count; i++) {
		int32_t x;

		memcpy(&x, (const char *)arr.data + i * 4, 4);
		v[i] = x;
	}
	*vals = v;
	*n = arr.info.shape[0];
	npy_free(&arr);
	return 0;
}

void npy_free(struct npy_array *arr)
{
	if (!arr)
		return;
	free(arr->data);
	memset(arr, 0, sizeof(*arr));
}

