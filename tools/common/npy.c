/* SPDX-License-Identifier: MIT */
/*
 * .npy reader and writer. The format: 6 magic bytes "\x93NUMPY", a major and a minor version byte,
 * the header length (little-endian u16 in version 1, u32 in versions 2 and 3), then the header,
 * a Python dict literal padded with spaces and ended by '\n', then the raw data.
 *
 * The reader is written for hostile input: every length is checked before it is used, no C
 * string function ever runs on file bytes (they hold no terminating NUL), and nothing is
 * allocated on the strength of a number in the file alone.
 */
#include "npy.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAGIC_LEN 6
#define NPY_ALIGN 64
/* Spare spaces NumPy >= 1.23 leaves after the dict so that the first axis can grow in place. */
#define NPY_GROWTH_DIGITS 21
#define NPY_ACCEPTED "accepted: '<f4' (float32) and '<f2' (float16)"

/* ------------------------------------------------------------------ messages */

static int failv(int code, char *err, size_t errlen, const char *fmt, va_list ap)
{
	if (err && errlen)
		vsnprintf(err, errlen, fmt, ap);
	return code;
}

static int __attribute__((format(printf, 4, 5)))
fail(int code, char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	failv(code, err, errlen, fmt, ap);
	va_end(ap);
	return code;
}

/* A bounded string builder: output is cut short, never overrun, and always terminated. */
struct sbuf {
	char *p;
	size_t cap;
	size_t len; /* what would have been written without the bound */
};

static void __attribute__((format(printf, 2, 3))) sb_printf(struct sbuf *sb, const char *fmt, ...)
{
	size_t used = sb->len < sb->cap ? sb->len : sb->cap;
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(sb->p + used, sb->cap - used, fmt, ap);
	va_end(ap);
	if (n > 0)
		sb->len += (size_t)n;
}

/* File bytes shown in a message: printable ASCII as is, the rest escaped, long text cut short. */
static void quote_bytes(const unsigned char *s, size_t n, char *out, size_t cap)
{
	struct sbuf sb = { out, cap, 0 };
	size_t shown = n > 40 ? 40 : n;

	out[0] = '\0';
	for (size_t i = 0; i < shown; i++) {
		if (s[i] >= 0x20 && s[i] < 0x7f && s[i] != '\\')
			sb_printf(&sb, "%c", s[i]);
		else
			sb_printf(&sb, "\\x%02x", s[i]);
	}
	if (shown < n)
		sb_printf(&sb, "...");
}

void npy_format_shape(const int64_t *shape, int ndim, char *out, size_t cap)
{
	struct sbuf sb = { out, cap, 0 };

	sb_printf(&sb, "(");
	for (int i = 0; i < ndim; i++)
		sb_printf(&sb, "%s%" PRId64, i ? ", " : "", shape[i]);
	sb_printf(&sb, ndim == 1 ? ",)" : ")");
}

static const char *descr_of(ape_dtype dt)
{
	return dt == APE_F32 ? "<f4" : dt == APE_F16 ? "<f2" : NULL;
}

/* ------------------------------------------------------------------ header dictionary */

struct cursor {
	const unsigned char *s;
	size_t len;
	size_t pos;
	bool allow_long; /* Python 2 wrote shapes as (3L, 4L): versions 1 and 2 only */
	char *err;
	size_t errlen;
};

static int __attribute__((format(printf, 2, 3))) bad(struct cursor *c, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	failv(APE_EFORMAT, c->err, c->errlen, fmt, ap);
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

		quote_bytes(c->s + c->pos, c->len - c->pos, q, sizeof(q));
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
	if (bytes_are(d, n, "<f4")) {
		info->dtype = APE_F32;
		return 0;
	}
	if (bytes_are(d, n, "<f2")) {
		info->dtype = APE_F16;
		return 0;
	}
	quote_bytes(d, n, q, sizeof(q));
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
	quote_bytes(digits, n, q, sizeof(q));
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
	quote_bytes(key, n, q, sizeof(q));
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
		return fail(APE_EFORMAT, err, errlen, "the file is empty: not a .npy file");
	if (!memcmp(b, NPY_MAGIC, m))
		return 0;
	quote_bytes(b, m, q, sizeof(q));
	if (len >= 2 && b[0] == 'P' && b[1] == 'K')
		return fail(APE_EFORMAT, err, errlen,
			    "not a .npy file (bad magic '%s'): this looks like a .npz (zip) "
			    "archive; save one array with np.save", q);
	return fail(APE_EFORMAT, err, errlen,
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
		return fail(APE_EFORMAT, err, errlen,
			    "truncated .npy preamble: the file has only %zu bytes", len);
	if (b[6] < 1 || b[6] > 3 || b[7] != 0)
		return fail(APE_EFORMAT, err, errlen,
			    "unsupported .npy format version %u.%u (supported: 1.0, 2.0, 3.0)",
			    b[6], b[7]);
	info->version = b[6];
	pre = info->version == 1 ? 10 : 12;
	if (len < pre)
		return fail(APE_EFORMAT, err, errlen,
			    "truncated .npy preamble: the file has only %zu bytes, version %d.0 "
			    "needs %zu", len, info->version, pre);
	*hdr_len = info->version == 1 ? (size_t)(b[8] | b[9] << 8) : le32(b + 8);
	if (*hdr_len > NPY_MAX_HEADER_LEN)
		return fail(APE_EFORMAT, err, errlen,
			    "header length %zu is absurd (the limit is %u bytes)", *hdr_len,
			    NPY_MAX_HEADER_LEN);
	if (*hdr_len > len - pre)
		return fail(APE_EFORMAT, err, errlen,
			    "truncated header: its length is %zu bytes, but only %zu follow the "
			    "preamble", *hdr_len, len - pre);
	info->data_offset = pre + *hdr_len;
	return 0;
}

/* count and nbytes from the shape, refusing what NumPy could not hold either. */
static int compute_size(struct npy_info *info, char *err, size_t errlen)
{
	size_t esize = ape_dtype_size(info->dtype);
	uint64_t nonzero = 1;
	bool empty = false;
	char shp[256];

	npy_format_shape(info->shape, info->ndim, shp, sizeof(shp));
	/* Even with a zero dimension the others must fit NumPy's intp, as np.empty demands. */
	for (int i = 0; i < info->ndim; i++) {
		uint64_t d = (uint64_t)info->shape[i];

		if (d == 0) {
			empty = true;
			continue;
		}
		if (nonzero > (uint64_t)INT64_MAX / d)
			return fail(APE_EFORMAT, err, errlen,
				    "shape %s is absurd: its element count overflows 64 bits", shp);
		nonzero *= d;
	}
	info->count = empty ? 0 : nonzero;
	if (info->count > SIZE_MAX / esize)
		return fail(APE_EFORMAT, err, errlen,
			    "shape %s is absurd: %" PRIu64 " elements of '%s' need more bytes than "
			    "size_t can count", shp, info->count, descr_of(info->dtype));
	info->nbytes = (size_t)info->count * esize;
	return 0;
}

/* Everything up to the data: preamble, header dict, sizes. buf holds at least the header. */
static int parse_header(const unsigned char *b, size_t len, struct npy_info *info, char *err,
			size_t errlen)
{
	struct cursor c;
	size_t hlen = 0;
	int ret;

	memset(info, 0, sizeof(*info));
	ret = parse_preamble(b, len, info, &hlen, err, errlen);
	if (ret)
		return ret;
	if (hlen == 0 || b[info->data_offset - 1] != '\n')
		return fail(APE_EFORMAT, err, errlen,
			    "malformed header: it does not end with '\\n' (NumPy pads the header "
			    "with spaces and a final newline)");
	c = (struct cursor){ .s = b + info->data_offset - hlen, .len = hlen - 1,
			     .allow_long = info->version < 3, .err = err, .errlen = errlen };
	ret = parse_dict(&c, info);
	if (ret)
		return ret;
	return compute_size(info, err, errlen);
}

static int check_data_size(const struct npy_info *info, uint64_t have, char *err, size_t errlen)
{
	char shp[256];

	if (have == info->nbytes)
		return 0;
	npy_format_shape(info->shape, info->ndim, shp, sizeof(shp));
	if (have < info->nbytes)
		return fail(APE_EFORMAT, err, errlen,
			    "truncated data: shape %s of '%s' needs %zu bytes, but only %" PRIu64
			    " follow the header", shp, descr_of(info->dtype), info->nbytes, have);
	return fail(APE_EFORMAT, err, errlen,
		    "the file has %" PRIu64 " extra bytes after the data (shape %s of '%s' needs "
		    "%zu bytes)", have - info->nbytes, shp, descr_of(info->dtype), info->nbytes);
}

int npy_parse(const void *buf, size_t len, struct npy_info *info, char *err, size_t errlen)
{
	int ret;

	if (!buf && len)
		return fail(APE_EINVAL, err, errlen, "npy_parse: buf = NULL");
	ret = parse_header(buf, len, info, err, errlen);
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
			return fail(APE_EIO, err, errlen, "%s: read failed: %s", path,
				    strerror(errno));
		if (r == 0)
			return fail(APE_EIO, err, errlen, "%s: the file shrank while being read",
				    path);
		p += r;
		off += r;
		n -= (size_t)r;
	}
	return 0;
}

/* The header (at most the preamble plus NPY_MAX_HEADER_LEN bytes), checked against the size. */
static int load_header(int fd, uint64_t size, struct npy_info *info, const char *path, char *err,
		       size_t errlen)
{
	size_t cap = size < 12 + (uint64_t)NPY_MAX_HEADER_LEN ? (size_t)size
							       : 12 + NPY_MAX_HEADER_LEN;
	unsigned char *head = malloc(cap ? cap : 1);
	char msg[512];
	int ret;

	if (!head)
		return fail(APE_ENOMEM, err, errlen, "%s: out of memory reading the header", path);
	ret = read_at(fd, head, cap, 0, path, err, errlen);
	if (ret)
		goto out_free_head;
	ret = parse_header(head, cap, info, msg, sizeof(msg));
	if (!ret)
		ret = check_data_size(info, size - info->data_offset, msg, sizeof(msg));
	if (ret)
		fail(ret, err, errlen, "%s: %s", path, msg);
out_free_head:
	free(head);
	return ret;
}

int npy_load(const char *path, struct npy_array *arr, char *err, size_t errlen)
{
	struct stat st;
	int fd, ret;

	memset(arr, 0, sizeof(*arr));
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return fail(APE_EIO, err, errlen, "%s: cannot open: %s", path, strerror(errno));
	if (fstat(fd, &st)) {
		ret = fail(APE_EIO, err, errlen, "%s: cannot stat: %s", path, strerror(errno));
		goto out_close;
	}
	if (!S_ISREG(st.st_mode)) {
		ret = fail(APE_EIO, err, errlen, "%s: not a regular file", path);
		goto out_close;
	}
	ret = load_header(fd, (uint64_t)st.st_size, &arr->info, path, err, errlen);
	if (ret)
		goto out_close;
	/* The size now matches the header exactly, so this allocation is what the file holds. */
	arr->data = malloc(arr->info.nbytes ? arr->info.nbytes : 1);
	if (!arr->data) {
		ret = fail(APE_ENOMEM, err, errlen, "%s: out of memory for %zu bytes of data", path,
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

void npy_free(struct npy_array *arr)
{
	if (!arr)
		return;
	free(arr->data);
	memset(arr, 0, sizeof(*arr));
}

/* ------------------------------------------------------------------ writing */

/* The dict text exactly as NumPy's _write_array_header() produces it. */
static void format_dict(struct sbuf *sb, const char *descr, int ndim, const int64_t *shape)
{
	char shp[NPY_MAX_DIMS * 22 + 4];

	npy_format_shape(shape, ndim, shp, sizeof(shp));
	sb_printf(sb, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", descr, shp);
	if (ndim > 0)
		sb_printf(sb, "%*s", NPY_GROWTH_DIGITS - snprintf(NULL, 0, "%" PRId64, shape[0]),
			  "");
}

static int check_array_args(ape_dtype dtype, int ndim, const int64_t *shape, char *err,
			    size_t errlen)
{
	if (!descr_of(dtype))
		return fail(APE_EINVAL, err, errlen, "npy: dtype %d: only f32 and f16 can be saved",
			    (int)dtype);
	if (ndim < 0 || ndim > NPY_MAX_DIMS || (ndim && !shape))
		return fail(APE_EINVAL, err, errlen, "npy: ndim = %d: must be 0..%d with a shape",
			    ndim, NPY_MAX_DIMS);
	for (int i = 0; i < ndim; i++)
		if (shape[i] < 0)
			return fail(APE_EINVAL, err, errlen, "npy: shape[%d] = %" PRId64
				    ": must be >= 0", i, shape[i]);
	return 0;
}

int npy_format_header(char *buf, size_t cap, ape_dtype dtype, int ndim, const int64_t *shape,
		      int version, size_t *len, char *err, size_t errlen)
{
	char dict[NPY_MAX_DIMS * 22 + 128];
	struct sbuf sb = { dict, sizeof(dict), 0 };
	size_t pre, hlen, pad;
	int ret;

	ret = check_array_args(dtype, ndim, shape, err, errlen);
	if (ret)
		return ret;
	if (version < 0 || version > 2)
		return fail(APE_EINVAL, err, errlen, "npy: version %d: must be 0, 1 or 2", version);
	format_dict(&sb, descr_of(dtype), ndim, shape);
	/* header = dict, spaces, '\n', so that preamble + header is a multiple of NPY_ALIGN */
	hlen = sb.len + 1;
	/* like np.save: the oldest version whose length field can hold the header */
	if (!version)
		version = hlen + NPY_ALIGN - (10 + hlen) % NPY_ALIGN <= 65535 ? 1 : 2;
	pre = version == 1 ? 10 : 12;
	pad = NPY_ALIGN - (pre + hlen) % NPY_ALIGN;
	if (version == 1 && hlen + pad > 65535)
		return fail(APE_EINVAL, err, errlen,
			    "npy: a %zu-byte header does not fit format version 1.0", hlen + pad);
	if (cap < pre + hlen + pad)
		return fail(APE_EINVAL, err, errlen, "npy: header needs %zu bytes, buffer has %zu",
			    pre + hlen + pad, cap);
	memcpy(buf, NPY_MAGIC, NPY_MAGIC_LEN);
	buf[6] = (char)version;
	buf[7] = 0;
	for (size_t i = 0; i < pre - 8; i++)
		buf[8 + i] = (char)(((hlen + pad) >> (8 * i)) & 0xff);
	memcpy(buf + pre, dict, sb.len);
	memset(buf + pre + sb.len, ' ', pad);
	buf[pre + hlen + pad - 1] = '\n';
	*len = pre + hlen + pad;
	return 0;
}

static int write_all(int fd, const void *buf, size_t n)
{
	const unsigned char *p = buf;

	while (n) {
		ssize_t w = write(fd, p, n > (1u << 30) ? (1u << 30) : n);

		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0)
			return -1;
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

/*
 * Creates "DIR/.BASE.tmpXXXXXXXXXXXX" exclusively. Not mkstemp(): that creates the file 0600,
 * while np.save gives 0666 & ~umask, and reading the umask means changing it under any other
 * thread. O_EXCL with a random name is what mkstemp does, with the caller's mode.
 */
static int create_tmp(const char *path, char **tmp_out, int *fd_out, char *err, size_t errlen)
{
	const char *slash = strrchr(path, '/');
	int dirlen = slash ? (int)(slash - path + 1) : 0;
	const char *base = path + dirlen;
	size_t size = (size_t)dirlen + 200 + 32;
	char *tmp;

	if (!*base)
		return fail(APE_EINVAL, err, errlen, "%s: names a directory, not a file", path);
	tmp = malloc(size);
	if (!tmp)
		return fail(APE_ENOMEM, err, errlen, "%s: out of memory", path);
	for (int tries = 0; tries < 64; tries++) {
		uint64_t r = 0;

		if (getrandom(&r, sizeof(r), GRND_NONBLOCK) != (ssize_t)sizeof(r))
			r ^= (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid() ^
			     (uint64_t)tries << 48;
		/* the base is cut short so that a long name still leaves room under NAME_MAX */
		snprintf(tmp, size, "%.*s.%.200s.tmp%012" PRIx64, dirlen, path, base,
			 (uint64_t)(r & 0xffffffffffffull));
		*fd_out = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
		if (*fd_out >= 0) {
			*tmp_out = tmp;
			return 0;
		}
		if (errno != EEXIST)
			break;
	}
	fail(APE_EIO, err, errlen, "%s: cannot create a temporary file next to it: %s", path,
	     strerror(errno));
	free(tmp);
	return APE_EIO;
}

static int write_tmp(int fd, const char *path, const char *hdr, size_t hlen, const void *data,
		     size_t nbytes, char *err, size_t errlen)
{
	if (write_all(fd, hdr, hlen) || write_all(fd, data, nbytes))
		return fail(APE_EIO, err, errlen, "%s: write failed: %s", path, strerror(errno));
	/* the rename must never publish a name whose data is still only in the page cache */
	if (fsync(fd))
		return fail(APE_EIO, err, errlen, "%s: fsync failed: %s", path, strerror(errno));
	return 0;
}

int npy_write_pending(struct npy_pending *p, const char *path, ape_dtype dtype, int ndim,
		      const int64_t *shape, const void *data, int version, char *err,
		      size_t errlen)
{
	char hdr[4096];
	struct npy_info info = { .dtype = dtype, .ndim = ndim };
	size_t hlen;
	char *tmp = NULL;
	int fd = -1, ret;

	memset(p, 0, sizeof(*p));
	ret = npy_format_header(hdr, sizeof(hdr), dtype, ndim, shape, version, &hlen, err, errlen);
	if (ret)
		return ret;
	if (ndim)
		memcpy(info.shape, shape, (size_t)ndim * sizeof(*shape));
	if (compute_size(&info, err, errlen))
		return APE_EINVAL;
	if (!data && info.nbytes)
		return fail(APE_EINVAL, err, errlen, "%s: data = NULL for %zu bytes", path,
			    info.nbytes);
	p->path = strdup(path);
	if (!p->path)
		return fail(APE_ENOMEM, err, errlen, "%s: out of memory", path);
	ret = create_tmp(path, &tmp, &fd, err, errlen);
	if (ret)
		goto out_free_path;
	ret = write_tmp(fd, path, hdr, hlen, data, info.nbytes, err, errlen);
	if (close(fd) && !ret)
		ret = fail(APE_EIO, err, errlen, "%s: close failed: %s", path, strerror(errno));
	if (ret)
		goto out_unlink;
	p->tmp = tmp;
	return 0;

out_unlink:
	unlink(tmp);
	free(tmp);
out_free_path:
	free(p->path);
	p->path = NULL;
	return ret;
}

/* Makes the rename itself durable. Best effort: the file is complete either way, and some
 * filesystems refuse fsync on a directory. */
static void sync_dir_of(const char *path)
{
	const char *slash = strrchr(path, '/');
	char *dir = slash ? strndup(path, (size_t)(slash - path + 1)) : strdup(".");
	int fd;

	if (!dir)
		return;
	fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd >= 0) {
		fsync(fd);
		close(fd);
	}
	free(dir);
}

int npy_commit(struct npy_pending *p, char *err, size_t errlen)
{
	int ret = 0;

	if (!p->tmp)
		return fail(APE_EINVAL, err, errlen, "npy_commit: nothing is pending");
	if (rename(p->tmp, p->path)) {
		ret = fail(APE_EIO, err, errlen, "%s: cannot rename %s into place: %s", p->path,
			   p->tmp, strerror(errno));
		unlink(p->tmp);
	} else {
		sync_dir_of(p->path);
	}
	free(p->tmp);
	free(p->path);
	memset(p, 0, sizeof(*p));
	return ret;
}

void npy_discard(struct npy_pending *p)
{
	if (!p)
		return;
	if (p->tmp)
		unlink(p->tmp);
	free(p->tmp);
	free(p->path);
	memset(p, 0, sizeof(*p));
}

int npy_save(const char *path, ape_dtype dtype, int ndim, const int64_t *shape, const void *data,
	     char *err, size_t errlen)
{
	struct npy_pending p;
	int ret;

	ret = npy_write_pending(&p, path, dtype, ndim, shape, data, 0, err, errlen);
	if (ret)
		return ret;
	return npy_commit(&p, err, errlen);
}
