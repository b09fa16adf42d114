/* SPDX-License-Identifier: MIT */
/*
 * The OpenCL entry points the backend calls, reached through a table that ocl_loader.c fills
 * from libOpenCL.so.1 (the ICD loader) at the first probe. libape is never linked against it, so
 * a program using libape starts where no OpenCL is installed: the backend is then absent, with
 * the reason. The backend's files call clFoo() as usual; the macros below send each call
 * through the table.
 */
#ifndef APE_OPENCL_OCL_API_H
#define APE_OPENCL_OCL_API_H

#include <CL/cl.h>
#include <stddef.h>

#pragma GCC visibility push(hidden)

#define APE__OCL_ENTRY_POINTS(X)                                                                   \
	X(clBuildProgram) X(clCreateBuffer) X(clCreateCommandQueue) X(clCreateContext)             \
	X(clCreateKernel) X(clCreateProgramWithBinary) X(clCreateProgramWithSource)                \
	X(clEnqueueBarrierWithWaitList) X(clEnqueueCopyBuffer) X(clEnqueueFillBuffer)               \
	X(clEnqueueMarkerWithWaitList)                                                             \
	X(clEnqueueNDRangeKernel) X(clEnqueueReadBuffer) X(clEnqueueWriteBuffer) X(clFinish)       \
	X(clGetCommandQueueInfo) X(clGetContextInfo)                                               \
	X(clGetDeviceIDs) X(clGetDeviceInfo) X(clGetEventInfo) X(clGetEventProfilingInfo)          \
	X(clGetKernelWorkGroupInfo) X(clGetMemObjectInfo) X(clGetPlatformIDs) X(clGetPlatformInfo) \
	X(clGetProgramBuildInfo) X(clGetProgramInfo) X(clReleaseCommandQueue) X(clReleaseContext)  \
	X(clReleaseEvent) X(clReleaseKernel) X(clReleaseMemObject) X(clReleaseProgram)             \
	X(clRetainCommandQueue) X(clRetainContext) X(clRetainEvent) X(clRetainMemObject)          \
	X(clSetKernelArg) X(clSetMemObjectDestructorCallback) X(clWaitForEvents)

struct ape__ocl_api {
#define APE__OCL_MEMBER(f) __typeof__(f) *f;
	APE__OCL_ENTRY_POINTS(APE__OCL_MEMBER)
#undef APE__OCL_MEMBER
};

extern struct ape__ocl_api ape__ocl;

/* Opens libOpenCL.so.1 and fills ape__ocl, once per process (thread-safe). 0, or -1 with why
 * it cannot be used in `why` ("cannot load libOpenCL.so.1, the ICD loader (...): ..."). */
int ape__ocl_load(char *why, size_t cap);

#pragma GCC visibility pop

/* Every call goes through the table (ocl_loader.c itself needs the real names). */
#ifndef APE__OCL_LOADER
#define clBuildProgram ape__ocl.clBuildProgram
#define clCreateBuffer ape__ocl.clCreateBuffer
#define clCreateCommandQueue ape__ocl.clCreateCommandQueue
#define clCreateContext ape__ocl.clCreateContext
#define clCreateKernel ape__ocl.clCreateKernel
#define clCreateProgramWithBinary ape__ocl.clCreateProgramWithBinary
#define clCreateProgramWithSource ape__ocl.clCreateProgramWithSource
#define clEnqueueBarrierWithWaitList ape__ocl.clEnqueueBarrierWithWaitList
#define clEnqueueCopyBuffer ape__ocl.clEnqueueCopyBuffer
#define clEnqueueFillBuffer ape__ocl.clEnqueueFillBuffer
#define clEnqueueMarkerWithWaitList ape__ocl.clEnqueueMarkerWithWaitList
#define clEnqueueNDRangeKernel ape__ocl.clEnqueueNDRangeKernel
#define clEnqueueReadBuffer ape__ocl.clEnqueueReadBuffer
#define clEnqueueWriteBuffer ape__ocl.clEnqueueWriteBuffer
#define clFinish ape__ocl.clFinish
#define clGetCommandQueueInfo ape__ocl.clGetCommandQueueInfo
#define clGetContextInfo ape__ocl.clGetContextInfo
#define clGetDeviceIDs ape__ocl.clGetDeviceIDs
#define clGetDeviceInfo ape__ocl.clGetDeviceInfo
#define clGetEventInfo ape__ocl.clGetEventInfo
#define clGetEventProfilingInfo ape__ocl.clGetEventProfilingInfo
#define clGetKernelWorkGroupInfo ape__ocl.clGetKernelWorkGroupInfo
#define clGetMemObjectInfo ape__ocl.clGetMemObjectInfo
#define clGetPlatformIDs ape__ocl.clGetPlatformIDs
#define clGetPlatformInfo ape__ocl.clGetPlatformInfo
#define clGetProgramBuildInfo ape__ocl.clGetProgramBuildInfo
#define clGetProgramInfo ape__ocl.clGetProgramInfo
#define clReleaseCommandQueue ape__ocl.clReleaseCommandQueue
#define clReleaseContext ape__ocl.clReleaseContext
#define clReleaseEvent ape__ocl.clReleaseEvent
#define clReleaseKernel ape__ocl.clReleaseKernel
#define clReleaseMemObject ape__ocl.clReleaseMemObject
#define clReleaseProgram ape__ocl.clReleaseProgram
#define clRetainCommandQueue ape__ocl.clRetainCommandQueue
#define clRetainContext ape__ocl.clRetainContext
#define clRetainEvent ape__ocl.clRetainEvent
#define clRetainMemObject ape__ocl.clRetainMemObject
#define clSetKernelArg ape__ocl.clSetKernelArg
#define clSetMemObjectDestructorCallback ape__ocl.clSetMemObjectDestructorCallback
#define clWaitForEvents ape__ocl.clWaitForEvents
#endif

#endif
