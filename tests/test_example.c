/* SPDX-License-Identifier: MIT */
/* The README's example is docs/example.c, word for word, and it builds and runs. */
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

TEST_HARNESS_MAIN
