/* Build-time probe (Makefile): do the OpenCL headers and the ICD loader work here? */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

int main(void)
{
	cl_uint n;

	return (int)clGetPlatformIDs(0, 0, &n);
}
