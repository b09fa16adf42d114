/* libape inside an application that owns its OpenCL context, queue and buffers (docs/embedding.md).
 * cc embed_example.c $(pkg-config --cflags --libs libape) -lOpenCL */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <ape/ape.h>
#include <stdio.h>
#include <stdlib.h>

enum { B = 1, H = 4, L = 128, D = 64, N = B * H * L * D };

static int fail(const char *what, int err)
{
	fprintf(stderr, "%s: %s: %s\n", what, ape_err_name(err), ape_last_error());
	return err == APE_ENOTSUP || err == APE_ENODEV ? 77 : 1; /* 77: cannot run here */
}

int main(void)
{
	static float host_qkv[3][N], o[N], o_host[N];
	cl_platform_id platform;
	cl_device_id cldev;
	cl_int clerr;
	ape_context_options opts;
	ape_context *ctx = NULL;
	ape_device *devs[16], *dev = NULL;
	ape_buffer *buf[4] = { NULL };
	ape_queue *queue = NULL;
	ape_attn_desc desc;
	ape_dtensor t[4];
	ape_tensor h[4];
	cl_mem mem[4];
	int err, n, status = 1;

	for (int i = 0; i < 3 * N; i++)
		host_qkv[i / N][i % N] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;

	/* 1. the application's own OpenCL objects */
	if (clGetPlatformIDs(1, &platform, NULL) != CL_SUCCESS ||
	    clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &cldev, NULL) != CL_SUCCESS) {
		fprintf(stderr, "no OpenCL device\n");
		return 77;
	}
	cl_context clctx = clCreateContext(NULL, 1, &cldev, NULL, NULL, &clerr);
	cl_command_queue cq = clCreateCommandQueue(clctx, cldev, 0, &clerr); /* in order */
	for (int i = 0; i < 4; i++)
		mem[i] = clCreateBuffer(clctx, CL_MEM_READ_WRITE, sizeof(o), NULL, &clerr);
	for (int i = 0; i < 3; i++)
		clEnqueueWriteBuffer(cq, mem[i], CL_FALSE, 0, sizeof(o), host_qkv[i], 0, NULL, NULL);

	/* 2. libape on that context: the device it lists for cldev computes on its cl_mem */
	ape_context_options_init(&opts);
	opts.backends = "opencl";
	opts.opencl_context = clctx;
	opts.opencl_device = cldev;
	if ((err = ape_context_create(&ctx, &opts))) {
		status = fail("ape_context_create", err);
		goto out_cl;
	}
	n = ape_device_list(ctx, devs, 16);
	for (int i = 0; i < n && !dev; i++) {
		void *c, *d;

		if (!ape_device_native(devs[i], &c, &d) && c == clctx && d == cldev)
			dev = devs[i];
	}
	if (!dev) {
		fprintf(stderr, "libape built no device on the application's cl_context\n");
		status = 77;
		goto out;
	}

	/* 3. wrap the buffers and the queue; describe the tensors; enqueue */
	for (int i = 0; i < 4; i++)
		if ((err = ape_buffer_wrap_opencl(dev, mem[i], &buf[i]))) {
			status = fail("ape_buffer_wrap_opencl", err);
			goto out;
		}
	if ((err = ape_queue_wrap_opencl(dev, cq, &queue))) {
		status = fail("ape_queue_wrap_opencl", err);
		goto out;
	}
	ape_attn_desc_init(&desc);
	desc.delta.value = 0.397f;
	desc.lambda.value = 0.1f;
	for (int i = 0; i < 4; i++)
		ape_dtensor_init(&t[i], buf[i], 0, APE_F32, B, H, L, D);
	/* checked at once (nothing enqueued on an error); runs after the writes above */
	if ((err = ape_attention_enqueue(queue, &desc, &t[0], &t[1], &t[2], &t[3], NULL))) {
		status = fail("ape_attention_enqueue", err);
		goto out;
	}
	/* the application's own work on its queue comes after libape's: here, reading O */
	clEnqueueReadBuffer(cq, mem[3], CL_FALSE, 0, sizeof(o), o, 0, NULL, NULL);
	/* waits for the queue; a failure on the device is reported here, naming the call */
	if ((err = ape_queue_synchronize(queue))) {
		status = fail("ape_queue_synchronize", err);
		goto out;
	}

	/* 4. the same call from host memory, for comparison */
	for (int i = 0; i < 4; i++)
		ape_tensor_init(&h[i], i < 3 ? host_qkv[i] : o_host, APE_F32, B, H, L, D);
	if ((err = ape_attention_forward(dev, &desc, &h[0], &h[1], &h[2], &h[3], NULL, NULL))) {
		status = fail("ape_attention_forward", err);
		goto out;
	}
	double worst = 0;

	for (int i = 0; i < N; i++)
		worst = o[i] - o_host[i] > worst ? o[i] - o_host[i]
			: o_host[i] - o[i] > worst ? o_host[i] - o[i] : worst;
	printf("O from the application's cl_mem: max |O - host call| = %.3g\n", worst);
	status = worst <= 1e-5 ? 0 : 1;
out:
	/* libape's wrappers first (they hold references), then the context, then the
	 * application's objects, which stay the application's */
	ape_queue_destroy(queue);
	for (int i = 0; i < 4; i++)
		ape_buffer_free(buf[i]);
	ape_context_destroy(ctx);
out_cl:
	for (int i = 0; i < 4; i++)
		clReleaseMemObject(mem[i]);
	clReleaseCommandQueue(cq);
	clReleaseContext(clctx);
	return status;
}
