/* SPDX-License-Identifier: MIT */
#include "ape/ape.h"

#define APE__STR2(x) #x
#define APE__STR(x) APE__STR2(x)

unsigned ape_version(void)
{
	return APE_VERSION;
}

const char *ape_version_string(void)
{
	return APE__STR(APE_VERSION_MAJOR) "." APE__STR(APE_VERSION_MINOR) "." APE__STR(
		APE_VERSION_PATCH);
}
