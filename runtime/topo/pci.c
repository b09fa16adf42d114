/* SPDX-License-Identifier: MIT */
/* PCI addresses, vendor ids and list-format sets: the vocabulary of the physical device list. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "topo/topology.h"

/* Exactly `min`..`max` hex digits ending at a separator `sep` (or the end when sep is 0). */
static int hex_field(const char **s, int min, int max, char sep, uint32_t *out)
{
	const char *p = *s;
	uint32_t v = 0;
	int n = 0;

	while (isxdigit((unsigned char)*p) && n <= max) {
		int c = tolower((unsigned char)*p);

		v = v * 16 + (uint32_t)(isdigit(c) ? c - '0' : c - 'a' + 10);
		p++;
		n++;
	}
	if (n < min || n > max || *p != sep)
		return APE_EINVAL;
	*s = sep ? p + 1 : p;
	*out = v;
	return 0;
}

int ape__pci_parse(const char *s, struct ape__pci_addr *out)
{
	uint32_t domain = 0, bus, dev, func;
	int colons = 0;

	if (!s)
		return APE_EINVAL;
	for (const char *p = s; *p; p++)
		colons += *p == ':';
	if (colons == 2 && hex_field(&s, 1, 7, ':', &domain))
		return APE_EINVAL;
	if ((colons != 1 && colons != 2) || hex_field(&s, 1, 2, ':', &bus) ||
	    hex_field(&s, 1, 2, '.', &dev) || hex_field(&s, 1, 1, '\0', &func))
		return APE_EINVAL;
	if (domain > APE__PCI_DOMAIN_MAX || dev > 0x1f || func > 7)
		return APE_EINVAL;
	out->domain = domain;
	out->bus = (uint8_t)bus;
	out->dev = (uint8_t)dev;
	out->func = (uint8_t)func;
	return 0;
}

void ape__pci_format(const struct ape__pci_addr *a, char *buf, size_t cap)
{
	snprintf(buf, cap, "%04x:%02x:%02x.%x", (unsigned)a->domain, a->bus, a->dev, a->func);
}

int ape__pci_cmp(const struct ape__pci_addr *a, const struct ape__pci_addr *b)
{
	if (a->domain != b->domain)
		return a->domain < b->domain ? -1 : 1;
	if (a->bus != b->bus)
		return a->bus < b->bus ? -1 : 1;
	if (a->dev != b->dev)
		return a->dev < b->dev ? -1 : 1;
	return (a->func > b->func) - (a->func < b->func);
}

static const struct vendor {
	uint16_t id;
	const char *name;
	bool display_only;
} vendors[] = {
	{ 0x10de, "NVIDIA", false },
	{ 0x1002, "AMD", false },
	{ 0x1022, "AMD", false },
	{ 0x8086, "Intel", false },
	{ 0x1da3, "Habana Labs", false },
	{ 0x1e52, "Tenstorrent", false },
	{ 0x1ed5, "Moore Threads", false },
	{ 0x13b5, "Arm", false },
	{ 0x5143, "Qualcomm", false },
	{ 0x1a03, "ASPEED", true }, /* BMC graphics on most servers */
	{ 0x102b, "Matrox", true },
	{ 0x1013, "Cirrus Logic", true }, /* QEMU's default VGA */
	{ 0x1234, "QEMU", true }, /* bochs-display */
	{ 0x1af4, "virtio", true },
	{ 0x1b36, "QEMU", true }, /* QXL */
	{ 0x15ad, "VMware", true },
	{ 0x1414, "Microsoft", true }, /* Hyper-V synthetic video */
	{ 0x80ee, "VirtualBox", true },
};

static const struct vendor *find_vendor(uint16_t id)
{
	for (size_t i = 0; i < sizeof(vendors) / sizeof(vendors[0]); i++)
		if (vendors[i].id == id)
			return &vendors[i];
	return NULL;
}

const char *ape__pci_vendor_name(uint16_t vendor_id)
{
	const struct vendor *v = find_vendor(vendor_id);

	return v ? v->name : NULL;
}

bool ape__pci_display_only(uint16_t vendor_id)
{
	const struct vendor *v = find_vendor(vendor_id);

	return v && v->display_only;
}

/* Is `word` in `s` as a whole word, ignoring case? */
static bool has_word(const char *s, const char *word)
{
	size_t n = strlen(word);

	for (const char *p = s; *p; p++)
		if (!strncasecmp(p, word, n) && (p == s || !isalnum((unsigned char)p[-1])) &&
		    !isalnum((unsigned char)p[n]))
			return true;
	return false;
}

uint16_t ape__vendor_id_from_name(const char *vendor)
{
	if (!vendor)
		return 0;
	if (has_word(vendor, "NVIDIA"))
		return 0x10de;
	if (has_word(vendor, "AMD") || has_word(vendor, "Advanced Micro Devices"))
		return 0x1002;
	if (has_word(vendor, "Intel") || has_word(vendor, "Intel(R)"))
		return 0x8086;
	return 0;
}

bool ape__pci_compute_class(uint16_t class_id)
{
	return (class_id >> 8) == 0x03 || (class_id >> 8) == 0x12 || class_id == 0x0b40;
}

/* Calls fn(x) for each member of a list-format set; false when the list is malformed. */
static bool list_walk(const char *list, bool (*fn)(int x, void *arg), void *arg)
{
	const char *p = list;

	if (!list)
		return false;
	while (*p) {
		char *end;
		long lo = strtol(p, &end, 10), hi;

		if (end == p || lo < 0 || !isdigit((unsigned char)*p))
			return false;
		hi = lo;
		if (*end == '-') {
			p = end + 1;
			if (!isdigit((unsigned char)*p))
				return false;
			hi = strtol(p, &end, 10);
			if (hi < lo)
				return false;
		}
		for (long x = lo; x <= hi && x < 1 << 20; x++)
			if (!fn((int)x, arg))
				return true;
		if (*end == ',' && end[1])
			end++;
		else if (*end)
			return false;
		p = end;
	}
	return true;
}

static bool count_one(int x, void *arg)
{
	(void)x;
	++*(int *)arg;
	return true;
}

static bool take_first(int x, void *arg)
{
	*(int *)arg = x;
	return false;
}

struct has_arg {
	int x;
	bool found;
};

static bool find_one(int x, void *arg)
{
	struct has_arg *h = arg;

	if (x == h->x)
		h->found = true;
	return !h->found;
}

int ape__list_count(const char *list)
{
	int n = 0;

	return list_walk(list, count_one, &n) ? n : 0;
}

int ape__list_first(const char *list)
{
	int first = -1;

	return list_walk(list, take_first, &first) ? first : -1;
}

bool ape__list_has(const char *list, int x)
{
	struct has_arg h = { x, false };

	return list_walk(list, find_one, &h) && h.found;
}
