/* SPDX-License-Identifier: MIT */
/* The README's example is docs/example.c, word for word, and it builds and runs, in the tree
 * and from an installed copy as the README says. */
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ape_test.h"

extern char **environ;

TEST(readme_shows_docs_example_verbatim)
{
	char *readme = (char *)test_read_file(APE_SOURCE_DIR "/README.md", NULL);
	char *example = (char *)test_read_file(APE_SOURCE_DIR "/docs/example.c", NULL);

	ASSERT_NE(NULL, readme);
	ASSERT_NE(NULL, example);
	EXPECT_NE(NULL, strstr(readme, example)) TH_LOG("README.md's C example differs from docs/example.c");
	free(readme);
	free(example);
}

TEST(example_runs)
{
	char *const argv[] = { APE_BUILD_DIR "/examples/example", NULL };
	char out[] = "/tmp/ape-example-XXXXXX";
	posix_spawn_file_actions_t fa;
	int fd = mkstemp(out), status = -1;
	pid_t pid;
	char *text;

	ASSERT_LE(0, fd);
	ASSERT_EQ(0, posix_spawn_file_actions_init(&fa));
	ASSERT_EQ(0, posix_spawn_file_actions_adddup2(&fa, fd, 1));
#ifdef __SANITIZE_ADDRESS__
	/* the example runs on the best device: PoCL and LLVM keep allocations past exit (this
	 * test's child only: the harness forked it) */
	setenv("LSAN_OPTIONS", "suppressions=" APE_SOURCE_DIR "/tests/lsan.supp", 1);
#endif
	ASSERT_EQ(0, posix_spawn(&pid, argv[0], &fa, NULL, argv, environ)) TH_LOG("%s", argv[0]);
	ASSERT_EQ(pid, waitpid(pid, &status, 0));
	posix_spawn_file_actions_destroy(&fa);
	close(fd);
	text = (char *)test_read_file(out, NULL);
	unlink(out);
	ASSERT_NE(NULL, text);
	EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	EXPECT_NE(NULL, strstr(text, "ran on ")) TH_LOG("output: %s", text);
	free(text);
}

/* test_run_script()'s extra environment: the reference backend (the point is building and
 * loading, not the device) */
static const char *const script_env[] = { "APE_BACKEND=ref",
#ifdef __SANITIZE_ADDRESS__
					  /* the installed libape is this ASan build; a.out is not
					   * one, so the ASan runtime cannot come first in its library
					   * list */
					  "ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0",
#endif
					  NULL };

/*
 * README.md's lines for building the example against an installed libape, run as they stand:
 * `make install PREFIX=$HOME/.local` into a temporary HOME (make runs in the source tree, with
 * the variables this build was made with, so that it neither reconfigures nor rebuilds it),
 * then the export, the cc line with pkg-config from that prefix, and the program.
 */
TEST(readme_build_lines_work_against_an_install)
{
	char dir[] = "/tmp/ape-install-XXXXXX", path[4200], *script, *block, *readme, *example;
	char *stamp_before, *stamp_after, *log;
	size_t len;

	readme = (char *)test_read_file(APE_SOURCE_DIR "/README.md", NULL);
	example = (char *)test_read_file(APE_SOURCE_DIR "/docs/example.c", NULL);
	ASSERT_NE(NULL, readme);
	ASSERT_NE(NULL, example);
	block = test_doc_block(readme, "cc example.c ");
	ASSERT_NE(NULL, block) TH_LOG("README.md has no ```sh block with a 'cc example.c' line");
	EXPECT_NE(NULL, strstr(block, "make install")) TH_LOG("%s", block);
	ASSERT_NE(NULL, mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/example.c", dir);
	ASSERT_EQ(0, test_write_text(path, example));
	len = strlen(block) + 8192;
	script = malloc(len);
	ASSERT_NE(NULL, script);
	snprintf(script, len,
		 "set -ex\ncd '%s'\n"
		 "make() { command make --no-print-directory -C '%s' %s \"$@\"; }\n%s",
		 dir, APE_SOURCE_DIR, APE_MAKE_OVERRIDES, block);
	stamp_before = (char *)test_read_file(APE_BUILD_DIR "/config.stamp", NULL);
	EXPECT_EQ(0, test_run_script(dir, "readme", script, script_env)) TH_LOG("%s", script);
	snprintf(path, sizeof(path), "%s/log", dir);
	log = (char *)test_read_file(path, NULL);
	ASSERT_NE(NULL, log);
	EXPECT_NE(NULL, strstr(log, "ran on ")) TH_LOG("output:\n%s", log);
	stamp_after = (char *)test_read_file(APE_BUILD_DIR "/config.stamp", NULL);
	EXPECT_TRUE(stamp_before && stamp_after && !strcmp(stamp_before, stamp_after))
		TH_LOG("make install reconfigured %s: its variables were not passed on",
		       APE_BUILD_DIR);
	test_rmtree(dir);
	free(stamp_before);
	free(stamp_after);
	free(log);
	free(script);
	free(block);
	free(example);
	free(readme);
}

/*
 * README's set-up lines: `make deps run` installs what the library, its tools and the main job
 * need, not the Python test environment (PyTorch: a few GB); `make deps check`, `make
 * deps-python` and `make deps` alone do install it. Dry runs (make -n) in the source tree, with
 * this build's variables, which record no suite time in the build (tests/timed.sh: make runs
 * the lines holding $(MAKE) even in a dry run; this test runs inside `make check`).
 */
TEST(deps_install_python_only_for_goals_that_need_it)
{
	static const struct {
		const char *goals;
		bool python;
	} cases[] = { { "deps run", false }, { "deps check", true }, { "deps-python", true },
		      { "deps", true } };
	char dir[] = "/tmp/ape-deps-XXXXXX", path[4200], script[8192];
	char *log, *times_before, *times_after;

	times_before = (char *)test_read_file(APE_BUILD_DIR "/check-times", NULL);
	ASSERT_NE(NULL, mkdtemp(dir));
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		snprintf(script, sizeof(script),
			 "set -e\ncommand make --no-print-directory -n -C '%s' %s %s\n",
			 APE_SOURCE_DIR, APE_MAKE_OVERRIDES, cases[c].goals);
		EXPECT_EQ(0, test_run_script(dir, "readme", script, script_env)) TH_LOG("%s", script);
		snprintf(path, sizeof(path), "%s/log", dir);
		log = (char *)test_read_file(path, NULL);
		ASSERT_NE(NULL, log);
		EXPECT_EQ(cases[c].python, strstr(log, "tools/deps-python.sh") != NULL)
		TH_LOG("make -n %s:\n%s", cases[c].goals, log);
		if (strcmp(cases[c].goals, "deps-python"))
			EXPECT_NE(NULL, strstr(log, "tools/deps.sh"))
			TH_LOG("make -n %s:\n%s", cases[c].goals, log);
		free(log);
	}
	times_after = (char *)test_read_file(APE_BUILD_DIR "/check-times", NULL);
	EXPECT_TRUE((!times_before && !times_after) ||
		    (times_before && times_after && !strcmp(times_before, times_after)))
	TH_LOG("a dry run recorded suite times in %s/check-times: %s", APE_BUILD_DIR,
	       times_after ? times_after : "(removed)");
	free(times_before);
	free(times_after);
	test_rmtree(dir);
}

TEST_HARNESS_MAIN
