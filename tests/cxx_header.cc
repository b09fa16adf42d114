// SPDX-License-Identifier: MIT
// Compiled (not run) by `make check`: ape.h, ape_dlpack.h and ape_backend.h must be usable from
// C++ as they are from C (a vendor's backend plugin may be C++).
#include <ape/ape.h>
#include <ape/ape_backend.h>
#include <ape/ape_dlpack.h>

int ape_cxx_header_check(void);

// A plugin's table and entry point, as C++ writes them.
static int cxx_probe(struct ape_backend *be, struct ape_be_probe_result *res)
{
	(void)be;
	(void)res;
	return 0;
}

// (C++11: no designated initialisers, so members by assignment; C++20 may use
// APE_BACKEND_PLUGIN_HEAD)
static struct ape_backend_plugin cxx_table;

const struct ape_backend_plugin *ape_backend_plugin(void)
{
	cxx_table.abi_major = APE_BACKEND_ABI_MAJOR;
	cxx_table.abi_minor = APE_BACKEND_ABI_MINOR;
	cxx_table.struct_size = sizeof(cxx_table);
	cxx_table.name = "cxx";
	cxx_table.probe = cxx_probe;
	return &cxx_table;
}

int ape_cxx_header_check(void)
{
	ape_attn_desc desc;
	ape_tensor t;
	ape_stats st;
	float x = 0;

	ape_attn_desc_init(&desc);
	ape_tensor_init(&t, &x, APE_F32, 1, 1, 1, 1);
	ape_stats_init(&st);
	desc.causal = false;
	// the enum words: from_name gives an int (or an error), C++ converts it explicitly
	desc.layout = static_cast<ape_rope_layout>(ape_rope_layout_from_name("interleaved"));
	// the backward pass's declarations, as C++ sees them
	auto backward = &ape_attention_backward;
	auto backward_ex = &ape_attention_backward_ex;
	(void)backward;
	(void)backward_ex;
	// the device-resident calls and the DLPack one
	auto enqueue = &ape_attention_enqueue;
	auto dlpack = &ape_attention_forward_dlpack;
	auto enqueue_diag = &ape_attention_enqueue_diag;
	auto dlpack_diag = &ape_attention_forward_dlpack_diag;
	(void)enqueue;
	(void)dlpack;
	(void)enqueue_diag;
	(void)dlpack_diag;
	return ape_version() == APE_VERSION && APE_EINVAL < 0 && ape_strerror(APE_ENOMEM) != nullptr &&
	       ape_dtype_name(APE_F16)[0] == 'f' && ape_rope_layout_name(desc.layout) != nullptr;
}
