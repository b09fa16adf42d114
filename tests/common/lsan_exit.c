/* SPDX-License-Identifier: MIT */
/*
 * The Kselftest harness runs each test in a forked child that ends with _exit(), which skips the
 * atexit hook where LeakSanitizer checks for leaks. Under ASan we supply _exit ourselves: a
 * passing child runs the leak check first and fails (exit 23, LSan's code) if anything leaked.
 */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#include <sys/syscall.h>
#include <unistd.h>

void _exit(int status)
{
	if (status == 0 && __lsan_do_recoverable_leak_check())
		status = 23;
	syscall(SYS_exit_group, status);
	__builtin_unreachable();
}
#else
typedef int ape_lsan_exit_unused; /* ISO C forbids an empty translation unit */
#endif
