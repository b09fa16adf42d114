/* SPDX-License-Identifier: MIT */
/*
 * .npy writer: byte-for-byte what np.save writes, made atomic (temporary file in the target's
 * directory, fsync, rename), so a reader never sees a partial file.
 */
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

#include "npy_internal.h"

/* ------------------------------------------------------------------ writing */

/* The dict text exactly as NumPy's _write_array_header() produces it. */
static void format_dict(struct sbuf *sb, const char *descr, int ndim, const int64_t *shape)
{
	char shp[NPY_MAX_DIMS * 22 + 4];

	npy_format_shape(shape, ndim, shp, sizeof(shp));
	npy__sb_printf(sb, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", descr, shp);
	if (ndim > 0)
		npy__sb_printf(sb, "%*s", NPY_GROWTH_DIGITS - snprintf(NULL, 0, "%" PRId64, shape[0]),
			  "");
}

static int check_array_args(ape_dtype dtype, int ndim, const int64_t *shape, char *err,
			    size_t errlen)
{
	if (!npy__descr_of(dtype))
		return npy__fail(APE_EINVAL, err, errlen, "npy: dtype %d: only f32 and f16 can be saved",
			    (int)dtype);
	if (ndim < 0 || ndim > NPY_MAX_DIMS || (ndim && !shape))
		return npy__fail(APE_EINVAL, err, errlen, "npy: ndim = %d: must be 0..%d with a shape",
			    ndim, NPY_MAX_DIMS);
	for (int i = 0; i < ndim; i++)
		if (shape[i] < 0)
			return npy__fail(APE_EINVAL, err, errlen, "npy: shape[%d] = %" PRId64
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
		return npy__fail(APE_EINVAL, err, errlen, "npy: version %d: must be 0, 1 or 2", version);
	format_dict(&sb, npy__descr_of(dtype), ndim, shape);
	/* header = dict, spaces, '\n', so that preamble + header is a multiple of NPY_ALIGN */
	hlen = sb.len + 1;
	/* like np.save: the oldest version whose length field can hold the header */
	if (!version)
		version = hlen + NPY_ALIGN - (10 + hlen) % NPY_ALIGN <= 65535 ? 1 : 2;
	pre = version == 1 ? 10 : 12;
	pad = NPY_ALIGN - (pre + hlen) % NPY_ALIGN;
	if (version == 1 && hlen + pad > 65535)
		return npy__fail(APE_EINVAL, err, errlen,
			    "npy: a %zu-byte header does not fit format version 1.0", hlen + pad);
	if (cap < pre + hlen + pad)
		return npy__fail(APE_EINVAL, err, errlen, "npy: header needs %zu bytes, buffer has %zu",
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
		return npy__fail(APE_EINVAL, err, errlen, "%s: names a directory, not a file", path);
	tmp = malloc(size);
	if (!tmp)
		return npy__fail(APE_ENOMEM, err, errlen, "%s: out of memory", path);
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
	npy__fail(APE_EIO, err, errlen, "%s: cannot create a temporary file next to it: %s", path,
	     strerror(errno));
	free(tmp);
	return APE_EIO;
}

static int write_tmp(int fd, const char *path, const char *hdr, size_t hlen, const void *data,
		     size_t nbytes, char *err, size_t errlen)
{
	if (write_all(fd, hdr, hlen) || write_all(fd, data, nbytes))
		return npy__fail(APE_EIO, err, errlen, "%s: write failed: %s", path, strerror(errno));
	/* the rename must never publish a name whose data is still only in the page cache */
	if (fsync(fd))
		return npy__fail(APE_EIO, err, errlen, "%s: fsync failed: %s", path, strerror(errno));
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
	if (npy__compute_size(&info, err, errlen))
		return APE_EINVAL;
	if (!data && info.nbytes)
		return npy__fail(APE_EINVAL, err, errlen, "%s: data = NULL for %zu bytes", path,
			    info.nbytes);
	p->path = strdup(path);
	if (!p->path)
		return npy__fail(APE_ENOMEM, err, errlen, "%s: out of memory", path);
	ret = create_tmp(path, &tmp, &fd, err, errlen);
	if (ret)
		goto out_free_path;
	ret = write_tmp(fd, path, hdr, hlen, data, info.nbytes, err, errlen);
	if (close(fd) && !ret)
		ret = npy__fail(APE_EIO, err, errlen, "%s: close failed: %s", path, strerror(errno));
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
		return npy__fail(APE_EINVAL, err, errlen, "npy_commit: nothing is pending");
	if (rename(p->tmp, p->path)) {
		ret = npy__fail(APE_EIO, err, errlen, "%s: cannot rename %s into place: %s", p->path,
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

