/* SPDX-License-Identifier: MIT */
/* JSON output for the tools' --json modes: strings from drivers may hold anything. */
#ifndef APE_TOOLS_JSON_H
#define APE_TOOLS_JSON_H

#include <stdio.h>

/* Writes `s` as a JSON string literal, quotes included; NULL is written as null. */
void json_string(FILE *f, const char *s);
/* The same without the quotes (a piece of a longer string); NULL writes nothing. */
void json_string_body(FILE *f, const char *s);

#endif
